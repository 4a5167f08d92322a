"""Freezing a container's cgroup, so memory and files are captured at one instant."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from hermit_common.errors import CheckpointFailed
from hermit_node.container import freezer_cgroup, parse_cgroups


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


def settle(init_pid: int, *, kill: bool) -> bool:
    """After a restart of the node-agent: thaw the container of ``init_pid`` if an earlier
    run left it frozen, first ending its tree (SIGKILL to the pid namespace's init) when
    ``kill``. True when it was frozen."""
    cgroup = freezer_cgroup(parse_cgroups(Path(f"/proc/{init_pid}/cgroup").read_text()))
    if cgroup is None or not is_frozen(cgroup):
        return False
    if kill:
        os.kill(init_pid, signal.SIGKILL)  # lands as the tree thaws
    thaw(cgroup)
    return True


class Trees:
    """The node-agent's adapter for settling frozen trees at start-up."""

    def settle(self, init_pid: int, *, kill: bool) -> bool:
        return settle(init_pid, kill=kill)
