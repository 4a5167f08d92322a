"""Waiting on a condition with a deadline, for the integration tests."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(what: str, check: Callable[[], object], timeout: float, every: float = 0.01
               ) -> None:
    """Polls ``check`` every ``every`` seconds until it is truthy; fails naming ``what``
    once ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(every)
