"""Running host commands and polling with deadlines."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from hermit_testbed.errors import TestbedError


def which(name: str, *extra_dirs: str) -> str:
    """Absolute path of an executable, searching PATH, /usr/sbin, /sbin and ``extra_dirs``."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", *extra_dirs])
    found = shutil.which(name, path=path)
    if found is None:
        raise TestbedError(f"{name} not found: run hack/install-containerd")
    return found


def run(
    args: Sequence[str],
    *,
    input_text: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    check: bool = True,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command, capture its output; on failure raise TestbedError with its stderr."""
    try:
        proc = subprocess.run(
            list(args),
            input=input_text,
            env=dict(env) if env is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=cwd,
        )
    except FileNotFoundError as exc:
        raise TestbedError(f"{args[0]} not found: run hack/install-containerd") from exc
    except subprocess.TimeoutExpired as exc:
        raise TestbedError(f"{' '.join(args)} timed out after {timeout:.0f}s") from exc
    if check and proc.returncode != 0:
        detail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        last = detail[-1] if detail else "no output"
        raise TestbedError(f"{' '.join(args[:4])} failed (exit {proc.returncode}): {last}")
    return proc


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll ``condition`` until it is true; raise TestbedError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() >= deadline:
            raise TestbedError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")
