"""Apply a captured tree (an overlay upperdir or a volume) onto a container's filesystem.

The target is untrusted: it belongs to a container and may hold symlinks that point
anywhere. So the work runs in a child process that chroots into the target first;
every path then resolves inside it. Within it, no entry is written through a symlink
either: each entry's parent directories must be real directories (``_RealDirs``), as
they are when the tree lists every parent before its children (``check_entries``), so
a symlink planted by the tree (or already in the target) is never followed by a later
entry. Run as ``python -m hermit_node.fsapply`` with a JSON request on stdin;
``apply_tree`` does that for callers.

A hardlink entry (``link``) becomes a second name of the inode its first name was
just given (``os.link`` inside the chroot); its metadata is that inode's. Extended
attributes are set after owner and mode: a chown clears ``security.capability``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hermit_common.errors import RestoreFailed
from hermit_common.tree import (
    KIND_DIR,
    KIND_FIFO,
    KIND_FILE,
    KIND_SYMLINK,
    KIND_WHITEOUT,
    Entry,
    check_links,
    is_captured_xattr,
)


def outside_mounts(entries: Sequence[Entry], mount_points: Sequence[str]) -> list[Entry]:
    """The entries that are neither a mount point of the new container nor under one.

    Replacing a path that is a mount point in the container's mount namespace (runc's
    /etc/resolv.conf, /etc/hosts, /etc/hostname, volumes) would detach that mount there;
    what is under a mount belongs to the mounted volume, not to the writable layer.

    A hardlink whose first name is left out loses its ``link``: the first kept name
    of that inode is then a plain file (its content is in staging under its own path),
    and the later kept names link to it."""
    points = [m.strip("/") for m in mount_points if m.strip("/")]
    kept: list[Entry] = []
    dropped: set[str] = set()
    heads: dict[str, str] = {}  # a dropped first name -> the first kept name of its inode
    for entry in entries:
        if any(entry.path == m or entry.path.startswith(m + "/") for m in points):
            dropped.add(entry.path)
            continue
        if entry.link is not None and entry.link in dropped:
            head = heads.setdefault(entry.link, entry.path)
            entry = dataclasses.replace(entry, link=None if head == entry.path else head)
        kept.append(entry)
    return kept


def apply_tree(entries: Sequence[Entry], staging: Path, target: Path, *,
               replace: bool = False, skip: Sequence[str] = (),
               timeout: float = 600.0) -> None:
    """Make ``target`` carry ``entries`` (contents read from ``staging``).

    Overlay semantics: a whiteout deletes the path; an opaque dir loses what it had.
    ``replace=True`` empties ``target`` first (a volume restored as it was). ``skip``:
    mount points of the container, left alone with everything under them.
    """
    request = {
        "staging": str(staging),
        "target": str(target),
        "replace": replace,
        "entries": [e.to_dict() for e in outside_mounts(entries, skip)],
    }
    proc = subprocess.run(
        [sys.executable, "-m", "hermit_node.fsapply"],
        input=json.dumps(request), capture_output=True, text=True, timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise RestoreFailed(f"cannot apply the filesystem capture to {target}: {detail[0]}")


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _clear_dir(path: str) -> None:
    for name in os.listdir(path):
        _remove(os.path.join(path, name))


def _set_owner_mode(path: str, entry: Entry, *, symlink: bool = False) -> None:
    os.chown(path, entry.uid, entry.gid, follow_symlinks=not symlink)
    if not symlink:
        os.chmod(path, entry.mode)


def _not_supported(exc: OSError) -> bool:
    return exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)


def _set_xattrs(path: str, entry: Entry, *, symlink: bool = False) -> None:
    """Makes the captured extended attributes of ``path`` exactly the entry's.

    A filesystem without extended attributes (ENOTSUP) is left without them, as
    before they were captured; any other failure fails the apply."""
    follow = not symlink
    wanted = dict(entry.xattrs)
    try:
        present = os.listxattr(path, follow_symlinks=follow)
    except OSError as exc:
        if not _not_supported(exc):
            raise
        present = []
    for name in present:
        if is_captured_xattr(name) and name not in wanted:
            os.removexattr(path, name, follow_symlinks=follow)
    for name, value in entry.xattrs:
        try:
            os.setxattr(path, name, value, follow_symlinks=follow)
        except OSError as exc:
            if not _not_supported(exc):
                raise


def _link(entry: Entry) -> None:
    """A second name for the inode of an earlier entry, not following a symlink."""
    assert entry.link is not None
    source = "/" + entry.link
    if not stat.S_ISREG(os.lstat(source).st_mode):
        raise RestoreFailed(f"{entry.path} is a hardlink of {entry.link}, not a regular file")
    os.link(source, "/" + entry.path, follow_symlinks=False)


def _write_file(entry: Entry, staging_fd: int, path: str) -> None:
    """A new file at ``path`` with the staged content (never through a symlink)."""
    src = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=staging_fd)
    try:
        dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            remaining = entry.size
            while remaining > 0:
                # sendfile works across filesystems (copy_file_range may not).
                copied = os.sendfile(dst, src, None, min(remaining, 1 << 30))
                if copied == 0:
                    raise RestoreFailed(f"{entry.path} is shorter than its manifest says")
                remaining -= copied
        finally:
            os.close(dst)
    finally:
        os.close(src)


class _RealDirs:
    """Directories of the (chrooted) target seen to be real, not symlinks, in this apply.

    ``check_parents`` refuses a path with a parent that is a symlink or not a directory,
    so nothing is ever written through a symlink; it looks each directory up once,
    until an entry replaces it (``forget``)."""

    def __init__(self) -> None:
        self._known: set[str] = set()

    def check_parents(self, rel: str) -> None:
        prefix = ""
        for part in rel.split("/")[:-1]:
            prefix = f"{prefix}/{part}" if prefix else part
            if prefix in self._known:
                continue
            mode = os.lstat("/" + prefix).st_mode
            if not stat.S_ISDIR(mode):
                what = "a symlink" if stat.S_ISLNK(mode) else "not a directory"
                raise RestoreFailed(
                    f"{rel}: its parent {prefix} is {what} in the target; nothing is "
                    "written through it")
            self._known.add(prefix)

    def add(self, rel: str) -> None:
        self._known.add(rel)

    def forget(self, rel: str, *, below_only: bool = False) -> None:
        """``rel`` (unless ``below_only``) and everything under it may have changed."""
        if rel in self._known:
            self._known = {d for d in self._known if not d.startswith(rel + "/")}
            if not below_only:
                self._known.discard(rel)


def _apply_dir(entry: Entry, path: str, dirs: _RealDirs) -> None:
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            _remove(path)
            os.mkdir(path)
        elif entry.opaque:
            _clear_dir(path)
            dirs.forget(entry.path, below_only=True)
    except FileNotFoundError:
        os.mkdir(path)
    dirs.add(entry.path)
    _set_owner_mode(path, entry)
    _set_xattrs(path, entry)


def _apply_one(entry: Entry, staging_fd: int, dirs: _RealDirs) -> None:
    path = "/" + entry.path
    dirs.check_parents(entry.path)
    if entry.kind == KIND_DIR:
        _apply_dir(entry, path, dirs)
        return
    _remove(path)
    dirs.forget(entry.path)
    if entry.kind == KIND_WHITEOUT:
        return
    if entry.kind == KIND_FILE and entry.link is not None:
        dirs.check_parents(entry.link)
        _link(entry)  # the inode already has its metadata: a chown would clear capabilities
        return
    if entry.kind == KIND_SYMLINK:
        assert entry.target is not None
        os.symlink(entry.target, path)
        _set_owner_mode(path, entry, symlink=True)
        _set_xattrs(path, entry, symlink=True)
        os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
        return
    if entry.kind == KIND_FIFO:
        os.mkfifo(path)
    elif entry.kind == KIND_FILE:
        _write_file(entry, staging_fd, path)
    _set_owner_mode(path, entry)
    _set_xattrs(path, entry)
    os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns))


def _main(request: dict[str, Any]) -> None:
    entries = [Entry.from_dict(e) for e in request["entries"]]
    check_links(entries, "tree")
    staging_fd = os.open(request["staging"], os.O_RDONLY | os.O_DIRECTORY)
    os.chroot(request["target"])
    os.chdir("/")
    if request.get("replace"):
        _clear_dir("/")
    dirs = _RealDirs()
    for entry in entries:
        _apply_one(entry, staging_fd, dirs)
    # Directory mtimes last, deepest first: writing children changed them.
    for entry in sorted((e for e in entries if e.kind == KIND_DIR),
                        key=lambda e: e.path.count("/"), reverse=True):
        os.utime("/" + entry.path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)


if __name__ == "__main__":
    try:
        _main(json.load(sys.stdin))
    except Exception as exc:  # one line for the parent's error message
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
