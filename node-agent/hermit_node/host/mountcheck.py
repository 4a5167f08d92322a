"""Restored mounts are no wider than the new container's.

CRIU rebuilds a checkpoint's mount tree from its ``mountpoints-<id>.img`` images, as
host root, in a fresh mount namespace: it mounts each filesystem the images name with
the source, options and flags they give. A forged image could mount the node's disk
(``auto``/``ext4`` with ``/dev/vda1``), an overlay of host paths, devtmpfs,
binfmt_misc, debugfs or a writable cgroup v1 hierarchy, or drop the container's
read-only ``/proc/sys`` and its masks over ``/proc/kcore`` and friends, each a way out
of the sandbox. So before CRIU runs, the images' mounts are compared with the new
container's init's (``/proc/<pid>/mountinfo``, what the runtime and the pod spec
made):

- the root mount is not checked: CRIU puts the new container's rootfs there;
- an external mount (``ext_key``: a volume or cgroup hierarchy the restore maps onto
  the new container's own, restore.py) is checked only for its flags;
- any other mount is a tmpfs, devpts or mqueue (harmless anywhere), or a proc, sysfs,
  cgroup or cgroup2 mount where the container has one of the same type at the same
  path; every other filesystem type is refused;
- every mount of the container that restricts (read-only, nosuid, nodev, noexec, or any
  mount under /proc or /sys: the runtime's masks) is in the images at the same path
  with at least those flags;
- a second mount namespace needs CAP_SYS_ADMIN (a process could not have made one).

A mount restored narrower than it was dumped is no escape, so before that check the
images are narrowed to the new container (``narrow_entries``): each mount gets the
restricting flags that the container's mount at its path has and it lacks. A tree dumped
where the runtime mounted ``/dev/shm`` without nosuid, nodev and noexec (containerd 1.6)
then restores where it mounts them (containerd 2), instead of being refused. Mounts under
/proc and /sys are not narrowed: every runtime masks them alike, so a dump without those
flags there is forged, and refused.

Pure functions over plain data; ``read_image_mounts``, ``read_container_mounts`` and
``narrow_image_mounts`` are the thin readers and writer (criu.py decodes, size-bounded).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from hermit_common.errors import CheckpointRefused, RestoreFailed
from hermit_node.host import criu

# CRIU's fstype enum (images/mnt.proto) -> the kernel's name; AUTO takes its fsname.
FSTYPES: Final = {0: "unsupported", 1: "proc", 2: "sysfs", 3: "devtmpfs", 4: "binfmt_misc",
                  5: "tmpfs", 6: "devpts", 7: "simfs", 8: "pstore", 9: "securityfs",
                  10: "fusectl", 11: "debugfs", 12: "cgroup", 13: "aufs", 14: "mqueue",
                  15: "fuse", 16: "auto", 17: "overlay", 18: "autofs", 19: "tracefs",
                  23: "cgroup2"}
ANYWHERE: Final = frozenset({"tmpfs", "devpts", "mqueue"})
WHERE_THE_POD_HAS_ONE: Final = frozenset({"proc", "sysfs", "cgroup", "cgroup2"})
MS_RDONLY: Final = 1
MS_NOSUID: Final = 2
MS_NODEV: Final = 4
MS_NOEXEC: Final = 8
RESTRICTING: Final = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC
_FLAG_NAMES: Final = ((MS_RDONLY, "ro"), (MS_NOSUID, "nosuid"), (MS_NODEV, "nodev"),
                      (MS_NOEXEC, "noexec"))
MASKED_UNDER: Final = ("/proc/", "/sys/")
MAX_MOUNTS_IMAGE_BYTES: Final = 4 << 20  # ~100-300 bytes a mount: >10000 mounts
_MOUNTS_IMAGE: Final = re.compile(r"^mountpoints-\d+\.img$")


@dataclass(frozen=True)
class Mount:
    mountpoint: str  # as the tree's processes see it
    fstype: str
    flags: int  # of RESTRICTING (MS_* bits)
    external: bool = False  # mapped onto a mount of the new container (ext_key)
    root_mount: bool = False  # the tree's root: CRIU puts the new rootfs there


def flag_names(flags: int) -> str:
    return ",".join(name for bit, name in _FLAG_NAMES if flags & bit) or "none"


def violations(namespaces: Sequence[Sequence[Mount]], container: Sequence[Mount],
               can_mount: bool) -> list[str]:
    """How the images' mount namespaces are wider than ``container``'s mounts;
    ``can_mount``: the init holds CAP_SYS_ADMIN (it could mount anything itself)."""
    if can_mount:
        return []
    out = []
    if len(namespaces) > 1:
        out.append(f"{len(namespaces)} mount namespaces (a process without CAP_SYS_ADMIN "
                   "cannot make one)")
    pod = {m.mountpoint: m for m in container}
    for mounts in namespaces:
        out += namespace_violations(mounts, pod)
    return out


def namespace_violations(mounts: Sequence[Mount], pod: Mapping[str, Mount]) -> list[str]:
    out = []
    by_point: dict[str, list[Mount]] = {}
    for m in mounts:
        by_point.setdefault(m.mountpoint, []).append(m)
        if m.root_mount or m.external or m.fstype in ANYWHERE:
            continue
        theirs = pod.get(m.mountpoint)
        if m.fstype in WHERE_THE_POD_HAS_ONE and theirs is not None \
                and theirs.fstype == m.fstype:
            continue
        where = ("the new pod has none there" if theirs is None
                 else f"the new pod has {theirs.fstype} there")
        out.append(f"mount {m.mountpoint} asks a {m.fstype} mount; {where}")
    for point, theirs in pod.items():
        needed = theirs.flags & RESTRICTING
        if not needed and not point.startswith(MASKED_UNDER):
            continue
        ours = by_point.get(point, [])
        if not ours:
            out.append(f"mount {point} is missing; the new pod has a {theirs.fstype} mount "
                       f"there ({flag_names(needed)})")
            continue
        # Every mount stacked there (which one is seen depends on their order).
        for mine in ours:
            if needed & ~mine.flags:
                out.append(f"mount {point} asks flags {flag_names(mine.flags)}; the new "
                           f"pod mounts it {flag_names(needed)}")
                break
    return out


def narrow_entries(entries: Sequence[dict[str, Any]], container: Sequence[Mount]) -> list[str]:
    """Adds to each mount of one ``mountpoints-<id>.img`` (pycriu's entries, in place) the
    restricting flags that ``container``'s mount at the same path has and it lacks, but
    under /proc and /sys (the runtime's masks: ``check`` refuses a dump without them);
    what it changed, one "path +flags" each."""
    pod = {m.mountpoint: m for m in container}
    changed = []
    for entry in entries:
        theirs = pod.get(str(entry.get("mountpoint", "")))
        if theirs is None or theirs.mountpoint.startswith(MASKED_UNDER):
            continue
        flags = int(entry.get("flags", 0))
        missing = theirs.flags & RESTRICTING & ~flags
        if missing:
            entry["flags"] = flags | missing
            changed.append(f"{theirs.mountpoint} +{flag_names(missing)}")
    return changed


# -- parsers (pure) ----------------------------------------------------------------------

def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a ``/proc/<pid>/mountinfo`` (mount points as that process sees
    them), with their per-mount restricting flags."""
    out = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 6 or not right.split():
            continue
        options = set(fields[5].split(","))
        flags = sum(bit for bit, name in _FLAG_NAMES if name in options)
        point = fields[4].encode().decode("unicode_escape")  # \040 for a space
        out.append(Mount(point, right.split()[0], flags))
    return out


def image_mounts(entries: Sequence[Mapping[str, Any]]) -> list[Mount]:
    """The mounts of one ``mountpoints-<id>.img`` as pycriu decodes it. The root mount
    is the one whose parent is not in the image."""
    ids = {int(e.get("mnt_id", -1)) for e in entries}
    out = []
    for e in entries:
        code = int(e.get("fstype", 0))
        fstype = str(e.get("fsname") or "auto") if code == 16 else FSTYPES.get(code, str(code))
        out.append(Mount(
            mountpoint=str(e.get("mountpoint", "")), fstype=fstype,
            flags=int(e.get("flags", 0)) & RESTRICTING,
            external=bool(e.get("ext_key") or e.get("ext_mount")),
            root_mount=int(e.get("parent_mnt_id", -1)) not in ids))
    return out


# -- thin readers --------------------------------------------------------------------------

def read_image_mounts(images_dir: Path) -> list[list[Mount]]:
    """The mounts of each mount namespace the images hold."""
    return [image_mounts(criu.load_image(path, MAX_MOUNTS_IMAGE_BYTES)["entries"])
            for path in sorted(images_dir.iterdir()) if _MOUNTS_IMAGE.match(path.name)]


def narrow_image_mounts(images_dir: Path, container: Sequence[Mount]
                        ) -> tuple[list[list[Mount]], list[str]]:
    """``narrow_entries`` on every mount namespace image, each rewritten (a new file
    renamed over the old: the local copy, never a file shared with the chunk cache) only
    when something changed; the narrowed mounts of each namespace (as
    ``read_image_mounts`` would now read them) and what changed."""
    namespaces, changed = [], []
    for path in sorted(images_dir.iterdir()):
        if not _MOUNTS_IMAGE.match(path.name):
            continue
        image = criu.load_image(path, MAX_MOUNTS_IMAGE_BYTES)
        narrowed = narrow_entries(image["entries"], container)
        if narrowed:
            criu.save_image(path, image)
            changed += narrowed
        namespaces.append(image_mounts(image["entries"]))
    return namespaces, changed


def read_container_mounts(init_pid: int) -> list[Mount]:
    path = f"/proc/{init_pid}/mountinfo"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_mountinfo(f.read(8 << 20))
    except OSError as exc:
        # The container's state, not the checkpoint's: another try may work.
        raise RestoreFailed(f"cannot read {path} of the new container's init: {exc}") from None


def check(namespaces: Sequence[Sequence[Mount]], container: Sequence[Mount], can_mount: bool,
          what: str, shown: int = 6) -> None:
    """Raises CheckpointRefused naming ``what`` and the first violations."""
    found = violations(namespaces, container, can_mount)
    if found:
        more = f"; and {len(found) - shown} more" if len(found) > shown else ""
        raise CheckpointRefused(f"{what} is refused: its mounts would be wider than the new "
                                f"pod's: {'; '.join(found[:shown])}{more}")
