"""Describing a directory tree for a checkpoint, with overlayfs upperdir semantics.

``scan_tree`` walks a directory (a CRIU image dir, or a container's overlay
upperdir) without following symlinks and returns one ``Entry`` per path, sorted
by path. Overlay markers are kept as entries, never as device nodes:

- a character device 0:0, or a file with ``trusted.overlay.whiteout``, is a
  ``whiteout``: the path was deleted from the image's lower layers;
- a directory with ``trusted.overlay.opaque=y`` is ``opaque``: the lower
  contents of that directory are hidden.

Extended attributes of files, dirs, symlinks and FIFOs are kept in ``xattrs``
(``user.*``, ``trusted.*``, ``security.*``, e.g. ``security.capability``), except
overlayfs' own markers (``trusted.overlay.*``, ``user.overlay.*``) and LSM labels
(``security.selinux``, ``security.SMACK64*``, ``security.apparmor``), which belong
to the node's policy and the new container's context, not to the tree.

Hardlinks: the first name (in path order) of a regular file with more than one
link is an ordinary ``file`` entry; every later name of the same inode in the
same tree is a ``file`` entry with ``link`` set to that first name. It carries
the same size, chunks and metadata as the first name (so a consumer that ignores
``link`` still gets the content, and the store uploads no new chunk for it).

Entries are also read back from manifests, which are untrusted input, so
``Entry.from_dict`` and ``check_entries`` validate every path, kind, link and
extended attribute. Unix sockets are skipped (they belong to the process that
bound them, and CRIU recreates them).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import errno
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

_XATTR_PREFIXES: Final = ("user.", "trusted.", "security.")
# overlayfs metadata (opaque is the ``opaque`` field, whiteouts are entries) and LSM labels.
_XATTR_EXCLUDED_PREFIXES: Final = ("trusted.overlay.", "user.overlay.", "security.SMACK64")
_XATTR_EXCLUDED: Final = frozenset({"security.selinux", "security.apparmor"})
_XATTR_NAME_RE: Final = re.compile(r"^(?:user|trusted|security)\.[\x21-\x7e]+$")
MAX_XATTR_NAME: Final = 255  # bytes, prefix included (the kernel's XATTR_NAME_MAX)
MAX_XATTR_VALUE: Final = 64 * 1024  # bytes (the kernel's XATTR_SIZE_MAX)
MAX_XATTRS_BYTES: Final = 256 * 1024  # names plus values, per entry
_MAX_XATTR_B64: Final = 4 * -(-MAX_XATTR_VALUE // 3)

Xattrs = tuple[tuple[str, bytes], ...]


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


def is_captured_xattr(name: str) -> bool:
    """Whether ``scan_tree`` keeps the extended attribute ``name`` (and fsapply manages it)."""
    return (name.startswith(_XATTR_PREFIXES) and not name.startswith(_XATTR_EXCLUDED_PREFIXES)
            and name not in _XATTR_EXCLUDED)


def check_xattrs(xattrs: Xattrs, what: str) -> Xattrs:
    """Returns ``xattrs`` if they are sorted, unique, captured names with sane sizes.

    Names: ``user.``, ``trusted.`` or ``security.`` then printable ASCII without
    spaces, at most 255 characters, captured (``is_captured_xattr``). Values: at most
    64 KiB each; names plus values at most 256 KiB. Raises ManifestError.
    """
    total = 0
    previous = ""
    for name, value in xattrs:
        if not isinstance(name, str) or not _XATTR_NAME_RE.match(name) \
                or len(name) > MAX_XATTR_NAME:
            raise ManifestError(f"{what} has an invalid extended attribute name {name!r:.80}")
        if not is_captured_xattr(name):
            raise ManifestError(f"{what} carries extended attribute {name!r}, which is never "
                                "captured (overlay metadata or an LSM label)")
        if name <= previous:
            raise ManifestError(f"{what} extended attributes are not sorted and unique")
        previous = name
        if not isinstance(value, bytes) or len(value) > MAX_XATTR_VALUE:
            raise ManifestError(
                f"{what} extended attribute {name!r} is not bytes of at most {MAX_XATTR_VALUE}")
        total += len(name) + len(value)
    if total > MAX_XATTRS_BYTES:
        raise ManifestError(
            f"{what} extended attributes take {total} bytes, more than {MAX_XATTRS_BYTES}")
    return xattrs


@dataclass(frozen=True)
class Entry:
    """One path of a tree. ``chunks`` (sha256 of each uncompressed chunk) is set by the store.

    ``chunk_lengths`` (files only): the byte length of each chunk, when the store cut the
    file at chosen places (CRIU page images, cut where the memory they hold is
    aligned, so pages shared by two processes make the same chunks); empty: every
    chunk is the manifest's ``chunk_size`` but the last (``chunk_spans``).
    ``link`` (files only): an earlier file entry of the same tree this path is a
    hardlink of. ``xattrs``: (name, value) pairs sorted by name; in JSON an object
    of base64 values, left out when there are none (and for whiteouts).
    """

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
    link: str | None = None  # file only: hardlink of this earlier path
    xattrs: Xattrs = field(default=())  # not whiteout
    chunk_lengths: tuple[int, ...] = field(default=())  # file only; empty: fixed size

    def chunk_spans(self, chunk_size: int) -> list[tuple[int, int]]:
        """(offset, length) of each chunk of this file, in order."""
        if self.chunk_lengths:
            spans, offset = [], 0
            for length in self.chunk_lengths:
                spans.append((offset, length))
                offset += length
            return spans
        return [(offset, min(chunk_size, self.size - offset))
                for offset in range(0, self.size, chunk_size)]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: only the fields that mean something for this kind."""
        out: dict[str, Any] = {"path": self.path, "kind": self.kind}
        if self.kind == KIND_WHITEOUT:
            return out
        out.update(mode=self.mode, uid=self.uid, gid=self.gid, mtime_ns=self.mtime_ns)
        if self.kind == KIND_FILE:
            out.update(size=self.size, chunks=list(self.chunks))
            if self.chunk_lengths:
                out["chunk_lengths"] = list(self.chunk_lengths)
        elif self.kind == KIND_SYMLINK:
            out["target"] = self.target
        elif self.kind == KIND_DIR and self.opaque:
            out["opaque"] = True
        if self.kind == KIND_FILE and self.link is not None:
            out["link"] = self.link
        if self.xattrs:
            out["xattrs"] = {name: base64.b64encode(value).decode("ascii")
                             for name, value in self.xattrs}
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
        xattrs = _entry_xattrs(data, path)
        if kind == KIND_FILE:
            size = _entry_int(data, path, "size", 2**63 - 1)
            chunks = _file_chunks(data, path)
            link = _file_link(data, path)
            return cls(path, kind, mode, uid, gid, mtime_ns, size=size, chunks=chunks,
                       link=link, xattrs=xattrs, chunk_lengths=_chunk_lengths(data, path))
        if kind == KIND_SYMLINK:
            target = _symlink_target(data, path)
            return cls(path, kind, mode, uid, gid, mtime_ns, target=target, xattrs=xattrs)
        if kind == KIND_DIR:
            opaque = _dir_opaque(data, path)
            return cls(path, kind, mode, uid, gid, mtime_ns, opaque=opaque, xattrs=xattrs)
        return cls(path, kind, mode, uid, gid, mtime_ns, xattrs=xattrs)


