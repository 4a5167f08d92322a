"""Ending the helper servers the tests start (local-kms, AEMM, the registry)."""

from __future__ import annotations

import subprocess


def end(process: subprocess.Popen[bytes] | subprocess.Popen[str] | None,
        timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``timeout`` seconds; nothing for a
    process that already ended (or was never started)."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=timeout)
