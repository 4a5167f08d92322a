"""Copy a tenant's directory tree (overlay upperdir, workspace) without following its paths.

The source belongs to a sandbox. A process of the sandbox that is not frozen (a sidecar,
a process sharing the pod's namespaces) can rename and replace any of its entries while
the copy runs; a copier that resolves ``source/a/b`` by path (as ``cp -a`` does) follows a
directory swapped for a symlink the moment it was listed, and copies whatever the symlink
names: the agent's sealing key, its service-account token, any host file.

So ``copy_tree`` resolves no path of the source, ever:

- the source root is opened once (``O_DIRECTORY|O_NOFOLLOW``); every later entry is
  opened by its single name relative to the fd of the directory that lists it, with
  ``O_NOFOLLOW`` (a symlink put there is refused by the kernel, not followed);
- what was opened is ``fstat``-ed and must be the inode the listing's ``lstat`` saw (same
  device, inode and type); anything else means the tree changed under the copy, and the
  copy fails (CheckpointFailed: the checkpoint fails, the sandbox runs on);
- file contents are read from that fd (reflink, else ``copy_file_range``, else
  ``sendfile``, holes kept); metadata is read from it (``fstat``, ``flistxattr``);
- a directory that is another mount (its fd's mount id is not the root's) is not
  entered: it is kept as an empty directory;
- a symlink is recreated as a symlink (``readlinkat``), never followed; the extended
  attributes of a symlink, a FIFO or a whiteout (which have no fd to read them from)
  are read through ``/proc/self/fd/<parent fd>/<name>`` without following the last
  component: the parent is the directory already opened, not a path.

What the copy holds, as ``cp -a`` did: directories, regular files (sparse stays
sparse), symlinks, FIFOs, the overlay whiteouts (char devices 0:0); sockets are skipped
(``scan_tree`` skips them, CRIU recreates them). Any other device node fails the copy,
as ``tree.scan_tree`` failed it after ``cp -a`` had made it in the staging directory.
Owner, mode (setuid/setgid included: the restore side, admit.py, strips what the new pod
does not allow), access and modification times, and hardlinks (every type but
directories) are kept. Extended attributes: those ``scan_tree``
captures (``tree.is_captured_xattr``) and the overlay markers it reads (opaque, whiteout);
the rest (other ``trusted.overlay.*``, LSM labels) is node state, not the tree's.

The destination is the agent's own staging directory: nothing else writes there, so it is
written through fds too but needs no verification.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import resource
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from hermit_common.errors import CheckpointFailed
from hermit_common.tree import is_captured_xattr

log = logging.getLogger(__name__)

# The overlay markers tree.scan_tree reads besides the captured extended attributes.
_OVERLAY_MARKERS: Final = frozenset({
    "trusted.overlay.opaque", "user.overlay.opaque",
    "trusted.overlay.whiteout", "user.overlay.whiteout",
})
_FICLONE: Final = 0x40049409  # ioctl(dest, FICLONE, src): share the extents (reflink)
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in between the listing and the open must not block the open
# (the fstat check then refuses it); O_NOCTTY: nor may a terminal become ours.
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_CHUNK: Final = 1 << 30


def copied_xattr(name: str) -> bool:
    """Whether the copy keeps extended attribute ``name`` (what scan_tree reads)."""
    return name in _OVERLAY_MARKERS or is_captured_xattr(name)


@dataclass
class CopyStats:
    """What one ``copy_tree`` did (for the log and the tests)."""

    dirs: int = 0
    files: int = 0
    bytes: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    specials: int = 0  # FIFOs and whiteouts
    sockets_skipped: int = 0
    mounts_skipped: list[str] = field(default_factory=list)  # relative paths
    xattrs_unsupported: list[str] = field(default_factory=list)  # "path: name"


class _Changed(Exception):
    """An entry is not what the listing said: the tree changed during the copy."""


class _Copier:
    def __init__(self, source: str, src_root: int, dst_root: int) -> None:
        self.source = source
        self.dst_root = dst_root
        self.root_mount = _mount_id(src_root)
        self.stats = CopyStats()
        self.links: dict[tuple[int, int], str] = {}  # (dev, ino) -> first name, dest-relative
        self.entered: set[tuple[int, int]] = set()  # directories walked, (dev, ino)
        self.reflink = True  # until the first FICLONE says the filesystems cannot
        self.copy_range = True  # until copy_file_range says it cannot (EXDEV, ENOSYS)
        self._src_root = src_root
        self.at = ""  # the entry being copied, relative to the source (for errors)

    # --- the walk -------------------------------------------------------------------

    def run(self) -> None:
        root_st = os.fstat(self._src_root)
        self._copy_dir(self._src_root, self.dst_root, "", root_st)

    def _copy_dir(self, src: int, dst: int, rel: str, st: os.stat_result) -> None:
        """Copies the entries of the open directory ``src`` into ``dst``, then the
        directory's own metadata (its times after its children changed them).

        Depth-first with an explicit stack: two fds per level of the current path, all
        closed (but the caller's) whatever happens."""
        stack: list[tuple[int, int, str, os.stat_result, Iterator[str]]] = []
        names = iter(self._list(src))
        try:
            while True:
                name = next(names, None)
                if name is None:
                    self._finish_dir(src, dst, rel, st)
                    if not stack:
                        return
                    os.close(src)
                    os.close(dst)
                    src, dst, rel, st, names = stack.pop()
                    continue
                child_rel = f"{rel}/{name}" if rel else name
                opened = self._copy_entry(src, dst, name, child_rel)
                if opened is not None:
                    stack.append((src, dst, rel, st, names))
                    src, dst, st = opened
                    rel = child_rel
                    names = iter(self._list(src))
        finally:
            if stack:  # an error below the root: close every level opened
                for fds in ((src, dst), *((s[0], s[1]) for s in stack[1:])):
                    for fd in fds:
                        os.close(fd)

    @staticmethod
    def _list(src: int) -> list[str]:
        # The whole listing first: one fd fewer per level (os.scandir(fd) holds a dup).
        with os.scandir(src) as it:
            return sorted(e.name for e in it)

    def _copy_entry(self, src: int, dst: int, name: str, rel: str,
                    ) -> tuple[int, int, os.stat_result] | None:
        """Copies one entry; returns (src fd, dest fd, stat) of a directory to enter."""
        self.at = rel
        st = os.stat(name, dir_fd=src, follow_symlinks=False)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            return self._enter_dir(src, dst, name, rel, st)
        if stat.S_ISSOCK(mode):
            self.stats.sockets_skipped += 1
            return None
        if st.st_nlink > 1 and self._link(dst, name, rel, st):
            return None
        if stat.S_ISREG(mode):
            self._copy_file(src, dst, name, rel, st)
        elif stat.S_ISLNK(mode):
            self._copy_symlink(src, dst, name, st)
        elif stat.S_ISFIFO(mode) or (stat.S_ISCHR(mode) and st.st_rdev == 0):
            self._copy_special(src, dst, name, st)
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            # cp -a made it and tree.scan_tree then refused it; refused before it exists:
            # the agent never makes a node of a real device the tenant chose.
            raise CheckpointFailed(
                f"cannot capture {self.source}/{rel}: device node "
                f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)} is not supported")
        else:
            raise CheckpointFailed(f"cannot copy {self.source}/{rel}: unknown file type "
                                   f"{stat.S_IFMT(mode):o}")  # (no such type in Linux)
        if st.st_nlink > 1:
            self.links[(st.st_dev, st.st_ino)] = rel
        return None

    def _enter_dir(self, src: int, dst: int, name: str, rel: str, st: os.stat_result,
                   ) -> tuple[int, int, os.stat_result] | None:
        os.mkdir(name, 0o700, dir_fd=dst)
        self.stats.dirs += 1
        if (st.st_dev, st.st_ino) in self.entered:
            # Moved during the copy to where the walk meets it again: never twice.
            raise _Changed("a directory was moved where the walk met it again")
        self.entered.add((st.st_dev, st.st_ino))
        child = os.open(name, _DIR_FLAGS, dir_fd=src)
        try:
            _same(child, st)
            if _mount_id(child) != self.root_mount:
                # A mount under the tree (a volume, a bind a privileged process propagated
                # to the host, even of the same filesystem: same st_dev) is not part of
                # it: whoever mounted it chose what it shows (the host's /etc, another
                # pod's volume), and the restore does not recreate mounts either. The
                # directory is kept, empty, as the mount point it was. (The mount id, not
                # st_dev: a bind of the same filesystem keeps st_dev, and a btrfs
                # subvolume changes it without being a mount.)
                self.stats.mounts_skipped.append(rel)
                log.warning("copy of %s: %s is a mount point; its contents are not part "
                            "of the tree and are not copied", self.source, rel)
                self._copy_inode_meta_at(src, dst, name, st)
                os.close(child)
                return None
            dchild = os.open(name, _DIR_FLAGS, dir_fd=dst)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(child)
            raise
        return child, dchild, st

    def _finish_dir(self, src: int, dst: int, rel: str, st: os.stat_result) -> None:
        self.at = rel
        self._copy_xattrs(src, dst, rel)
        _own_mode_times_fd(dst, st)

    # --- the entries ----------------------------------------------------------------

    def _link(self, dst: int, name: str, rel: str, st: os.stat_result) -> bool:
        """A later name of an inode already copied: the same hardlink in the copy."""
        first = self.links.get((st.st_dev, st.st_ino))
        if first is None:
            return False
        os.link(first, name, src_dir_fd=self.dst_root, dst_dir_fd=dst, follow_symlinks=False)
        self.stats.hardlinks += 1
        return True

    def _copy_file(self, src: int, dst: int, name: str, rel: str, st: os.stat_result) -> None:
        fd = os.open(name, _FILE_FLAGS, dir_fd=src)
        try:
            _same(fd, st)
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o600, dir_fd=dst)
            try:
                self.stats.bytes += self._copy_data(fd, out, st.st_size, st.st_blocks)
                _own_mode_fd(out, st)  # before the xattrs: a chown clears security.capability
                self._copy_xattrs(fd, out, rel)
                os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(out)
        finally:
            os.close(fd)
        self.stats.files += 1

    def _copy_data(self, src: int, dst: int, size: int, st_blocks: int) -> int:
        """Copies ``size`` bytes (fewer if the file shrank meanwhile), holes as holes."""
        if size == 0:
            return 0
        if self.reflink:
            try:
                fcntl.ioctl(dst, _FICLONE, src)
                return size
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL,
                                     errno.ENOTTY, errno.ENOSYS, errno.EPERM):
                    raise
                self.reflink = False
        if st_blocks * 512 >= size:  # no hole to keep: one range, no SEEK_DATA
            return self._copy_range(src, dst, 0, size)
        copied = end = 0
        for start, end in _data_extents(src, size):
            copied += self._copy_range(src, dst, start, end)
        if end < size:
            os.ftruncate(dst, size)  # a trailing hole
        return copied

    def _copy_range(self, src: int, dst: int, start: int, end: int) -> int:
        offset = start
        while offset < end:
            count = min(end - offset, _CHUNK)
            n = 0
            if self.copy_range:
                try:
                    n = os.copy_file_range(src, dst, count, offset, offset)
                except OSError as exc:
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP,
                                         errno.EINVAL):
                        raise
                    self.copy_range = False
                    continue
            else:
                os.lseek(dst, offset, os.SEEK_SET)
                n = os.sendfile(dst, src, offset, count)
            if n == 0:  # shorter than when listed: the copy is the file as it is now
                break
            offset += n
        return offset - start

    def _copy_symlink(self, src: int, dst: int, name: str, st: os.stat_result) -> None:
        try:
            target = os.readlink(name, dir_fd=src)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # not a symlink any more
                raise _Changed(f"listed as a symlink, now {exc.strerror}") from None
            raise
        os.symlink(target, name, dir_fd=dst)
        self._copy_inode_meta_at(src, dst, name, st)
        self.stats.symlinks += 1

    def _copy_special(self, src: int, dst: int, name: str, st: os.stat_result) -> None:
        """A FIFO or an overlay whiteout (char 0:0): made, not opened."""
        os.mknod(name, stat.S_IFMT(st.st_mode) | 0o600, st.st_rdev, dir_fd=dst)
        self._copy_inode_meta_at(src, dst, name, st)
        self.stats.specials += 1

    def _copy_inode_meta_at(self, src: int, dst: int, name: str, st: os.stat_result) -> None:
        """Owner, mode, xattrs, times of an entry that has no fd of its own to read."""
        is_link = stat.S_ISLNK(st.st_mode)
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
        if not is_link:  # our own new node in our own directory: nothing to follow
            os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=dst)
        self._copy_xattrs_at(src, dst, name, st)
        os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=dst, follow_symlinks=False)

    # --- extended attributes --------------------------------------------------------

    def _copy_xattrs(self, src: int | str, dst: int | str, rel: str) -> None:
        """From the open ``src`` (an fd, or a /proc/self/fd/N/name path that is not
        followed at its end) to ``dst``, the names ``copied_xattr`` keeps."""
        follow = not isinstance(src, str)
        try:
            names = os.listxattr(src, follow_symlinks=follow)
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                return
            raise
        for name in sorted(n for n in names if copied_xattr(n)):
            try:
                value = os.getxattr(src, name, follow_symlinks=follow)
            except OSError as exc:
                if exc.errno == errno.ENODATA:  # removed since listed
                    continue
                raise
            try:
                os.setxattr(dst, name, value, follow_symlinks=follow)
            except OSError as exc:
                if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                # Not silent: the staging filesystem cannot hold it; logged and counted.
                self.stats.xattrs_unsupported.append(f"{rel or '.'}: {name}")
                log.warning("copy of %s: the staging filesystem cannot hold extended "
                            "attribute %s of %s; it is not captured",
                            self.source, name, rel or ".")

    def _copy_xattrs_at(self, src: int, dst: int, name: str, st: os.stat_result) -> None:
        # The directory is the one already open (its fd), never a path of the tenant's;
        # only the last component is looked up, and not followed.
        self._copy_xattrs(f"/proc/self/fd/{src}/{name}", f"/proc/self/fd/{dst}/{name}", name)


