"""Pure parsers for /proc files (mountinfo, cgroup) plus thin readers around them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from hermit_testbed.errors import TestbedError

_OCTAL = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """Undo the octal escapes (\\040 for a space) the kernel puts in mountinfo paths."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class MountInfo:
    """One line of /proc/<pid>/mountinfo."""

    mount_id: int
    parent_id: int
    root: str
    mount_point: str
    options: str
    fstype: str
    source: str
    super_options: str

    def super_option(self, key: str) -> str | None:
        """Value of ``key=`` in the super options (e.g. overlay ``upperdir``), or None."""
        for item in split_options(self.super_options):
            name, sep, value = item.partition("=")
            if sep and name == key:
                return value
        return None


def split_options(options: str) -> list[str]:
    """Split a comma-separated option string, honouring backslash-escaped commas."""
    parts: list[str] = []
    current: list[str] = []
    escaped = False
    for ch in options:
        if escaped:
            current.append(ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == ",":
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return parts


def parse_mountinfo(text: str) -> list[MountInfo]:
    """Parse the text of a mountinfo file."""
    mounts: list[MountInfo] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        left, sep, right = line.partition(" - ")
        if not sep:
            raise TestbedError(f"malformed mountinfo line: {line!r}")
        lf = left.split()
        rf = right.split()
        mounts.append(
            MountInfo(
                mount_id=int(lf[0]),
                parent_id=int(lf[1]),
                root=unescape(lf[3]),
                mount_point=unescape(lf[4]),
                options=lf[5],
                fstype=rf[0],
                source=unescape(rf[1]) if len(rf) > 1 else "",
                super_options=rf[2] if len(rf) > 2 else "",
            )
        )
    return mounts


def root_mount(mounts: list[MountInfo]) -> MountInfo:
    """The mount that is visible at ``/`` (the last one stacked there wins)."""
    at_root = [m for m in mounts if m.mount_point == "/"]
    if not at_root:
        raise TestbedError("no / mount in mountinfo")
    return at_root[-1]


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """Map each hierarchy of /proc/<pid>/cgroup to its path.

    Keys are controller names (``memory``, ``cpu``), named hierarchies
    (``name=systemd``) and ``""`` for the unified (v2) hierarchy.
    """
    result: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            result[controller] = path
    return result


def cgroup_mounts(mounts: list[MountInfo]) -> dict[str, MountInfo]:
    """Map each cgroup hierarchy key (as in ``parse_proc_cgroup``) to its mount."""
    result: dict[str, MountInfo] = {}
    for m in mounts:
        if m.fstype == "cgroup2":
            result.setdefault("", m)
        elif m.fstype == "cgroup":
            for opt in split_options(m.super_options):
                if opt in ("rw", "ro") or opt.startswith(("release_agent=", "clone_children")):
                    continue
                result.setdefault(opt, m)
    return result


def cgroup_host_paths(proc_cgroup: str, host_mountinfo: str) -> dict[str, Path]:
    """Host directories of every hierarchy a process belongs to.

    Keys as in ``parse_proc_cgroup``, except the unified hierarchy is ``unified``.
    Hierarchies that are not mounted on the host are left out.
    """
    mounts = cgroup_mounts(parse_mountinfo(host_mountinfo))
    paths: dict[str, Path] = {}
    for key, path in parse_proc_cgroup(proc_cgroup).items():
        mount = mounts.get(key)
        if mount is None:
            continue
        rel = os.path.relpath(path, mount.root) if path.startswith(mount.root) else path
        rel = "" if rel == "." else rel.lstrip("/")
        paths[key or "unified"] = Path(mount.mount_point) / rel
    return paths


def read_text(path: str | Path) -> str:
    """Read a /proc file; a vanished process becomes a TestbedError."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise TestbedError(f"cannot read {path}: process is gone") from exc


def ns_inode(pid: int | str, ns: str) -> int:
    """Inode number of the ``ns`` namespace (net, pid, mnt, ...) of ``pid``."""
    try:
        return os.stat(f"/proc/{pid}/ns/{ns}").st_ino
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise TestbedError(f"cannot stat /proc/{pid}/ns/{ns}: process is gone") from exc
