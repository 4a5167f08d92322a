"""safecopy.copy_tree: what cp -a kept is kept, and no path of the source is ever followed.

The swap tests put the race's outcome at the exact moment it matters (after the listing
said "directory" or "file", before the open) by wrapping the copier's step for one name;
tests/integration/test_capture_race.py runs the real race with a separate process.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import struct
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import CheckpointFailed
from hermit_common.tree import scan_tree
from hermit_node.engine import safecopy

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="owners and device nodes need root")

UID, GID = 1234, 5678
CAP_NET_RAW = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)  # security.capability v2
SECRET = b"the-agent-key-0123456789"
T1 = 1_600_000_000_123_456_789
T2 = 1_650_000_000_987_654_321


def _build(root: Path) -> None:
    root.mkdir(exist_ok=True)
    (root / "etc").mkdir()
    (root / "etc" / "hosts").write_bytes(b"127.0.0.1 localhost\n")
    (root / "etc" / "hosts").chmod(0o640)
    os.chown(root / "etc" / "hosts", UID, GID)
    os.setxattr(root / "etc" / "hosts", "user.note", b"kept")
    os.setxattr(root / "etc", "user.dir", b"d")
    (root / "bin").mkdir()
    tool = root / "bin" / "tool"
    tool.write_bytes(b"#!/bin/sh\n")
    os.chown(tool, 0, 0)
    tool.chmod(0o4755)  # setuid, as cp -a kept it (admit.py strips it at restore)
    ping = root / "bin" / "ping"
    ping.write_bytes(b"\x7fELF")
    ping.chmod(0o755)
    os.setxattr(ping, "security.capability", CAP_NET_RAW)
    (root / "empty").write_bytes(b"")
    with open(root / "sparse", "wb") as f:
        f.seek(8 << 20)
        f.write(b"end")
    (root / "big").write_bytes(os.urandom(3 << 20) + b"x")
    os.symlink("/etc/hermit/sealing/..data", root / "bin" / "dangling")
    os.lchown(root / "bin" / "dangling", UID, GID)
    os.symlink("hosts", root / "etc" / "rel")
    os.link(root / "etc" / "hosts", root / "hosts.link")
    os.link(root / "etc" / "hosts", root / "bin" / "hosts.link2")
    os.mkfifo(root / "pipe")
    os.chmod(root / "pipe", 0o620)
    os.mknod(root / "gone", stat.S_IFCHR | 0o600, os.makedev(0, 0))  # overlay whiteout
    os.link(root / "gone", root / "etc" / "gone2")  # overlay shares its whiteout inode
    (root / "opaque").mkdir()
    (root / "opaque" / "f").write_bytes(b"f")
    os.setxattr(root / "opaque", "trusted.overlay.opaque", b"y")
    os.setxattr(root / "opaque", "trusted.overlay.origin", b"node state")  # not copied
    (root / "tmp").mkdir()
    (root / "tmp").chmod(0o1777)
    deep = root / "deep"
    deep.mkdir()
    cur = deep
    for _ in range(40):
        cur = cur / "d"
        cur.mkdir()
    (cur / "leaf").write_bytes(b"leaf")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(root / "sock"))
    # times last: writing children changed the directories'
    for path in (tool, root / "etc" / "hosts", root / "pipe", root / "gone", root / "etc"):
        os.utime(path, ns=(T1, T2), follow_symlinks=False)
    os.utime(root / "bin" / "dangling", ns=(T1, T2), follow_symlinks=False)


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_copy_keeps_what_cp_a_kept(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _build(src)
    before = _fds()
    stats = safecopy.copy_tree(src, tmp_path / "copy")
    assert _fds() == before, "the copy leaked file descriptors"
    subprocess.run(["cp", "-a", f"{src}/.", str(tmp_path / "cp")], check=True)

    assert scan_tree(tmp_path / "copy") == scan_tree(src)
    assert scan_tree(tmp_path / "copy") == scan_tree(tmp_path / "cp")
    copy = tmp_path / "copy"
    st = os.stat(copy / "bin" / "tool")
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o4755, 0)
    st = os.stat(copy / "etc" / "hosts")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, UID, GID)
    assert (st.st_atime_ns, st.st_mtime_ns) == (T1, T2)
    assert st.st_ino == os.stat(copy / "hosts.link").st_ino == \
        os.stat(copy / "bin" / "hosts.link2").st_ino
    assert os.getxattr(copy / "etc" / "hosts", "user.note") == b"kept"
    assert os.getxattr(copy / "etc", "user.dir") == b"d"
    assert os.stat(copy / "etc").st_mtime_ns == T2
    assert os.getxattr(copy / "bin" / "ping", "security.capability") == CAP_NET_RAW
    assert os.getxattr(copy / "opaque", "trusted.overlay.opaque") == b"y"
    assert "trusted.overlay.origin" not in os.listxattr(copy / "opaque")
    wh = os.lstat(copy / "gone")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert wh.st_ino == os.lstat(copy / "etc" / "gone2").st_ino
    assert stat.S_ISFIFO(os.lstat(copy / "pipe").st_mode)
    assert stat.S_IMODE(os.lstat(copy / "pipe").st_mode) == 0o620
    assert os.readlink(copy / "bin" / "dangling") == "/etc/hermit/sealing/..data"
    ln = os.lstat(copy / "bin" / "dangling")
    assert (ln.st_uid, ln.st_gid, ln.st_mtime_ns) == (UID, GID, T2)
    assert stat.S_IMODE(os.stat(copy / "tmp").st_mode) == 0o1777
    assert not (copy / "sock").exists() and not (copy / "sock").is_symlink()
    assert (copy / "big").read_bytes() == (src / "big").read_bytes()
    assert (copy / "sparse").read_bytes() == (src / "sparse").read_bytes()
    assert os.stat(copy / "sparse").st_blocks * 512 < 1 << 20, "the hole was filled"
    assert stats.hardlinks == 3 and stats.sockets_skipped == 1 and stats.specials == 2


def test_copy_without_reflink_or_copy_file_range(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The sendfile path (staging on another filesystem type) copies the same bytes."""
    src = tmp_path / "src"
    _build(src)

    def no_range(*_: Any) -> int:
        raise OSError(18, "Invalid cross-device link")  # EXDEV

    monkeypatch.setattr(safecopy.os, "copy_file_range", no_range)
    monkeypatch.setattr(safecopy._Copier, "__init__", _without_reflink(safecopy._Copier.__init__))
    safecopy.copy_tree(src, tmp_path / "copy")
    assert scan_tree(tmp_path / "copy") == scan_tree(src)
    assert (tmp_path / "copy" / "big").read_bytes() == (src / "big").read_bytes()
    assert (tmp_path / "copy" / "sparse").read_bytes() == (src / "sparse").read_bytes()


