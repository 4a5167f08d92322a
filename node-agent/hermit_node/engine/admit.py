"""The manifest policy: what a restore accepts from a checkpoint manifest (pure functions).

A manifest comes from S3, which a compromised node or tenant may write. Parsing
(``Manifest.from_json``) already refuses what is malformed: unsafe paths, unknown
kinds or fields, paths through a symlink, children listed before their directory,
unsound hardlinks, foreign extended attributes. ``admit`` then checks it against
what a restore on this node will do with it, before a byte is downloaded or written:

- sections: only the three a checkpoint makes, each with only the kinds it can hold
  (``RULES``): the CRIU images are regular files only (no symlink, FIFO, directory,
  hardlink, setuid/setgid bit or file capability: CRIU reads them as host root); the
  writable layer may hold overlay whiteouts and opaque dirs; the workspace no whiteouts;
- totals: the declared ``Totals`` are exactly what the entries hold, so the sizes the
  free-space check uses (``space_needs``) bound what the download writes;
- privileges: setuid/setgid bits and ``security.capability`` on non-directories are
  kept in the writable layer only where the new container's image has the same bit
  (with the same owner) or the same capability at the same path, and never in the
  workspace; elsewhere they are stripped and listed in ``Admitted.stripped``;
- the ``restore`` section: its mount, cgroup, netns and stdio keys are plain tokens
  (they are spliced into CRIU options), its paths absolute and normalized, and its
  ``workspace``, the mount a restore empties and refills, is the new pod's workspace.

docs/security.md ("Manifest policy") says why each rule is what it is.
"""

from __future__ import annotations

import posixpath
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from hermit_common.errors import CheckpointRefused, RestoreFailed
from hermit_common.manifest import Manifest
from hermit_common.tree import (
    KIND_DIR,
    KIND_FIFO,
    KIND_FILE,
    KIND_SYMLINK,
    KIND_WHITEOUT,
    KINDS,
    Entry,
)
from hermit_node.engine.checkpoint import (
    NETNS_KEY,
    SECTION_IMAGES,
    SECTION_ROOTFS,
    SECTION_WORKSPACE,
)

CAPABILITY_XATTR: Final = "security.capability"
PRIVILEGE_BITS: Final = stat.S_ISUID | stat.S_ISGID
_KEY_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CONTROLLER_RE: Final = re.compile(r"^[A-Za-z0-9_=.-]{1,64}$")
_PIPE_RE: Final = re.compile(r"^pipe:\[[0-9]{1,20}\]$")
_MAX_PATH: Final = 4096
_MAX_LISTED: Final = 10  # stripped paths named in a log line

# What a section does with setuid/setgid bits and file capabilities.
REFUSE: Final = "refuse"  # a legitimate checkpoint never has them there
FROM_IMAGE: Final = "from-image"  # kept where the new container's image has them
STRIP: Final = "strip"  # always removed


@dataclass(frozen=True)
class SectionRule:
    kinds: frozenset[str]
    hardlinks: bool
    privileges: str  # REFUSE, FROM_IMAGE or STRIP


RULES: Final[Mapping[str, SectionRule]] = {
    SECTION_IMAGES: SectionRule(frozenset({KIND_FILE}), hardlinks=False, privileges=REFUSE),
    SECTION_ROOTFS: SectionRule(frozenset(KINDS), hardlinks=True, privileges=FROM_IMAGE),
    SECTION_WORKSPACE: SectionRule(frozenset({KIND_FILE, KIND_DIR, KIND_SYMLINK, KIND_FIFO}),
                                   hardlinks=True, privileges=STRIP),
}


@dataclass(frozen=True)
class ImageFile:
    """A regular file of the new container's image, as far as privileges go."""

    mode: int  # st_mode
    uid: int
    gid: int
    capability: bytes | None  # the value of security.capability, if any


# Relative path in the container's root -> the image's regular file there, or None.
ImageLookup = Callable[[str], ImageFile | None]


@dataclass(frozen=True)
class Admitted:
    """What a restore may apply: the sections with privileges stripped where due."""

    sections: Mapping[str, tuple[Entry, ...]]
    stripped: tuple[str, ...]  # "rootfs/usr/bin/x (setuid, file capability)"
    workspace: str | None  # the new pod's mount point the workspace section replaces


