"""Tests that need root (the node-agent's own privileges) fail without it, never skip."""

from __future__ import annotations

import os

import pytest


def require_root(why: str) -> None:
    """Fail the test, naming ``why``, unless it runs as root."""
    if os.geteuid() != 0:
        pytest.fail(f"run the integration tier as root ({why})", pytrace=False)
