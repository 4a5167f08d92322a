"""Describing a directory tree for a checkpoint, with overlayfs upperdir semantics.

``scan_tree`` walks a directory (a CRIU image dir, or a container's overlay
upperdir) without following symlinks and returns one ``Entry`` per path, sorted
by path. Overlay markers are kept as entries, never as device nodes:

- a character device 0:0, or a file with ``trusted.overlay.whiteout``, is a
  ``whiteout``: the path was deleted from the image's lower layers;
- a directory with ``trusted.overlay.opaque=y`` is ``opaque``: the lower
  contents of that directory are hidden.

Entries are also read back from manifests, which are untrusted input, so
``Entry.from_dict`` and ``check_entries`` validate every path and kind.
Hardlinks are stored as separate files. Unix sockets are skipped (they belong
to the process that bound them, and CRIU recreates them).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from hermit_common.errors import CheckpointFailed, CheckpointRefused

KIND_FILE: Final = "file"
KIND_DIR: Final = "dir"
KIND_SYMLINK: Final = "symlink"
KIND_FIFO: Final = "fifo"
KIND_WHITEOUT: Final = "whiteout"
KINDS: Final = (KIND_FILE, KIND_DIR, KIND_SYMLINK, KIND_FIFO, KIND_WHITEOUT)

_OPAQUE_XATTRS: Final = (b"trusted.overlay.opaque", b"user.overlay.opaque")
_WHITEOUT_XATTRS: Final = (b"trusted.overlay.whiteout", b"user.overlay.whiteout")
_DIGEST_RE: Final = re.compile(r"^[0-9a-f]{64}$")
_MAX_PATH: Final = 4096
_MAX_COMPONENT: Final = 255


class ManifestError(CheckpointRefused):
    """A manifest (or a part of it) is malformed or unsafe; it was refused."""


def check_rel_path(path: object, what: str = "path") -> str:
    """Returns ``path`` if it is a safe relative POSIX path; raises ManifestError otherwise.

    Safe: a non-empty string, not absolute, no NUL, no empty, ``.`` or ``..``
    components, at most 4096 characters, each component at most 255.
    """
    if not isinstance(path, str) or path == "":
        raise ManifestError(f"{what} {path!r} is not a non-empty string")
    if "\x00" in path:
        raise ManifestError(f"{what} {path!r} contains a NUL byte")
    if len(path) > _MAX_PATH:
        raise ManifestError(f"{what} {path[:64]!r}... is longer than {_MAX_PATH} characters")
    if path.startswith("/"):
        raise ManifestError(f"{what} {path!r} is absolute")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ManifestError(f"{what} {path!r} has an empty, '.' or '..' component")
        if len(part) > _MAX_COMPONENT:
            raise ManifestError(f"{what} {path!r} has a component longer than {_MAX_COMPONENT}")
    return path


def check_digest(value: object, what: str = "chunk digest") -> str:
    """Returns ``value`` if it is a lowercase hex sha256; raises ManifestError otherwise."""
    if not isinstance(value, str) or not _DIGEST_RE.match(value):
        raise ManifestError(f"{what} {value!r} is not a lowercase hex sha256")
    return value


@dataclass(frozen=True)
class Entry:
    """One path of a tree. ``chunks`` (sha256 of each uncompressed chunk) is set by the store."""

    path: str
    kind: str
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    target: str | None = None  # symlink only
    opaque: bool = False  # dir only
    chunks: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: only the fields that mean something for this kind."""
        out: dict[str, Any] = {"path": self.path, "kind": self.kind}
        if self.kind == KIND_WHITEOUT:
            return out
        out.update(mode=self.mode, uid=self.uid, gid=self.gid, mtime_ns=self.mtime_ns)
        if self.kind == KIND_FILE:
            out.update(size=self.size, chunks=list(self.chunks))
        elif self.kind == KIND_SYMLINK:
            out["target"] = self.target
        elif self.kind == KIND_DIR and self.opaque:
            out["opaque"] = True
        return out

    @classmethod
    def from_dict(cls, data: object) -> Entry:
        """Parses and validates one entry of an untrusted manifest."""
        if not isinstance(data, Mapping):
            raise ManifestError(f"tree entry {data!r:.80} is not an object")
        path = check_rel_path(data.get("path"), "entry path")
        kind = data.get("kind")
        if kind not in KINDS:
            raise ManifestError(f"entry {path!r} has unknown kind {kind!r}")
        unknown = sorted(set(data) - _allowed_fields(kind))
        if unknown:
            raise ManifestError(f"entry {path!r} ({kind}) has unexpected fields {unknown}")
        if kind == KIND_WHITEOUT:
            return cls(path=path, kind=kind)
        mode = _entry_int(data, path, "mode", 0o7777)
        uid = _entry_int(data, path, "uid", 2**32 - 1)
        gid = _entry_int(data, path, "gid", 2**32 - 1)
        mtime_ns = _entry_int(data, path, "mtime_ns", 2**63 - 1)
        if kind == KIND_FILE:
            size = _entry_int(data, path, "size", 2**63 - 1)
            chunks = _file_chunks(data, path)
            return cls(path, kind, mode, uid, gid, mtime_ns, size=size, chunks=chunks)
        if kind == KIND_SYMLINK:
            target = _symlink_target(data, path)
            return cls(path, kind, mode, uid, gid, mtime_ns, target=target)
        if kind == KIND_DIR:
            opaque = _dir_opaque(data, path)
            return cls(path, kind, mode, uid, gid, mtime_ns, opaque=opaque)
        return cls(path, kind, mode, uid, gid, mtime_ns)


