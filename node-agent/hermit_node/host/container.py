"""What the engine needs to know about a running container, read from /proc and its OCI bundle.

Works for any OCI runtime shim whose working directory is the bundle (containerd's
runc shim is); a caller may also name the bundle explicitly.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hermit_common.errors import HermitError

_BIND_TYPES = {"bind", "rbind"}


@dataclass(frozen=True)
class BindMount:
    destination: str  # path inside the container
    source: str  # host path


@dataclass(frozen=True)
class CgroupMount:
    """A cgroup v1 hierarchy mounted in the container (runc binds the container's own group)."""

    mountpoint: str  # e.g. /sys/fs/cgroup/cpu
    controllers: frozenset[str]  # e.g. {"cpu"} or {"name=systemd"}


@dataclass(frozen=True)
class Cgroup:
    hierarchy: str  # "" for the v2 unified hierarchy, else the controller list e.g. "cpu,cpuacct"
    path: str  # path relative to the hierarchy's root

    def host_path(self, cgroup_root: str = "/sys/fs/cgroup") -> Path:
        if self.hierarchy == "":
            base = Path(cgroup_root) / "unified" if _is_hybrid(cgroup_root) else Path(cgroup_root)
        else:
            name = self.hierarchy.removeprefix("name=")
            base = Path(cgroup_root) / name
            if not base.exists():
                # Co-mounted controllers are mounted under one of their names.
                for part in self.hierarchy.split(","):
                    candidate = Path(cgroup_root) / part.removeprefix("name=")
                    if candidate.exists():
                        base = candidate
                        break
        return base / self.path.lstrip("/")


def _is_hybrid(cgroup_root: str) -> bool:
    return (Path(cgroup_root) / "unified").is_dir() and not is_unified(Path(cgroup_root))


DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")


def is_unified(cgroup_root: Path) -> bool:
    """True when the node's cgroup filesystem at ``cgroup_root`` is cgroup v2 alone (its
    root has ``cgroup.controllers``), as runc decides from the type of /sys/fs/cgroup."""
    return (cgroup_root / "cgroup.controllers").exists()


def node_cgroups(cgroups: tuple[Cgroup, ...], unified: bool) -> tuple[Cgroup, ...]:
    """The groups of a process that its node's runtime manages (pure): on a cgroup v2 node
    only the ``0::`` line. A kernel that also has v1 hierarchies mounted somewhere lists
    the process in them too, at the groups its runtime was in; they are not the
    container's and must not be frozen or joined."""
    return tuple(cg for cg in cgroups if cg.hierarchy == "") if unified else cgroups


@dataclass(frozen=True)
class ContainerView:
    """A snapshot of the facts about one container that checkpoint and restore use."""

    init_pid: int
    bundle: Path
    rootfs: Path
    upperdir: Path | None
    netns_inode: int
    stdio: tuple[str, str, str]  # readlink of fd 0, 1, 2 of the init
    bind_mounts: tuple[BindMount, ...]
    cgroups: tuple[Cgroup, ...] = field(default=())
    cgroup_mounts: tuple[CgroupMount, ...] = field(default=())
    cgroup_root: Path = DEFAULT_CGROUP_ROOT  # where the node's cgroup filesystem is

    def cgroup_dirs(self) -> list[Path]:
        """The host directories of the container's groups."""
        return [cg.host_path(str(self.cgroup_root)) for cg in self.cgroups]

    def bind_source(self, destination: str) -> str | None:
        for m in self.bind_mounts:
            if m.destination.rstrip("/") == destination.rstrip("/"):
                return m.source
        return None

    def cgroup_host_path(self, controllers: frozenset[str]) -> Path | None:
        """Host directory of this container's group in the hierarchy with ``controllers``."""
        for cg in self.cgroups:
            if cg.hierarchy and frozenset(cg.hierarchy.split(",")) == controllers:
                return cg.host_path(str(self.cgroup_root))
        return None

    def unified_cgroup(self) -> Path | None:
        """Host directory of this container's cgroup v2 group (a v2 node's only one)."""
        for cg in self.cgroups:
            if cg.hierarchy == "":
                return cg.host_path(str(self.cgroup_root))
        return None

    def freezer_cgroup(self) -> Path | None:
        """The cgroup directory whose freezer controls the whole container."""
        return freezer_cgroup(self.cgroups, self.cgroup_root)


def freezer_cgroup(cgroups: tuple[Cgroup, ...],
                   cgroup_root: Path = DEFAULT_CGROUP_ROOT) -> Path | None:
    """Of a process's cgroups, the directory whose freezer controls it (v1, else v2)."""
    for cg in cgroups:
        if "freezer" in cg.hierarchy.split(","):
            return cg.host_path(str(cgroup_root))
    for cg in cgroups:
        if cg.hierarchy == "":
            return cg.host_path(str(cgroup_root))
    return None


def process_cgroups(pid: int, cgroup_root: Path = DEFAULT_CGROUP_ROOT) -> tuple[Cgroup, ...]:
    """The groups of ``pid`` that its node's runtime manages (``node_cgroups``)."""
    return node_cgroups(parse_cgroups(Path(f"/proc/{pid}/cgroup").read_text()),
                        is_unified(cgroup_root))


def parse_cgroups(text: str) -> tuple[Cgroup, ...]:
    """Parse /proc/<pid>/cgroup."""
    groups = []
    for line in text.splitlines():
        if not line.strip():
            continue
        _, controllers, path = line.split(":", 2)
        groups.append(Cgroup(controllers, path))
    return tuple(groups)


def parse_root_upperdir(mountinfo: str) -> Path | None:
    """The overlay upperdir of the mount at "/" in a /proc/<pid>/mountinfo text, if any."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 10 or fields[4] != "/":
            continue
        sep = fields.index("-")
        fstype, super_options = fields[sep + 1], fields[sep + 3]
        if fstype != "overlay":
            return None
        for option in super_options.split(","):
            if option.startswith("upperdir="):
                return Path(option.removeprefix("upperdir="))
    return None


_MOUNT_OPTIONS = {"rw", "ro", "xattr", "noprefix", "clone_children", "cpuset_v2_mode"}


def parse_cgroup_mounts(mountinfo: str) -> tuple[CgroupMount, ...]:
    """The cgroup v1 mounts of a /proc/<pid>/mountinfo text."""
    mounts = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if fields[sep + 1] != "cgroup":
            continue
        controllers = frozenset(
            o for o in fields[sep + 3].split(",")
            if o not in _MOUNT_OPTIONS and not o.startswith("release_agent="))
        mounts.append(CgroupMount(fields[4], controllers))
    return tuple(mounts)


def parse_bind_mounts(oci_config: dict[str, object]) -> tuple[BindMount, ...]:
    mounts = oci_config.get("mounts", [])
    if not isinstance(mounts, list):
        return ()
    binds = []
    for m in mounts:
        if not isinstance(m, dict):
            continue
        options = m.get("options") or []
        if m.get("type") in _BIND_TYPES or any(o in _BIND_TYPES for o in options):
            binds.append(BindMount(str(m["destination"]), str(m["source"])))
    return tuple(binds)


def find_bundle(init_pid: int) -> Path:
    """The OCI bundle of the container whose init is ``init_pid``.

    The runtime shim's working directory is a bundle in the runtime's task directory;
    one shim may serve every container of a pod (containerd's runc v2 shim does), so
    the bundle is the sibling whose ``init.pid`` names this process.
    """
    ppid = _parent_pid(init_pid)
    cwd = Path(os.readlink(f"/proc/{ppid}/cwd"))
    candidates = [cwd]
    with contextlib.suppress(OSError):
        candidates += sorted(p for p in cwd.parent.iterdir() if p != cwd)
    for bundle in candidates:
        try:
            if (bundle / "init.pid").read_text().strip() == str(init_pid) and \
                    (bundle / "config.json").is_file():
                return bundle
        except OSError:
            continue
    raise HermitError(
        f"cannot find the OCI bundle of pid {init_pid}: no bundle next to its runtime "
        f"shim's working directory {cwd} has init.pid {init_pid}; pass the bundle explicitly")


def _parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name may contain spaces and parentheses; fields follow the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[1])


def inspect(init_pid: int, bundle: Path | None = None, *,
            cgroup_root: Path = DEFAULT_CGROUP_ROOT) -> ContainerView:
    """Read everything the engine needs about the container whose init is ``init_pid``;
    ``cgroup_root`` is where this node's cgroup filesystem is mounted."""
    if not Path(f"/proc/{init_pid}").exists():
        raise HermitError(f"no process with pid {init_pid}")
    bundle = bundle or find_bundle(init_pid)
    config = json.loads((bundle / "config.json").read_text())
    rootfs = Path(config.get("root", {}).get("path", "rootfs"))
    if not rootfs.is_absolute():
        rootfs = bundle / rootfs
    stdio = tuple(_readlink_or_empty(f"/proc/{init_pid}/fd/{n}") for n in range(3))
    mountinfo = Path(f"/proc/{init_pid}/mountinfo").read_text()
    return ContainerView(
        init_pid=init_pid,
        bundle=bundle,
        rootfs=rootfs,
        upperdir=parse_root_upperdir(mountinfo),
        netns_inode=os.stat(f"/proc/{init_pid}/ns/net").st_ino,
        stdio=(stdio[0], stdio[1], stdio[2]),
        bind_mounts=parse_bind_mounts(config),
        cgroups=process_cgroups(init_pid, cgroup_root),
        cgroup_mounts=parse_cgroup_mounts(mountinfo),
        cgroup_root=cgroup_root,
    )


def _readlink_or_empty(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