def _show(path: str) -> str:
    """``path`` on one printable line (a name may hold a newline or undecodable bytes)."""
    return path.encode("unicode_escape").decode("ascii")


def _refuse(manifest: Manifest, message: str) -> CheckpointRefused:
    b = manifest.binding
    return CheckpointRefused(f"checkpoint {b.namespace}/{b.checkpoint} is refused: {message}")


def admit(manifest: Manifest, *, workspace_path: str | None, workspace_mounted: bool,
          image: ImageLookup) -> Admitted:
    """Checks ``manifest`` against the policy; returns what to apply.

    ``workspace_path``: the new pod's workspace mount point (None: it has none);
    ``workspace_mounted``: the new container has a bind mount there; ``image``:
    looks a path up in the new container's image. Raises CheckpointRefused (the
    same checkpoint never restores), or RestoreFailed when the new container lacks
    its workspace mount.
    """
    try:
        check_sections(manifest.sections)
        check_totals(manifest)
        check_restore_info(manifest.restore)
    except CheckpointRefused as exc:
        raise _refuse(manifest, str(exc)) from None
    workspace = check_workspace(manifest, workspace_path, workspace_mounted)
    sections: dict[str, tuple[Entry, ...]] = {}
    stripped: list[str] = []
    for name, entries in manifest.sections.items():
        sections[name], removed = drop_privileges(entries, RULES[name].privileges, image)
        stripped += [f"{name}/{what}" for what in removed]
    return Admitted(sections=sections, stripped=tuple(stripped), workspace=workspace)


def check_sections(sections: Mapping[str, Sequence[Entry]]) -> None:
    """Only the sections a checkpoint makes (the CRIU images among them), each holding
    only the kinds, hardlinks and privileges its rule allows. Raises CheckpointRefused."""
    unknown = sorted(set(sections) - set(RULES))
    if unknown:
        raise CheckpointRefused(f"it has sections {unknown} a restore does not know")
    if SECTION_IMAGES not in sections:
        raise CheckpointRefused(f"it has no {SECTION_IMAGES!r} section (no CRIU images)")
    for name, entries in sections.items():
        check_section(name, entries, RULES[name])


def check_section(name: str, entries: Sequence[Entry], rule: SectionRule) -> None:
    """Every entry of section ``name`` is of a kind ``rule`` allows; no hardlink where it
    allows none; no setuid/setgid bit or file capability where it refuses them."""
    for entry in entries:
        where = _show(f"{name}/{entry.path}")
        if entry.kind not in rule.kinds:
            raise CheckpointRefused(
                f"{where} is a {entry.kind}; the {name!r} section holds only "
                f"{', '.join(sorted(rule.kinds))}")
        if entry.link is not None and not rule.hardlinks:
            raise CheckpointRefused(
                f"{where} is a hardlink of {entry.link!r:.200}; the {name!r} section holds none")
        if rule.privileges == REFUSE and _privileges(entry):
            raise CheckpointRefused(
                f"{where} has {', '.join(_privileges(entry))}; the {name!r} section never does")


def _privileges(entry: Entry) -> list[str]:
    """The privileges ``entry`` would grant: setuid, setgid (not on a directory, where it
    only sets the group of new files) and a file capability."""
    if entry.kind in (KIND_DIR, KIND_SYMLINK, KIND_WHITEOUT):
        return []
    found = [name for bit, name in ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid"))
             if entry.mode & bit]
    if any(name == CAPABILITY_XATTR for name, _ in entry.xattrs):
        found.append("file capability")
    return found


def check_totals(manifest: Manifest) -> None:
    """The declared totals are what the entries hold: files, bytes, chunk references and
    distinct chunks. The free-space check and the download are bounded by these sizes."""
    files = manifest.files()
    actual = {
        "files": len(files),
        "image_bytes": sum(e.size for _, e in files),
        "chunks": sum(len(e.chunks) for _, e in files),
        "unique_chunks": len(manifest.chunk_digests()),
    }
    declared = manifest.totals.to_dict()
    wrong = [f"{name} {declared[name]} (the entries hold {value})"
             for name, value in actual.items() if declared[name] != value]
    if wrong:
        raise CheckpointRefused(f"its totals do not match its entries: {'; '.join(wrong)}")