def _allowed_fields(kind: str) -> set[str]:
    """The fields an entry of ``kind`` may carry in a manifest."""
    allowed = {"path", "kind"}
    if kind != KIND_WHITEOUT:
        allowed |= {"mode", "uid", "gid", "mtime_ns"}
    if kind == KIND_FILE:
        allowed |= {"size", "chunks"}
    elif kind == KIND_SYMLINK:
        allowed.add("target")
    elif kind == KIND_DIR:
        allowed.add("opaque")
    return allowed


def _entry_int(data: Mapping[str, object], path: str, name: str, maximum: int) -> int:
    """Field ``name`` of entry ``path``: an integer (not a bool) in ``[0, maximum]``."""
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"entry {path!r} field {name!r} is missing or not an integer")
    if not 0 <= value <= maximum:
        raise ManifestError(f"entry {path!r} field {name!r}={value} is out of range")
    return value


def _file_chunks(data: Mapping[str, object], path: str) -> tuple[str, ...]:
    """A file entry's ``chunks``: a list of lowercase hex sha256 digests."""
    raw_chunks = data.get("chunks")
    if not isinstance(raw_chunks, list):
        raise ManifestError(f"entry {path!r} field 'chunks' is missing or not a list")
    return tuple(check_digest(c, f"chunk digest of {path!r}") for c in raw_chunks)


def _symlink_target(data: Mapping[str, object], path: str) -> str:
    """A symlink entry's ``target``: a non-empty string without NUL, at most 4096 characters."""
    target = data.get("target")
    if not isinstance(target, str) or target == "" or "\x00" in target:
        raise ManifestError(f"symlink {path!r} has an invalid target {target!r:.80}")
    if len(target) > _MAX_PATH:
        raise ManifestError(f"symlink {path!r} target is longer than {_MAX_PATH}")
    return target


def _dir_opaque(data: Mapping[str, object], path: str) -> bool:
    """A dir entry's ``opaque`` flag: a boolean, false when absent."""
    opaque = data.get("opaque", False)
    if not isinstance(opaque, bool):
        raise ManifestError(f"dir {path!r} field 'opaque' is not a boolean")
    return opaque

def check_entries(entries: Sequence[Entry], chunk_size: int, section: str) -> None:
    """Validates a section's entries as a whole; raises ManifestError.

    Paths are unique; every entry's parent is a ``dir`` entry of the section
    (or the section root), so no path can lead through a symlink; each file's
    chunk count matches its size.
    """
    kinds: dict[str, str] = {}
    for entry in entries:
        if entry.path in kinds:
            raise ManifestError(f"section {section!r} lists {entry.path!r} twice")
        kinds[entry.path] = entry.kind
    for entry in entries:
        parent = entry.path.rpartition("/")[0]
        if parent and kinds.get(parent) != KIND_DIR:
            raise ManifestError(
                f"section {section!r} entry {entry.path!r} has no parent directory entry")
        if entry.kind == KIND_FILE:
            expected = -(-entry.size // chunk_size)
            if len(entry.chunks) != expected:
                raise ManifestError(
                    f"file {section}/{entry.path} of {entry.size} bytes lists "
                    f"{len(entry.chunks)} chunks, expected {expected}")


def _has_xattr(path: str, names: Iterable[bytes], values: tuple[bytes, ...] | None) -> bool:
    for name in names:
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
        if values is None or value in values:
            return True
    return False


def _entry_for(root: str, rel: str, st: os.stat_result) -> Entry | None:
    full = os.path.join(root, rel)
    mode, uid, gid, mtime = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns
    if stat.S_ISDIR(st.st_mode):
        opaque = _has_xattr(full, _OPAQUE_XATTRS, (b"y",))
        return Entry(rel, KIND_DIR, mode, uid, gid, mtime, opaque=opaque)
    if stat.S_ISREG(st.st_mode):
        if st.st_size == 0 and _has_xattr(full, _WHITEOUT_XATTRS, None):
            return Entry(rel, KIND_WHITEOUT)
        return Entry(rel, KIND_FILE, mode, uid, gid, mtime, size=st.st_size)
    if stat.S_ISLNK(st.st_mode):
        return Entry(rel, KIND_SYMLINK, mode, uid, gid, mtime, target=os.readlink(full))
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return Entry(rel, KIND_WHITEOUT)
    if stat.S_ISFIFO(st.st_mode):
        return Entry(rel, KIND_FIFO, mode, uid, gid, mtime)
    if stat.S_ISSOCK(st.st_mode):
        return None
    raise CheckpointFailed(
        f"cannot capture {full}: device node {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        " is not supported")


def scan_tree(root: Path) -> list[Entry]:
    """Describes every path under ``root`` (not ``root`` itself), sorted by path.

    File entries have no chunk digests yet; the store fills them in.
    Raises CheckpointFailed when ``root`` is not a directory or cannot be read.
    """
    top = os.fspath(root)
    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            raise CheckpointFailed(f"cannot capture {top}: not a directory")
    except FileNotFoundError:
        raise CheckpointFailed(f"cannot capture {top}: no such directory") from None
    entries: list[Entry] = []
    pending = [""]
    try:
        while pending:
            rel_dir = pending.pop()
            with os.scandir(os.path.join(top, rel_dir) if rel_dir else top) as it:
                for dirent in it:
                    rel = f"{rel_dir}/{dirent.name}" if rel_dir else dirent.name
                    entry = _entry_for(top, rel, dirent.stat(follow_symlinks=False))
                    if entry is None:
                        continue
                    entries.append(entry)
                    if entry.kind == KIND_DIR:
                        pending.append(rel)
    except OSError as exc:
        raise CheckpointFailed(f"cannot capture {top}: {exc.strerror or exc}") from None
    entries.sort(key=lambda e: e.path.encode("utf-8", "surrogateescape"))
    return entries
