"""Freezing a container's cgroup, so memory and files are captured at one instant."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from hermit_common.errors import CheckpointFailed
from hermit_node.host.container import DEFAULT_CGROUP_ROOT, freezer_cgroup, process_cgroups


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


def container_cgroup(init_pid: int, cgroup_root: Path = DEFAULT_CGROUP_ROOT) -> Path | None:
    """The cgroup whose freezer controls the container of ``init_pid``."""
    return freezer_cgroup(process_cgroups(init_pid, cgroup_root), cgroup_root)


def settle(init_pid: int, *, kill: bool, cgroup_root: Path = DEFAULT_CGROUP_ROOT) -> bool:
    """After a restart of the node-agent: thaw the container of ``init_pid`` if an earlier
    run left it frozen, first ending its tree (``end_frozen``) when ``kill``. True when it
    was frozen."""
    cgroup = container_cgroup(init_pid, cgroup_root)
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

    def restore_left(self, init_pid: int) -> str:
        return restore_left(init_pid, cgroup_root=self._cgroup_root)

    def end(self, init_pid: int) -> int:
        return end_container(init_pid, cgroup_root=self._cgroup_root)


# What an earlier run of the node-agent left in a pod it was restoring (``restore_left``).
CRIU_AT_WORK = "criu-at-work"  # processes of the restore (the worker, CRIU) still run
TREE_RESTORED = "tree-restored"  # the restored tree runs under the container's init
NOTHING_RESTORED = "nothing-restored"  # the init waits alone: the restore never got to CRIU


def descendants(pid: int, proc_root: Path = Path("/proc")) -> set[int]:
    """Every process below ``pid`` (the children of each of its threads, recursively)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(proc_root, str(parent), "task").iterdir())
        except OSError:
            continue  # ended meanwhile
        for task in tasks:
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def restore_left(init_pid: int, *, cgroup_root: Path = DEFAULT_CGROUP_ROOT,
                 proc_root: Path = Path("/proc")) -> str:
    """Where a restore into the container of ``init_pid`` stands, read from its processes:
    the restore worker and CRIU join the container's cgroups but are not below its init;
    the tree CRIU restores is reparented to the init once the worker exits."""
    cgroup = container_cgroup(init_pid, cgroup_root)
    procs = set(_procs(cgroup)) if cgroup is not None else set()
    tree = descendants(init_pid, proc_root)
    if procs - tree - {init_pid}:
        return CRIU_AT_WORK
    return TREE_RESTORED if tree else NOTHING_RESTORED


def end_container(init_pid: int, *, cgroup_root: Path = DEFAULT_CGROUP_ROOT) -> int:
    """Ends every process of the container of ``init_pid`` (its init included), frozen
    first so none runs on; how many were sent SIGKILL. When it does not freeze (a task in
    an uninterruptible sleep) they are ended unfrozen."""
    cgroup = container_cgroup(init_pid, cgroup_root)
    if cgroup is None:
        os.kill(init_pid, signal.SIGKILL)
        return 1
    with contextlib.suppress(CheckpointFailed):  # freeze() thawed it: end them as they are
        freeze(cgroup)
    return end_frozen(cgroup, init_pid)