def _without_reflink(init: Callable[..., None]) -> Callable[..., None]:
    def wrapped(self: Any, *args: Any) -> None:
        init(self, *args)
        self.reflink = False
    return wrapped


# -- the tree changes under the copy ---------------------------------------------------

@pytest.fixture
def secret_dir(tmp_path: Path) -> Path:
    """Stands for the agent's /etc/hermit/sealing/..data: a file ``1`` with the key."""
    d = tmp_path / "sealing"
    d.mkdir()
    (d / "1").write_bytes(SECRET)
    return d


def _swap_before(monkeypatch: pytest.MonkeyPatch, step: str, victim: str,
                 swap: Callable[[Path], None], src: Path) -> None:
    """Runs ``swap(path)`` when the copier, having listed ``victim``, is about to open it."""
    original = getattr(safecopy._Copier, step)

    def wrapped(self: Any, s: int, d: int, name: str, *rest: Any) -> Any:
        if name == victim:
            swap(Path(f"/proc/self/fd/{s}").resolve() / name)
        return original(self, s, d, name, *rest)

    monkeypatch.setattr(safecopy._Copier, step, wrapped)
    assert (src / victim).exists() or any(src.rglob(victim))


def _leaked(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()
            and SECRET in p.read_bytes()]


def _to_symlink(target: Path) -> Callable[[Path], None]:
    def swap(path: Path) -> None:
        path.rename(path.with_name(path.name + ".moved"))
        os.symlink(target, path)
    return swap


@pytest.mark.parametrize("step,victim", [("_enter_dir", "etc"), ("_enter_dir", "d"),
                                         ("_copy_file", "big")])