def _abs_path(value: object) -> bool:
    """An absolute, normalized path without NUL, other than "/"."""
    return (isinstance(value, str) and value.startswith("/") and not value.startswith("//")
            and value != "/" and "\x00" not in value and len(value) <= _MAX_PATH
            and posixpath.normpath(value) == value)


def _tokens(value: object, what: str, key_re: re.Pattern[str],
            check_value: Callable[[object], bool]) -> None:
    if not isinstance(value, Mapping):
        raise CheckpointRefused(f"restore.{what} is not an object")
    for key, item in value.items():
        if not isinstance(key, str) or not key_re.match(key) or not check_value(item):
            raise CheckpointRefused(f"restore.{what} has an invalid entry {key!r:.80}")


def _controllers(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(c, str) and _CONTROLLER_RE.match(c) for c in value)


def _stdio_fd(value: object) -> bool:
    return not isinstance(value, bool) and value in (1, 2)


def check_restore_info(info: Mapping[str, Any]) -> None:
    """The ``restore`` section (checkpoint.restore_info) has the shapes a restore splices
    into CRIU options and paths: keys are plain tokens (a ``]`` or ``:`` in a key would
    rewrite an ``mnt[key]:path`` option), paths absolute and normalized, stdio fds 1 or 2.
    Unknown keys are ignored, as the restore ignores them."""
    if info.get("engine", 1) != 1:
        raise CheckpointRefused(f"restore.engine {info.get('engine')!r:.40} is not 1")
    net = info.get("netnsKey", NETNS_KEY)
    if not isinstance(net, str) or not _KEY_RE.match(net):
        raise CheckpointRefused(f"restore.netnsKey {net!r:.80} is not a plain token")
    _tokens(info.get("mounts", {}), "mounts", _KEY_RE, _abs_path)
    _tokens(info.get("cgroupMounts", {}), "cgroupMounts", _KEY_RE, _controllers)
    _tokens(info.get("stdio", {}), "stdio", _PIPE_RE, _stdio_fd)
    workspace = info.get("workspace")
    if workspace is not None and not _abs_path(workspace):
        raise CheckpointRefused(
            f"restore.workspace {workspace!r:.80} is not an absolute, normalized path")
    if not isinstance(info.get("hadUpperdir", False), bool):
        raise CheckpointRefused("restore.hadUpperdir is not a boolean")


def check_workspace(manifest: Manifest, workspace_path: str | None,
                    mounted: bool) -> str | None:
    """The mount the workspace section replaces: the new pod's workspace, nothing else.

    ``restore.workspace`` and the section go together; the path must be the new
    pod's workspace mount point. Returns it (None: no workspace to restore).
    """
    declared = manifest.restore.get("workspace")
    has_section = SECTION_WORKSPACE in manifest.sections
    if declared is None:
        if has_section:
            raise _refuse(manifest, "it has a workspace section but restore.workspace "
                                    "names no mount")
        return None
    if not has_section:
        raise _refuse(manifest, f"restore.workspace names {declared} but it has no "
                                "workspace section")
    if workspace_path is None or declared.rstrip("/") != workspace_path.rstrip("/"):
        raise _refuse(manifest, f"restore.workspace names {declared}, but the new pod's "
                                f"workspace is {workspace_path or 'none'}; a restore "
                                "replaces no other mount")
    if not mounted:
        raise RestoreFailed(f"the new container has no workspace mount at {workspace_path}")
    return str(declared)