@contextlib.contextmanager
def _fd(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def _mount_id(fd: int) -> int:
    """The id of the mount ``fd`` was opened on (``mnt_id`` of /proc/self/fdinfo)."""
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOTSUP, f"/proc/self/fdinfo/{fd} has no mnt_id")


def _same(fd: int, listed: os.stat_result) -> None:
    """The opened ``fd`` is the inode the listing saw (an entry swapped in between is
    not); raises _Changed."""
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (listed.st_dev, listed.st_ino) \
            or stat.S_IFMT(st.st_mode) != stat.S_IFMT(listed.st_mode):
        raise _Changed("it was replaced between its listing and its open")


def _own_mode_fd(fd: int, st: os.stat_result) -> None:
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, stat.S_IMODE(st.st_mode))  # after the chown, which clears setuid bits


def _own_mode_times_fd(fd: int, st: os.stat_result) -> None:
    _own_mode_fd(fd, st)
    os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _data_extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of the data of a file of ``size`` bytes, holes left out."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole to the end
                return
            if exc.errno == errno.EINVAL:  # no SEEK_DATA here: all data
                yield offset, size
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        offset = end


def _raise_nofile_limit() -> None:
    """Two fds per directory level of the walk: allow as many as the hard limit does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# What an entry changed by someone else between two steps of the copy looks like.
_RACES: Final = (errno.ELOOP, errno.ENOTDIR, errno.ENOENT)


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "it was replaced (by a symlink or another type) during the copy"
    if exc.errno == errno.ENOENT:
        return "it vanished during the copy"
    if exc.errno == errno.EMFILE:
        return "the tree is deeper than the open-file limit allows (two per level)"
    return exc.strerror or str(exc)


def _failure(copier: _Copier, why: str, *, modified: bool) -> CheckpointFailed:
    where = f"{copier.source}/{copier.at}" if copier.at else copier.source
    tail = "; a process outside the frozen container is modifying the tree" if modified else ""
    return CheckpointFailed(f"cannot copy {where}: {why}{tail}")


def copy_tree(source: Path, dest: Path) -> CopyStats:
    """Copies the tree under ``source`` into ``dest`` (created; must not exist or be
    empty), with the metadata ``cp -a`` keeps, never following a path of ``source``.

    ``source`` itself (a host path: the container's upperdir, the kubelet's volume dir)
    is opened with O_NOFOLLOW; nothing under it is ever resolved as a path. Raises
    CheckpointFailed if anything cannot be copied or changed during the copy.
    """
    _raise_nofile_limit()
    src_text = os.fspath(source)
    try:
        src_root = os.open(src_text, _DIR_FLAGS)
    except OSError as exc:
        raise CheckpointFailed(f"cannot copy {src_text}: {exc.strerror or exc}") from None
    with _fd(src_root):
        dest.mkdir(parents=True, exist_ok=True)
        with _fd(os.open(os.fspath(dest), _DIR_FLAGS)) as dst_root:
            copier = _Copier(src_text, src_root, dst_root)
            try:
                copier.run()
            except _Changed as exc:
                raise _failure(copier, f"it changed during the copy ({exc})",
                               modified=True) from None
            except OSError as exc:
                raise _failure(copier, _why(exc), modified=exc.errno in _RACES) from None
    return copier.stats


def walk(root: Path, *, strict: bool = True) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under ``root`` as (path relative to it, lstat), parents before their
    children, walked as ``copy_tree`` walks: from directory fds, O_NOFOLLOW, not into
    another mount, one fd per level. A directory replaced (by a symlink) between its
    listing and its open is never entered: ``strict`` raises OSError (ELOOP, ENOTDIR,
    ENOENT), else it is skipped. Raises OSError when ``root`` cannot be opened."""
    top = os.open(os.fspath(root), _DIR_FLAGS)
    try:
        mount = _mount_id(top)
    except BaseException:
        os.close(top)
        raise
    stack: list[tuple[int, str, Iterator[str]]] = [(top, "", iter(_Copier._list(top)))]
    try:
        while stack:
            fd, rel_dir, names = stack[-1]
            name = next(names, None)
            if name is None:
                os.close(stack.pop()[0])
                continue
            rel = f"{rel_dir}/{name}" if rel_dir else name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                child = None
                if stat.S_ISDIR(st.st_mode):
                    child = _open_subdir(fd, name, st, mount, rel)
            except OSError:
                if strict:
                    raise
                continue  # gone or replaced meanwhile
            yield rel, st
            if child is not None:
                stack.append((child, rel, iter(_Copier._list(child))))
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _open_subdir(parent: int, name: str, st: os.stat_result, mount: int,
                 rel: str) -> int | None:
    """The fd of directory ``name`` listed as ``st``; None if it is another mount."""
    child = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        opened = os.fstat(child)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise OSError(errno.ENOENT, "replaced during the walk", rel)
        if _mount_id(child) == mount:
            return child
    except BaseException:
        os.close(child)
        raise
    os.close(child)  # another mount: not the tree's
    return None


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (a hardlinked file once; 0 if absent),
    walked by ``walk``; an entry that changes meanwhile is skipped (an estimate, the
    sandbox runs): a directory swapped for a symlink is never entered, so the walk never
    sizes (nor spends its time on) what the symlink names."""
    seen: set[tuple[int, int]] = set()
    total = 0
    try:
        for _, st in walk(root, strict=False):
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    except OSError:  # the root itself is absent or unreadable
        return total
    return total
