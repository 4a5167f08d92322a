"""Apply a captured tree (an overlay upperdir or a volume) onto a container's filesystem.

The target is untrusted: it belongs to a container and may hold symlinks that point
anywhere, planted by the tree itself or by a process of the new container at any moment
of the apply. So no path is ever resolved in it: the target's root is opened once
(O_NOFOLLOW), every directory is opened by one name from its parent's fd with
O_NOFOLLOW|O_DIRECTORY (``_Dirs``), and every write is a ``*at`` call on such an fd
(mkdirat, openat(O_CREAT|O_EXCL|O_NOFOLLOW), symlinkat, linkat, unlinkat) or on the fd
of what was just created (fchown, fchmod, fsetxattr, futimens). A symlink where a
directory is expected is refused ("its parent ... is a symlink"), not followed; the
tree lists every parent before its children (``check_entries``), so a symlink the tree
planted is never a later entry's parent. As a second wall the work runs in a child
process chrooted into the target: even a path that were resolved would stay inside.
Run as ``python -m hermit_node.engine.fsapply`` with a JSON request on stdin; ``apply_tree``
does that for callers.

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
        [sys.executable, "-m", "hermit_node.engine.fsapply"],
        input=json.dumps(request), capture_output=True, text=True, timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        detail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise RestoreFailed(f"cannot apply the filesystem capture to {target}: {detail[0]}")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _Dirs:
    """Open fds of a tree's directories, each opened by ONE name from its parent's fd
    with O_NOFOLLOW|O_DIRECTORY, from the tree's root fd down.

    Every write of the apply is a ``*at`` call on such an fd and a single name, so
    nothing resolves a path: a symlink the tree planted, or one a process of the new
    container puts in place of a directory at any moment, is refused by the kernel
    (``dir`` raises "its parent ... is a symlink"), never followed; a directory renamed
    after it was opened is still the inode written into (inside the target). Only the
    directories on the current entry's path stay open (``keep_only``), so a wide or
    deep tree does not exhaust the fds."""

    def __init__(self, root: int) -> None:
        self._root = root
        self._open: dict[str, int] = {}

    def parent(self, rel: str) -> tuple[int, str]:
        """(fd of the directory holding ``rel``, its last name)."""
        up, _, name = rel.rpartition("/")
        return self.dir(up, rel), name

    def dir(self, rel: str, entry: str | None = None) -> int:
        if rel == "":
            return self._root
        fd = self._open.get(rel)
        if fd is not None:
            return fd
        up, _, name = rel.rpartition("/")
        parent = self.dir(up, entry)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
            what = "a symlink" if stat.S_ISLNK(mode) else "not a directory"
            if entry is None:  # a directory the apply made, changed since
                raise RestoreFailed(
                    f"directory {rel} became {what} in the target during the apply; "
                    "nothing is written through it") from None
            raise RestoreFailed(
                f"{entry}: its parent {rel} is {what} in the target; nothing is "
                "written through it") from None
        self._open[rel] = fd
        return fd

    def keep_only(self, rel: str) -> None:
        """Closes every open directory that is not a parent of ``rel``."""
        for d in [d for d in self._open if not rel.startswith(d + "/")]:
            os.close(self._open.pop(d))

    def forget(self, rel: str) -> None:
        """``rel`` and everything under it were removed or replaced."""
        for d in [d for d in self._open if d == rel or d.startswith(rel + "/")]:
            os.close(self._open.pop(d))

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()


def _remove_at(parent: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent)  # fd-based: follows no symlink inside
    else:
        os.unlink(name, dir_fd=parent)


def _clear_dir(fd: int) -> None:
    for name in os.listdir(fd):
        _remove_at(fd, name)


def _not_supported(exc: OSError) -> bool:
    return exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)


def _set_xattrs(node: int | str, entry: Entry) -> None:
    """Makes the captured extended attributes of ``node`` exactly the entry's: an open
    fd, or (a symlink, which has none) a path under /proc/self/fd/<dir fd> whose last
    component is not followed (``_NoFd``).

    A filesystem without extended attributes (ENOTSUP) is left without them, as
    before they were captured; any other failure fails the apply."""
    follow = isinstance(node, int)
    wanted = dict(entry.xattrs)
    try:
        present = os.listxattr(node, follow_symlinks=follow)
    except OSError as exc:
        if not _not_supported(exc):
            raise
        present = []
    for name in present:
        if is_captured_xattr(name) and name not in wanted:
            os.removexattr(node, name, follow_symlinks=follow)
    for name, value in entry.xattrs:
        try:
            os.setxattr(node, name, value, follow_symlinks=follow)
        except OSError as exc:
            if not _not_supported(exc):
                raise


def _set_meta(fd: int, entry: Entry, *, times: bool = True) -> None:
    """Owner, then mode (a chown clears setuid bits), then xattrs (a chown clears
    ``security.capability``), then times, all on the open fd."""
    os.fchown(fd, entry.uid, entry.gid)
    os.fchmod(fd, entry.mode)
    _set_xattrs(fd, entry)
    if times:
        os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))


class _NoFd:
    """The extended attributes of a symlink, which cannot be opened: set through
    ``<dir fd>/<name>`` relative to /proc/self/fd (opened before the chroot, the only
    way there after it): the directory is the fd's inode, the name is not followed."""

    def __init__(self, proc_fd: int) -> None:
        self._proc = proc_fd

    def set_xattrs(self, parent: int, name: str, entry: Entry) -> None:
        if not entry.xattrs:
            return  # a new symlink has none to remove
        os.fchdir(self._proc)
        try:
            _set_xattrs(f"{parent}/{name}", entry)
        finally:
            os.chdir("/")


