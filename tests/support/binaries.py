"""Where the tests find a component hack/ builds: $HERMIT_CACHE/bin first, then PATH."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def cached_binary(name: str, install_hint: str) -> str:
    """The executable ``name``; fails the test with ``install_hint`` when there is none."""
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache" / "hermit"))
    candidate = cache / "bin" / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        pytest.fail(install_hint)
    return found