def test_entry_swapped_for_a_symlink_is_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, secret_dir: Path, step: str,
        victim: str) -> None:
    src = tmp_path / "src"
    _build(src)
    target = secret_dir if step == "_enter_dir" else secret_dir / "1"
    _swap_before(monkeypatch, step, victim, _to_symlink(target), src)
    before = _fds()
    with pytest.raises(CheckpointFailed, match=r"replaced .* during the copy"):
        safecopy.copy_tree(src, tmp_path / "copy")
    assert _fds() == before
    assert _leaked(tmp_path / "copy") == []


def test_file_swapped_for_another_file_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, secret_dir: Path) -> None:
    """A hardlink (or any other inode) put in place of a listed file: same type, other
    inode; the fstat check refuses it."""
    src = tmp_path / "src"
    _build(src)

    def swap(path: Path) -> None:
        path.unlink()
        os.link(secret_dir / "1", path)

    _swap_before(monkeypatch, "_copy_file", "empty", swap, src)
    with pytest.raises(CheckpointFailed, match="changed during the copy"):
        safecopy.copy_tree(src, tmp_path / "copy")
    assert _leaked(tmp_path / "copy") == []


def test_file_swapped_for_a_fifo_does_not_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    _build(src)

    def swap(path: Path) -> None:
        path.unlink()
        os.mkfifo(path)

    _swap_before(monkeypatch, "_copy_file", "empty", swap, src)
    with pytest.raises(CheckpointFailed, match="changed during the copy"):
        safecopy.copy_tree(src, tmp_path / "copy")


def test_dir_swapped_for_a_file_is_refused(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    _build(src)

    def swap(path: Path) -> None:
        shutil.rmtree(path)
        path.write_bytes(b"now a file")

    _swap_before(monkeypatch, "_enter_dir", "opaque", swap, src)
    with pytest.raises(CheckpointFailed, match="replaced"):
        safecopy.copy_tree(src, tmp_path / "copy")


def test_symlinks_in_the_tree_are_copied_not_followed(tmp_path: Path,
                                                      secret_dir: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.symlink(secret_dir, src / "keys")
    os.symlink(secret_dir / "1", src / "key")
    safecopy.copy_tree(src, tmp_path / "copy")
    assert os.readlink(tmp_path / "copy" / "keys") == str(secret_dir)
    assert _leaked(tmp_path / "copy") == []


def test_source_root_that_is_a_symlink_is_refused(tmp_path: Path, secret_dir: Path) -> None:
    os.symlink(secret_dir, tmp_path / "src")
    with pytest.raises(CheckpointFailed, match="cannot copy"):
        safecopy.copy_tree(tmp_path / "src", tmp_path / "copy")
    assert _leaked(tmp_path / "copy") == []


def test_a_mount_under_the_tree_is_not_entered(tmp_path: Path, secret_dir: Path) -> None:
    """Another filesystem (tmpfs), and a bind mount of a host directory of the SAME
    filesystem (same st_dev: only the mount id tells): neither is copied nor walked."""
    src = tmp_path / "src"
    (src / "vol").mkdir(parents=True)
    (src / "bind").mkdir()
    (src / "file").write_bytes(b"x")
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(src / "vol")], check=True)
    try:
        subprocess.run(["mount", "--bind", str(secret_dir), str(src / "bind")], check=True)
        try:
            assert os.stat(src / "bind").st_dev == os.stat(src).st_dev
            (src / "vol" / "other").write_bytes(SECRET)
            stats = safecopy.copy_tree(src, tmp_path / "copy")
            walked = sorted(rel for rel, _ in safecopy.walk(src))
            size = safecopy.tree_bytes(src)
        finally:
            subprocess.run(["umount", str(src / "bind")], check=True)
    finally:
        subprocess.run(["umount", str(src / "vol")], check=True)
    assert sorted(stats.mounts_skipped) == ["bind", "vol"]
    for mount_point in ("vol", "bind"):
        assert (tmp_path / "copy" / mount_point).is_dir()
        assert list((tmp_path / "copy" / mount_point).iterdir()) == []
    assert (tmp_path / "copy" / "file").read_bytes() == b"x"
    assert _leaked(tmp_path / "copy") == []
    assert walked == ["bind", "file", "vol"] and size == 1


