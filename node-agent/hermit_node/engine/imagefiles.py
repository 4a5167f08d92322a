"""What the new container's image holds at a path, for the manifest policy (admit.py).

Read in the container's root filesystem as the host sees it (its overlay mount)
before the restore writes to it: the image, plus only the mount points runc made.
The container's symlinks are untrusted (they may point at host paths), so none is
followed: a path whose parent is not a real directory has no image file.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from hermit_node.engine.admit import CAPABILITY_XATTR, ImageFile, ImageLookup


def image_lookup(rootfs: Path) -> ImageLookup:
    """``lookup(rel)``: the regular file at ``rel`` under ``rootfs``, or None."""
    root = os.fspath(rootfs)

    def lookup(rel: str) -> ImageFile | None:
        try:
            fd = _open_beneath(root, rel)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            return ImageFile(st.st_mode, st.st_uid, st.st_gid, _capability(fd))
        finally:
            os.close(fd)

    return lookup


def _open_beneath(root: str, rel: str) -> int:
    """An fd of ``root/rel`` opened without following a symlink anywhere below ``root``."""
    *parents, name = rel.split("/")
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parents:
            child = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                            dir_fd=fd)
            os.close(fd)
            fd = child
        # O_PATH: opening a device node or a FIFO of the image has no side effect.
        return os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    finally:
        os.close(fd)


def _capability(fd: int) -> bytes | None:
    """security.capability of a regular file opened with O_PATH (through its /proc link)."""
    try:
        return os.getxattr(f"/proc/self/fd/{fd}", CAPABILITY_XATTR)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise
