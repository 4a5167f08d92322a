"""Scratch cgroups for tests on the real freezer: one per test, in the v1 freezer
hierarchy or the cgroup2 one, its processes killed and the cgroup removed afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermit_node.host import freezer
from tests.support.wait import wait_until

V1_FREEZER = Path("/sys/fs/cgroup/freezer")
# The cgroup2 hierarchy: /sys/fs/cgroup on a v2 host, /sys/fs/cgroup/unified on a hybrid
# one like this test bed's (controllers on v1; freeze, cgroup.kill and cgroup.procs are
# v2's own files, there whatever controllers it has).
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
VERSIONS = ("v1", "v2")


def new_cgroup(version: str) -> Path:
    """An empty cgroup of ``version`` ("v1": the freezer hierarchy; "v2"); fails saying
    how to get the hierarchy when it is not mounted."""
    name = f"hermit-test-{uuid.uuid4().hex[:8]}"
    if version == "v1":
        if not V1_FREEZER.is_dir():
            pytest.fail("no cgroup v1 freezer here: mount the v1 freezer hierarchy at "
                        f"{V1_FREEZER} (as root)")
        path = V1_FREEZER / name
    else:
        roots = [r for r in V2_ROOTS if (r / "cgroup.controllers").exists()]
        if not roots:
            pytest.fail("no cgroup v2 hierarchy here: mount cgroup2 at /sys/fs/cgroup or "
                        "/sys/fs/cgroup/unified (as root)")
        path = roots[0] / name
    path.mkdir()
    return path


def removed(path: Path) -> bool:
    try:
        path.rmdir()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def scratch_cgroup(version: str) -> Iterator[Path]:
    """``new_cgroup(version)``; afterwards its processes are killed, it is thawed and
    removed."""
    path = new_cgroup(version)
    try:
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        freezer.thaw(path)
        wait_until(f"{path} removable", 10, lambda: removed(path), 0.05)
