"""Ending a frozen tree: no process of it runs again after the checkpoint (real cgroup
freezer, real pid namespace)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hermit_node.host import freezer
from tests.support.cgroups import V1_FREEZER, VERSIONS, scratch_cgroup
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

@pytest.fixture(params=VERSIONS)
def cgroup(request: pytest.FixtureRequest) -> Iterator[Path]:
    with scratch_cgroup(request.param) as path:
        yield path


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


@contextmanager
def _ticking_tree(cgroup: Path, ticks: Path) -> Iterator[None]:
    """A pid namespace in ``cgroup`` whose init waits for a child that appends a line to
    ``ticks`` every 10 ms, as a sandbox's workload ticks; killed on the way out."""
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "sh", "-c",
         f"echo $$ > {cgroup}/cgroup.procs; "
         f"sh -c 'while :; do echo tick >> {ticks}; sleep 0.01; done' & wait"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_frozen_tree_is_ended_without_running_again(cgroup: Path, tmp_path: Path) -> None:
    """A pid namespace whose init waits for a child that writes a line every 10 ms, as a
    sandbox's workload ticks. Frozen past the child's next tick, then ended: the file
    does not grow by a byte (with SIGKILL to the init alone, the child ran first)."""
    ticks = tmp_path / "ticks"
    with _ticking_tree(cgroup, ticks):
        wait_until("the child to tick", 10, lambda: _size(ticks) >= 20, 0.01)
        procs = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        assert len(procs) >= 2, f"init and child in the cgroup: {procs}"
        init = min(procs)
        freezer.freeze(cgroup)
        assert freezer.is_frozen(cgroup)
        time.sleep(0.3)  # the child's next tick is due: it would run at the thaw
        frozen_size = _size(ticks)
        killed = freezer.end_frozen(cgroup, init)
        assert killed >= 2
        wait_until("the tree to end", 10,
                   lambda: not (cgroup / "cgroup.procs").read_text().split(), 0.01)
        assert _size(ticks) == frozen_size, "a process of the ended tree ran after the freeze"


def test_a_tree_an_earlier_run_left_frozen_is_settled(cgroup: Path, tmp_path: Path) -> None:
    """A restarted node-agent finds the container's group from its init's
    /proc/<pid>/cgroup (on v2 the 0:: line, relative to the node's cgroup root) and ends
    the tree it finds frozen; one that is not frozen is left alone."""
    root = Path("/sys/fs/cgroup") if cgroup.parent == V1_FREEZER else cgroup.parent
    ticks = tmp_path / "ticks"
    with _ticking_tree(cgroup, ticks):
        wait_until("the child to tick", 10, lambda: _size(ticks) >= 5, 0.01)
        init = min(int(p) for p in (cgroup / "cgroup.procs").read_text().split())
        assert freezer.settle(init, kill=True, cgroup_root=root) is False
        assert not freezer.is_frozen(cgroup)
        freezer.freeze(cgroup)
        frozen_size = _size(ticks)
        assert freezer.settle(init, kill=True, cgroup_root=root) is True
        wait_until("the tree to end", 10,
                   lambda: not (cgroup / "cgroup.procs").read_text().split(), 0.01)
        assert _size(ticks) == frozen_size, "a process of the settled tree ran again"


@pytest.mark.parametrize("cgroup", ["v1"], indirect=True)
def test_what_a_restore_cut_short_left_is_read_from_real_processes(
        cgroup: Path, tmp_path: Path) -> None:
    """``restore_left`` on a real container-like cgroup (v1 freezer: the cluster's v1
    nodes; a hybrid host's v2 processes sit in the v1 root freezer, so the v2 flavour runs
    on the cluster's v2 nodes): an init alone is nothing restored; a process of the cgroup
    outside the init's subtree is CRIU still at work; a child of the init is the restored
    tree; ``end_container`` ends them all."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    # The init blocks in a builtin read (no child) until told, then starts its "tree".
    init = subprocess.Popen(["bash", "-c", f"echo $$ > {cgroup}/cgroup.procs; "
                             f"read x < {fifo}; sleep 600 & wait"])
    worker = None
    try:
        wait_until("the init in the cgroup", 10,
                   lambda: str(init.pid) in (cgroup / "cgroup.procs").read_text().split(),
                   every=0.02)
        assert freezer.restore_left(init.pid) == freezer.NOTHING_RESTORED
        worker = subprocess.Popen(["bash", "-c", f"echo $$ > {cgroup}/cgroup.procs; "
                                   "exec sleep 600"])
        wait_until("CRIU at work seen", 10,
                   lambda: freezer.restore_left(init.pid) == freezer.CRIU_AT_WORK, every=0.02)
        worker.kill()
        worker.wait()
        with open(fifo, "w") as go:
            go.write("go\n")
        wait_until("the restored tree seen", 10,
                   lambda: freezer.restore_left(init.pid) == freezer.TREE_RESTORED, every=0.02)
        assert freezer.end_container(init.pid) >= 2  # the init and its child (at least)
        init.wait(timeout=10)
        wait_until("the cgroup empty", 10,
                   lambda: not (cgroup / "cgroup.procs").read_text().split(), every=0.02)
        assert not freezer.is_frozen(cgroup)
    finally:
        for proc in (init, worker):  # the fixture ends the cgroup's processes; reap ours
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