def drop_privileges(entries: Sequence[Entry], policy: str,
                    image: ImageLookup) -> tuple[tuple[Entry, ...], list[str]]:
    """``entries`` without the privileges ``policy`` does not keep; and what was removed.

    FROM_IMAGE keeps setuid where the image's regular file at the same path is setuid
    with the same owner, setgid likewise with the same group, a file capability where
    the image's has the same value. Every name of a hardlinked inode must qualify (the
    names share one mode). ``image`` is only asked about entries with privileges.
    """
    keep: dict[str, tuple[int, bool]] = {}  # inode (first name) -> bits, capability kept
    for entry in entries:
        if _privileges(entry):
            allowed = _allowed(entry, image) if policy == FROM_IMAGE else (0, False)
            inode = entry.link or entry.path
            bits, cap = keep.get(inode, allowed)
            keep[inode] = (bits & allowed[0], cap and allowed[1])
    out: list[Entry] = []
    removed: list[str] = []
    for entry in entries:
        inode = entry.link or entry.path
        if inode not in keep:
            out.append(entry)
            continue
        bits, cap = keep[inode]
        lost = entry.mode & PRIVILEGE_BITS & ~bits
        xattrs = entry.xattrs if cap else tuple(
            (n, v) for n, v in entry.xattrs if n != CAPABILITY_XATTR)
        if lost or xattrs != entry.xattrs:
            names = [n for bit, n in ((stat.S_ISUID, "setuid"), (stat.S_ISGID, "setgid"))
                     if lost & bit] + (["file capability"] if xattrs != entry.xattrs else [])
            removed.append(f"{_show(entry.path)} ({', '.join(names)})")
            entry = replace(entry, mode=entry.mode & ~lost, xattrs=xattrs)
        out.append(entry)
    return tuple(out), removed


def _allowed(entry: Entry, image: ImageLookup) -> tuple[int, bool]:
    """The privilege bits and whether the capability of ``entry`` its image grants."""
    found = image(entry.path)
    if found is None or entry.kind != KIND_FILE or not stat.S_ISREG(found.mode):
        return 0, False
    bits = 0
    if found.mode & stat.S_ISUID and found.uid == entry.uid:
        bits |= stat.S_ISUID
    if found.mode & stat.S_ISGID and found.gid == entry.gid:
        bits |= stat.S_ISGID
    wanted = dict(entry.xattrs).get(CAPABILITY_XATTR)
    return bits, wanted is not None and found.capability == wanted


def describe_stripped(stripped: Sequence[str]) -> str:
    """One line naming the first stripped paths and how many there were."""
    shown = ", ".join(stripped[:_MAX_LISTED])
    more = f" and {len(stripped) - _MAX_LISTED} more" if len(stripped) > _MAX_LISTED else ""
    return f"{len(stripped)} paths: {shown}{more}"


# -- free space --------------------------------------------------------------------------

@dataclass(frozen=True)
class SpaceNeed:
    """Bytes a restore writes under ``path``; ``device`` and ``free`` are its filesystem's."""

    what: str
    path: str
    needed: int
    device: int = 0
    free: int = 0


def space_needs(manifest: Manifest, *, staging: str, rootfs: str | None,
                workspace: str | None) -> list[SpaceNeed]:
    """What the restore of ``manifest`` writes where (without ``device`` and ``free``).

    The download writes every file entry's size (a hardlink too) into ``staging``; the
    apply copies the writable layer into ``rootfs`` and the workspace into
    ``workspace``, where a hardlink takes no new space.
    """
    needs = [SpaceNeed("the download", staging, manifest.totals.image_bytes)]
    for section, path in ((SECTION_ROOTFS, rootfs), (SECTION_WORKSPACE, workspace)):
        entries = manifest.sections.get(section, ())
        if path is not None and entries:
            size = sum(e.size for e in entries if e.kind == KIND_FILE and e.link is None)
            needs.append(SpaceNeed(f"the {section} section", path, size))
    return needs


def check_free_space(needs: Sequence[SpaceNeed]) -> None:
    """Each filesystem has room for everything the restore writes to it.

    Raises RestoreFailed (retryable: free space is this node's state, not the
    checkpoint's; another node or a later try may have room) naming the bytes needed
    and free.
    """
    by_device: dict[int, list[SpaceNeed]] = {}
    for need in needs:
        by_device.setdefault(need.device, []).append(need)
    for group in by_device.values():
        needed = sum(n.needed for n in group)
        if needed > group[0].free:
            parts = " + ".join(f"{n.needed} bytes for {n.what} in {n.path}" for n in group)
            raise RestoreFailed(
                f"not enough free space: {parts} = {needed} bytes needed, "
                f"{group[0].free} bytes free on that filesystem")