def _allowed_fields(kind: str) -> set[str]:
    """The fields an entry of ``kind`` may carry in a manifest."""
    allowed = {"path", "kind"}
    if kind != KIND_WHITEOUT:
        allowed |= {"mode", "uid", "gid", "mtime_ns", "xattrs"}
    if kind == KIND_FILE:
        allowed |= {"size", "chunks", "link", "chunk_lengths"}
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


def _chunk_lengths(data: Mapping[str, object], path: str) -> tuple[int, ...]:
    """A file entry's ``chunk_lengths``: absent, or a non-empty list of positive integers
    (``check_entries`` checks them against the size and the chunk size)."""
    if "chunk_lengths" not in data:
        return ()
    raw = data["chunk_lengths"]
    if not isinstance(raw, list) or not raw or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in raw):
        raise ManifestError(f"entry {path!r} field 'chunk_lengths' is not a non-empty list "
                            "of positive integers")
    return tuple(raw)


def _file_link(data: Mapping[str, object], path: str) -> str | None:
    """A file entry's ``link``: absent, or a safe relative path other than its own."""
    if "link" not in data:
        return None
    link = check_rel_path(data["link"], f"link of {path!r}")
    if link == path:
        raise ManifestError(f"file {path!r} is a hardlink of itself")
    return link