def test_a_directory_met_twice_is_refused(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory moved, during the copy, to a place the walk has not listed yet is not
    walked twice (a tenant cannot make the walk endless)."""
    src = tmp_path / "src"
    (src / "a" / "sub").mkdir(parents=True)
    (src / "b").mkdir()
    moved = {"done": False}
    original = safecopy._Copier._enter_dir

    def wrapped(self: Any, s: int, d: int, name: str, rel: str, st: Any) -> Any:
        result = original(self, s, d, name, rel, st)
        if rel == "a/sub" and not moved["done"]:
            moved["done"] = True
            os.rename(src / "a" / "sub", src / "b" / "sub")
        return result

    monkeypatch.setattr(safecopy._Copier, "_enter_dir", wrapped)
    with pytest.raises(CheckpointFailed, match="moved where the walk met it again"):
        safecopy.copy_tree(src, tmp_path / "copy")


def test_copied_xattr_names() -> None:
    assert safecopy.copied_xattr("user.x")
    assert safecopy.copied_xattr("security.capability")
    assert safecopy.copied_xattr("trusted.overlay.opaque")
    assert safecopy.copied_xattr("trusted.overlay.whiteout")
    assert not safecopy.copied_xattr("trusted.overlay.origin")
    assert not safecopy.copied_xattr("security.selinux")


@pytest.fixture(autouse=True)
def _no_stray_fds() -> Iterator[None]:
    before = _fds()
    yield
    assert _fds() - before == set()


def test_an_entry_that_vanishes_names_itself(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    _build(src)
    _swap_before(monkeypatch, "_copy_file", "big", lambda path: path.unlink(), src)
    with pytest.raises(CheckpointFailed) as failure:
        safecopy.copy_tree(src, tmp_path / "copy")
    assert str(failure.value) == (
        f"cannot copy {src}/big: it vanished during the copy; a process outside the frozen "
        "container is modifying the tree")


def test_tree_bytes_never_enters_a_symlink(tmp_path: Path, secret_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "a").write_bytes(b"x" * 100)
    os.link(src / "d" / "a", src / "d" / "b")  # once
    os.symlink(secret_dir, src / "keys")
    assert safecopy.tree_bytes(src) == 100
    assert safecopy.tree_bytes(tmp_path / "missing") == 0
    # A directory swapped for a symlink between the listing and the open: skipped.
    real_stat = os.stat

    def swapping_stat(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        st = real_stat(name, *args, **kwargs)
        if name == "d" and kwargs.get("dir_fd") is not None:
            os.rename(src / "d", src / "d.moved")
            os.symlink(secret_dir, src / "d")
        return st

    monkeypatch.setattr(safecopy.os, "stat", swapping_stat)
    assert safecopy.tree_bytes(src) == 0


def test_a_real_device_node_is_refused_not_made(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    os.mknod(src / "disk", stat.S_IFBLK | 0o600, os.makedev(8, 0))
    with pytest.raises(CheckpointFailed, match="device node 8:0 is not supported"):
        safecopy.copy_tree(src, tmp_path / "copy")
    assert not (tmp_path / "copy" / "disk").exists()


def test_walk_lists_parents_first_and_refuses_a_swapped_directory(
        tmp_path: Path, secret_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    (src / "d" / "e").mkdir(parents=True)
    (src / "d" / "e" / "f").write_bytes(b"f")
    os.symlink(secret_dir, src / "keys")
    rels = [rel for rel, _ in safecopy.walk(src)]
    assert sorted(rels) == ["d", "d/e", "d/e/f", "keys"]
    assert rels.index("d") < rels.index("d/e") < rels.index("d/e/f")
    with pytest.raises(FileNotFoundError):
        list(safecopy.walk(tmp_path / "missing"))
    real_stat = os.stat

    def swapping_stat(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        st = real_stat(name, *args, **kwargs)
        if name == "d" and kwargs.get("dir_fd") is not None:
            os.rename(src / "d", src / "d.moved")
            os.symlink(secret_dir, src / "d")
        return st

    monkeypatch.setattr(safecopy.os, "stat", swapping_stat)
    with pytest.raises(OSError):
        list(safecopy.walk(src))
