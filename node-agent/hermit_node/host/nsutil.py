"""Thin wrappers over the Linux namespace and mount syscalls that Python 3.11 lacks."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWPID = 0x20000000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def setns(fd: int, nstype: int) -> None:
    """Join the namespace behind ``fd`` (for a pid namespace: for children only)."""
    _check(_libc.setns(fd, nstype), "setns")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def mount(source: str, target: str, fstype: str | None, flags: int = 0,
          data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(), target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def enter_private_mount_namespace() -> None:
    """Unshare the mount namespace and stop mount events leaking back to the host."""
    unshare(CLONE_NEWNS)
    mount("none", "/", None, MS_REC | MS_PRIVATE)


def enter_slave_mount_namespace() -> None:
    """Unshare the mount namespace as a slave: nothing leaks back to the host, but mounts
    keep their masters, which CRIU copies onto restored mounts that had external masters."""
    unshare(CLONE_NEWNS)
    mount("none", "/", None, MS_REC | MS_SLAVE)


def bind_self(path: str) -> None:
    """Make ``path`` the root of a mount (a bind onto itself), keeping its propagation."""
    mount(path, path, None, MS_BIND)


def ns_inode(pid: int, ns: str) -> int:
    """The inode number that identifies namespace ``ns`` of process ``pid``."""
    return os.stat(f"/proc/{pid}/ns/{ns}").st_ino