def _entry_xattrs(data: Mapping[str, object], path: str) -> Xattrs:
    """An entry's ``xattrs``: absent, or a non-empty object of name -> canonical base64."""
    if "xattrs" not in data:
        return ()
    raw = data["xattrs"]
    if not isinstance(raw, Mapping) or not raw or not all(isinstance(n, str) for n in raw):
        raise ManifestError(f"entry {path!r} field 'xattrs' is not a non-empty object")
    pairs = []
    for name in sorted(raw):
        encoded = raw[name]
        if not isinstance(encoded, str) or len(encoded) > _MAX_XATTR_B64:
            raise ManifestError(
                f"entry {path!r} extended attribute {name!r:.80} is not base64 of at most "
                f"{MAX_XATTR_VALUE} bytes")
        try:
            value = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ManifestError(
                f"entry {path!r} extended attribute {name!r:.80} is not valid base64") from None
        if base64.b64encode(value).decode("ascii") != encoded:
            raise ManifestError(
                f"entry {path!r} extended attribute {name!r:.80} is not canonical base64")
        pairs.append((name, value))
    return check_xattrs(tuple(pairs), f"entry {path!r}")


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

    Paths are unique; every entry's parent is a ``dir`` entry of the section listed
    before it (or the section root), so no path can lead through a symlink, and an
    applier that goes in order has made every parent a real directory before it writes
    under it (``scan_tree``'s byte order puts parents first); each file's chunk count
    matches its size; extended attributes are valid (``check_xattrs``); hardlinks are
    sound (``check_links``).
    """
    kinds: dict[str, str] = {}
    for entry in entries:
        if entry.path in kinds:
            raise ManifestError(f"section {section!r} lists {entry.path!r} twice")
        parent = entry.path.rpartition("/")[0]
        if parent and kinds.get(parent) != KIND_DIR:
            raise ManifestError(
                f"section {section!r} entry {entry.path!r} has no parent directory entry "
                "listed before it")
        kinds[entry.path] = entry.kind
    for entry in entries:
        check_xattrs(entry.xattrs, f"entry {section}/{entry.path}")
        if entry.kind == KIND_FILE:
            _check_file_chunks(entry, chunk_size, section)
    check_links(entries, section)


def _check_file_chunks(entry: Entry, chunk_size: int, section: str) -> None:
    """A file's chunk count matches its size; chosen chunk lengths cover exactly its
    size, none longer than the chunk size."""
    where = f"file {section}/{entry.path} of {entry.size} bytes"
    if entry.chunk_lengths:
        if len(entry.chunk_lengths) != len(entry.chunks) \
                or sum(entry.chunk_lengths) != entry.size \
                or max(entry.chunk_lengths) > chunk_size:
            raise ManifestError(
                f"{where} lists {len(entry.chunks)} chunks whose lengths "
                f"({len(entry.chunk_lengths)} of them, {sum(entry.chunk_lengths)} bytes, "
                f"up to {max(entry.chunk_lengths)}) do not cut it into chunks of at most "
                f"{chunk_size} bytes")
        return
    expected = -(-entry.size // chunk_size)
    if len(entry.chunks) != expected:
        raise ManifestError(
            f"{where} lists {len(entry.chunks)} chunks, expected {expected}")


def check_links(entries: Sequence[Entry], section: str) -> None:
    """Validates the hardlinks of a section's entries; raises ManifestError.

    An entry with ``link`` is a file; its ``link`` names an earlier file entry of the
    section that is not itself a link (never the entry itself, never a dir, symlink
    or FIFO), and the two describe the same inode: everything but the path is equal.
    """
    earlier: dict[str, Entry] = {}
    for entry in entries:
        if entry.link is not None:
            if entry.kind != KIND_FILE:
                raise ManifestError(
                    f"{entry.kind} {section}/{entry.path} has a link; only files can")
            source = earlier.get(entry.link)
            if source is None or source.kind != KIND_FILE or source.link is not None:
                raise ManifestError(
                    f"file {section}/{entry.path} is a hardlink of {entry.link!r}, which is "
                    "not an earlier file (and not itself a hardlink) of the section")
            if dataclasses.replace(entry, path=source.path, link=None) != source:
                raise ManifestError(
                    f"file {section}/{entry.path} is a hardlink of {entry.link!r} but its "
                    "size, chunks, metadata or extended attributes differ")
        earlier.setdefault(entry.path, entry)


def _has_xattr(path: str, names: Iterable[bytes], values: tuple[bytes, ...] | None) -> bool:
    for name in names:
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
        if values is None or value in values:
            return True
    return False


def _read_xattrs(full: str) -> Xattrs:
    """The captured extended attributes of ``full`` (not following a symlink), sorted."""
    try:
        names = os.listxattr(full, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return ()
        raise
    pairs = []
    for name in sorted(n for n in names if is_captured_xattr(n)):
        try:
            value = os.getxattr(full, name, follow_symlinks=False)
        except OSError as exc:
            if exc.errno == errno.ENODATA:  # removed since listed
                continue
            raise
        pairs.append((name, value))
    try:
        return check_xattrs(tuple(pairs), "it")
    except ManifestError as exc:
        raise CheckpointFailed(
            f"cannot capture the extended attributes of {full}: {exc}") from None


def _entry_for(root: str, rel: str, st: os.stat_result) -> Entry | None:
    full = os.path.join(root, rel)
    mode, uid, gid, mtime = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime_ns
    if stat.S_ISDIR(st.st_mode):
        opaque = _has_xattr(full, _OPAQUE_XATTRS, (b"y",))
        return Entry(rel, KIND_DIR, mode, uid, gid, mtime, opaque=opaque,
                     xattrs=_read_xattrs(full))
    if stat.S_ISREG(st.st_mode):
        if st.st_size == 0 and _has_xattr(full, _WHITEOUT_XATTRS, None):
            return Entry(rel, KIND_WHITEOUT)
        return Entry(rel, KIND_FILE, mode, uid, gid, mtime, size=st.st_size,
                     xattrs=_read_xattrs(full))
    if stat.S_ISLNK(st.st_mode):
        return Entry(rel, KIND_SYMLINK, mode, uid, gid, mtime, target=os.readlink(full),
                     xattrs=_read_xattrs(full))
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return Entry(rel, KIND_WHITEOUT)
    if stat.S_ISFIFO(st.st_mode):
        return Entry(rel, KIND_FIFO, mode, uid, gid, mtime, xattrs=_read_xattrs(full))
    if stat.S_ISSOCK(st.st_mode):
        return None
    raise CheckpointFailed(
        f"cannot capture {full}: device node {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        " is not supported")


def scan_tree(root: Path) -> list[Entry]:
    """Describes every path under ``root`` (not ``root`` itself), sorted by path.

    File entries have no chunk digests yet; the store fills them in. The later
    names of a regular file with several links under ``root`` get ``link`` (the
    first name). Raises CheckpointFailed when ``root`` is not a directory or cannot
    be read, or holds something the manifest cannot carry.
    """
    top = os.fspath(root)
    try:
        if not stat.S_ISDIR(os.lstat(top).st_mode):
            raise CheckpointFailed(f"cannot capture {top}: not a directory")
    except FileNotFoundError:
        raise CheckpointFailed(f"cannot capture {top}: no such directory") from None
    entries: list[Entry] = []
    inodes: dict[str, tuple[int, int]] = {}  # files with several links -> (st_dev, st_ino)
    pending = [""]
    try:
        while pending:
            rel_dir = pending.pop()
            with os.scandir(os.path.join(top, rel_dir) if rel_dir else top) as it:
                for dirent in it:
                    rel = f"{rel_dir}/{dirent.name}" if rel_dir else dirent.name
                    st = dirent.stat(follow_symlinks=False)
                    entry = _entry_for(top, rel, st)
                    if entry is None:
                        continue
                    entries.append(entry)
                    if entry.kind == KIND_FILE and st.st_nlink > 1:
                        inodes[rel] = (st.st_dev, st.st_ino)
                    if entry.kind == KIND_DIR:
                        pending.append(rel)
    except OSError as exc:
        raise CheckpointFailed(f"cannot capture {top}: {exc.strerror or exc}") from None
    entries.sort(key=lambda e: e.path.encode("utf-8", "surrogateescape"))
    return _with_links(entries, inodes)


def _with_links(entries: list[Entry], inodes: Mapping[str, tuple[int, int]]) -> list[Entry]:
    """Sets ``link`` on every name of an inode but its first (in ``entries`` order)."""
    first: dict[tuple[int, int], str] = {}
    for index, entry in enumerate(entries):
        key = inodes.get(entry.path)
        if key is None:
            continue
        if key in first:
            entries[index] = dataclasses.replace(entry, link=first[key])
        else:
            first[key] = entry.path
    return entries
