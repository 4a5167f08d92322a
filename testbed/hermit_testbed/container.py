"""A running container as the host sees it: its init pid and what hangs off /proc/<pid>."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hermit_testbed.errors import TestbedError
from hermit_testbed.proc import pid_alive, wait_for
from hermit_testbed.procfs import (
    cgroup_host_paths,
    parse_mountinfo,
    read_text,
    root_mount,
)
from hermit_testbed.procfs import ns_inode as _ns_inode


@dataclass(frozen=True)
class Mount:
    """A bind mount of a host path into a container."""

    host: Path
    container: str
    readonly: bool = False

    def ctr_arg(self) -> str:
        """The value of ``ctr run --mount`` for this mount."""
        mode = "ro" if self.readonly else "rw"
        return f"type=bind,src={self.host},dst={self.container},options=rbind:{mode}"


@dataclass(frozen=True)
class Container:
    """A container started by ``Containerd.run``; ``init_pid`` is its PID 1 on the host."""

    id: str
    init_pid: int
    log_path: Path
    namespace: str
    image_ref: str

    def rootfs(self) -> Path:
        """The container's root as seen from the host (``/proc/<init>/root``)."""
        return Path(f"/proc/{self.init_pid}/root")

    def upperdir(self) -> Path:
        """The overlay upperdir of the container's root mount (its writable layer)."""
        mount = root_mount(parse_mountinfo(read_text(f"/proc/{self.init_pid}/mountinfo")))
        if mount.fstype != "overlay":
            raise TestbedError(f"container {self.id}: / is {mount.fstype}, not overlay")
        upper = mount.super_option("upperdir")
        if upper is None:
            raise TestbedError(f"container {self.id}: overlay root has no upperdir option")
        return Path(upper)

    def cgroup_paths(self) -> dict[str, Path]:
        """Host cgroup directory per controller (``memory``, ``name=systemd``, ``unified``...)."""
        return cgroup_host_paths(
            read_text(f"/proc/{self.init_pid}/cgroup"), read_text("/proc/self/mountinfo")
        )

    def ns_inode(self, ns: str) -> int:
        """Inode of the init's ``ns`` namespace (``net``, ``pid``, ``mnt``, ``uts``, ``ipc``)."""
        return _ns_inode(self.init_pid, ns)

    def netns_inode(self) -> int:
        """Inode of the container's network namespace."""
        return self.ns_inode("net")

    def stdio_links(self) -> tuple[str, str]:
        """``readlink /proc/<init>/fd/1`` and ``fd/2`` (``pipe:[N]`` for shim-managed I/O)."""
        try:
            return (
                os.readlink(f"/proc/{self.init_pid}/fd/1"),
                os.readlink(f"/proc/{self.init_pid}/fd/2"),
            )
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise TestbedError(f"container {self.id}: init {self.init_pid} is gone") from exc

    def alive(self) -> bool:
        """True while the container's init runs (a zombie counts as exited)."""
        return pid_alive(self.init_pid)

    def wait_exit(self, timeout: float) -> None:
        """Wait until the init has exited; TestbedError at the deadline."""
        wait_for(lambda: not self.alive(), timeout, f"container {self.id} to exit")

    def read_log(self) -> str:
        """Everything the container wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, text: str, timeout: float) -> str:
        """Wait until ``text`` appears in the log; return the whole log."""
        wait_for(lambda: text in self.read_log(), timeout, f"{text!r} in {self.log_path}")
        return self.read_log()
