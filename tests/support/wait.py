"""Waiting on a condition with a deadline: the one ``wait_until`` of every test tier
(tests/e2e/cluster.py re-exports it for the e2e and fault tests)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest
from kubernetes.client.exceptions import ApiException

T = TypeVar("T")


def wait_until(what: str, timeout: float, probe: Callable[[], T | None], every: float = 1.0
               ) -> T:
    """Polls ``probe`` every ``every`` seconds until it returns something other than None
    or False, and returns that; fails naming ``what`` once ``timeout`` seconds passed. An
    API error (a Kubernetes API server restarting, an object not there yet) is another
    try, named in the failure."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            result = probe()
            if result is not None and result is not False:
                return result
        except ApiException as exc:
            last_error = f" (last error: {exc.status} {exc.reason})"
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}{last_error}")
        time.sleep(every)
