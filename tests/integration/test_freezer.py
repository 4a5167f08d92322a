"""Ending a frozen tree: no process of it runs again after the checkpoint (real cgroup
freezer, real pid namespace)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermit_node import freezer
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

V1_FREEZER = Path("/sys/fs/cgroup/freezer")
V2_ROOT = Path("/sys/fs/cgroup")


def _new_cgroup() -> Path:
    name = f"hermit-test-{uuid.uuid4().hex[:8]}"
    if V1_FREEZER.is_dir():
        path = V1_FREEZER / name
    elif (V2_ROOT / "cgroup.controllers").exists():
        path = V2_ROOT / name
    else:
        pytest.fail("no cgroup freezer here: mount the v1 freezer hierarchy at "
                    "/sys/fs/cgroup/freezer or run on cgroup v2 (as root)")
    path.mkdir()
    return path


@pytest.fixture
def cgroup() -> Iterator[Path]:
    path = _new_cgroup()
    try:
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        freezer.thaw(path)
        deadline = time.monotonic() + 10
        while True:
            try:
                path.rmdir()
                break
            except OSError:
                assert time.monotonic() < deadline, f"cannot remove {path}"
                time.sleep(0.05)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def test_a_frozen_tree_is_ended_without_running_again(cgroup: Path, tmp_path: Path) -> None:
    """A pid namespace whose init waits for a child that writes a line every 10 ms, as a
    sandbox's workload ticks. Frozen past the child's next tick, then ended: the file
    does not grow by a byte (with SIGKILL to the init alone, the child ran first)."""
    ticks = tmp_path / "ticks"
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "sh", "-c",
         f"echo $$ > {cgroup}/cgroup.procs; "
         f"sh -c 'while :; do echo tick >> {ticks}; sleep 0.01; done' & wait"])
    try:
        wait_until("the child to tick", 10, lambda: _size(ticks) >= 20, 0.01)
        procs = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        assert len(procs) >= 2, f"init and child in the cgroup: {procs}"
        init = min(procs)
        freezer.freeze(cgroup)
        time.sleep(0.3)  # the child's next tick is due: it would run at the thaw
        frozen_size = _size(ticks)
        killed = freezer.end_frozen(cgroup, init)
        assert killed >= 2
        wait_until("the tree to end", 10,
                   lambda: not (cgroup / "cgroup.procs").read_text().split(), 0.01)
        assert _size(ticks) == frozen_size, "a process of the ended tree ran after the freeze"
    finally:
        proc.kill()
        proc.wait(timeout=10)
