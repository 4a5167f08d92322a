"""Freezing a container's cgroup, so memory and files are captured at one instant."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hermit_common.errors import CheckpointFailed
from hermit_node.container import DEFAULT_CGROUP_ROOT, freezer_cgroup, process_cgroups


def _is_v1(cgroup: Path) -> bool:
    return (cgroup / "freezer.state").exists()


def freeze(cgroup: Path, timeout: float = 10.0) -> None:
    """Freeze every task of ``cgroup`` and wait until the kernel says it is frozen."""
    if _is_v1(cgroup):
        (cgroup / "freezer.state").write_text("FROZEN")
    else:
        (cgroup / "cgroup.freeze").write_text("1")
    deadline = time.monotonic() + timeout
    while not is_frozen(cgroup):
        if time.monotonic() > deadline:
            thaw(cgroup)
            raise CheckpointFailed(f"cgroup {cgroup} did not freeze within {timeout:.0f}s")
        if _is_v1(cgroup):
            # v1 may stay FREEZING when a task is in an uninterruptible sleep; asking again
            # makes the kernel retry those tasks.
            (cgroup / "freezer.state").write_text("FROZEN")
        time.sleep(0.001)


def thaw(cgroup: Path) -> None:
    if _is_v1(cgroup):
        (cgroup / "freezer.state").write_text("THAWED")
    else:
        (cgroup / "cgroup.freeze").write_text("0")


def is_frozen(cgroup: Path) -> bool:
    if _is_v1(cgroup):
        return (cgroup / "freezer.state").read_text().strip() == "FROZEN"
    return "frozen 1" in (cgroup / "cgroup.events").read_text()


def end_frozen(cgroup: Path, init_pid: int) -> int:
    """Ends every process of the frozen ``cgroup`` (the container of ``init_pid``), then
    thaws it; how many were sent SIGKILL. Each has its SIGKILL pending while still
    frozen, so none runs one more instruction of the workload after the checkpoint.
    (SIGKILL to the pid namespace's init alone reaches the others only once the init runs
    its exit, after the thaw: a process whose timer was due ran first, one tick on the
    old node after the state the new node restores.) On cgroup v2 the kernel does it
    for the whole subtree at once (``cgroup.kill``, Linux 5.14), which also catches a
    process forked meanwhile; v1 and older kernels get SIGKILL pid by pid."""
    if not _is_v1(cgroup) and (cgroup / "cgroup.kill").exists():
        procs = _procs(cgroup)
        (cgroup / "cgroup.kill").write_text("1")
        thaw(cgroup)
        return len(procs)
    killed = 0
    for pid in (*_procs(cgroup), init_pid):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    thaw(cgroup)
    return killed


def _procs(cgroup: Path) -> list[int]:
    """The processes of ``cgroup`` and of the cgroups below it."""
    pids: list[int] = []
    for procs in sorted(cgroup.rglob("cgroup.procs")):
        try:
            pids.extend(int(line) for line in procs.read_text().split())
        except OSError:
            continue  # a child cgroup removed meanwhile
    return pids


def settle(init_pid: int, *, kill: bool, cgroup_root: Path = DEFAULT_CGROUP_ROOT) -> bool:
    """After a restart of the node-agent: thaw the container of ``init_pid`` if an earlier
    run left it frozen, first ending its tree (``end_frozen``) when ``kill``. True when it
    was frozen."""
    cgroup = freezer_cgroup(process_cgroups(init_pid, cgroup_root), cgroup_root)
    if cgroup is None or not is_frozen(cgroup):
        return False
    if kill:
        end_frozen(cgroup, init_pid)
    else:
        thaw(cgroup)
    return True


class Trees:
    """The node-agent's adapter for settling frozen trees at start-up."""

    def __init__(self, cgroup_root: Path = DEFAULT_CGROUP_ROOT) -> None:
        self._cgroup_root = cgroup_root

    def settle(self, init_pid: int, *, kill: bool) -> bool:
        return settle(init_pid, kill=kill, cgroup_root=self._cgroup_root)