def _link(entry: Entry, parent: int, name: str, dirs: _Dirs) -> None:
    """A second name for the inode of an earlier entry, not following a symlink."""
    assert entry.link is not None
    sparent, sname = dirs.parent(entry.link)
    if not stat.S_ISREG(os.stat(sname, dir_fd=sparent, follow_symlinks=False).st_mode):
        raise RestoreFailed(f"{entry.path} is a hardlink of {entry.link}, not a regular file")
    os.link(sname, name, src_dir_fd=sparent, dst_dir_fd=parent, follow_symlinks=False)


def _write_file(entry: Entry, staged: tuple[int, str], parent: int, name: str) -> None:
    """A new file ``name`` in ``parent`` with the staged content (never through a
    symlink), its metadata set on the fd."""
    src = os.open(staged[1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=staged[0])
    try:
        dst = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600, dir_fd=parent)
        try:
            remaining = entry.size
            while remaining > 0:
                # sendfile works across filesystems (copy_file_range may not).
                copied = os.sendfile(dst, src, None, min(remaining, 1 << 30))
                if copied == 0:
                    raise RestoreFailed(f"{entry.path} is shorter than its manifest says")
                remaining -= copied
            _set_meta(dst, entry)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _make_fifo(entry: Entry, parent: int, name: str) -> None:
    os.mkfifo(name, 0o600, dir_fd=parent)
    # O_NONBLOCK: opening a FIFO for reading does not wait for a writer.
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                 dir_fd=parent)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise RestoreFailed(f"{entry.path}: replaced in the target while it was made")
        _set_meta(fd, entry)
    finally:
        os.close(fd)


def _apply_dir(entry: Entry, parent: int, name: str, dirs: _Dirs) -> None:
    try:
        st: os.stat_result | None = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        _remove_at(parent, name)
        st = None
    if st is None:
        os.mkdir(name, 0o700, dir_fd=parent)
    fd = dirs.dir(entry.path)  # a symlink swapped in since is refused here
    if st is not None and entry.opaque:
        _clear_dir(fd)
    _set_meta(fd, entry, times=False)  # times last (_main): children change them


def _apply_one(entry: Entry, staging: _Dirs, dirs: _Dirs, nofd: _NoFd) -> None:
    dirs.keep_only(entry.path)
    staging.keep_only(entry.path)
    parent, name = dirs.parent(entry.path)
    if entry.kind == KIND_DIR:
        _apply_dir(entry, parent, name, dirs)
        return
    _remove_at(parent, name)
    dirs.forget(entry.path)
    if entry.kind == KIND_WHITEOUT:
        return
    if entry.kind == KIND_FILE and entry.link is not None:
        _link(entry, parent, name, dirs)  # the inode has its metadata: a chown would
        return                            # clear its capabilities
    if entry.kind == KIND_SYMLINK:
        assert entry.target is not None
        os.symlink(entry.target, name, dir_fd=parent)
        os.chown(name, entry.uid, entry.gid, dir_fd=parent, follow_symlinks=False)
        nofd.set_xattrs(parent, name, entry)
        os.utime(name, ns=(entry.mtime_ns, entry.mtime_ns), dir_fd=parent,
                 follow_symlinks=False)
    elif entry.kind == KIND_FIFO:
        _make_fifo(entry, parent, name)
    elif entry.kind == KIND_FILE:
        _write_file(entry, staging.parent(entry.path), parent, name)


def _main(request: dict[str, Any]) -> None:
    entries = [Entry.from_dict(e) for e in request["entries"]]
    check_links(entries, "tree")
    staging_fd = os.open(request["staging"], _DIR_FLAGS)
    # The target's root is a host path (the bundle's rootfs, the kubelet's volume dir);
    # from here on, only fds and single names.
    root = os.open(request["target"], _DIR_FLAGS)
    proc_fd = os.open("/proc/self/fd", _DIR_FLAGS & ~os.O_NOFOLLOW)
    # Defence in depth: even a path that were resolved stays inside the target.
    os.chroot(f"/proc/self/fd/{root}")
    os.chdir("/")
    if request.get("replace"):
        _clear_dir(root)
    dirs, staging, nofd = _Dirs(root), _Dirs(staging_fd), _NoFd(proc_fd)
    for entry in entries:
        _apply_one(entry, staging, dirs, nofd)
    # Directory mtimes last, deepest first: writing children changed them.
    for entry in sorted((e for e in entries if e.kind == KIND_DIR),
                        key=lambda e: e.path.count("/"), reverse=True):
        dirs.keep_only(entry.path)
        os.utime(dirs.dir(entry.path), ns=(entry.mtime_ns, entry.mtime_ns))
    dirs.close()
    staging.close()


if __name__ == "__main__":
    try:
        _main(json.load(sys.stdin))
    except Exception as exc:  # one line for the parent's error message
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
