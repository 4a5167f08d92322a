"""fsapply on real overlay mounts: a captured upperdir reproduces the merged view.

The source is a real overlayfs (``mount -t overlay``): changes made in its merged view
leave a real upperdir (whiteout devices, opaque dirs, copied-up files). That upperdir
is captured as the checkpoint engine does (``safecopy``, ``scan_tree``, a manifest
round trip) and applied with ``apply_tree`` onto a second, fresh overlay over the same
lower layer; both merged views must then be the same. Hostile trees must be refused
or stay inside the target root.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import RestoreFailed
from hermit_common.manifest import Binding, Manifest, ManifestError, Totals, utc_now
from hermit_common.tree import (
    KIND_DIR,
    KIND_FIFO,
    KIND_FILE,
    KIND_SYMLINK,
    KIND_WHITEOUT,
    Entry,
    scan_tree,
)
from hermit_node.engine.admit import FROM_IMAGE, drop_privileges
from hermit_node.engine.checkpoint import SECTION_ROOTFS, SECTION_WORKSPACE, _copy_tree
from hermit_node.engine.fsapply import apply_tree
from hermit_node.engine.imagefiles import image_lookup

pytestmark = pytest.mark.integration

CHUNK = 64 * 1024
UID, GID = 1234, 5678
BIG = bytes(range(256)) * (3 * CHUNK // 256) + b"tail"  # several chunks, odd length
# security.capability, VFS_CAP_REVISION_2 with the effective bit: cap_net_raw (13), like ping.
CAP_NET_RAW = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)


# -- mounts ---------------------------------------------------------------------------

MountOverlay = Callable[[Path, Path], Path]


@pytest.fixture
def mount_overlay() -> Iterator[MountOverlay]:
    """``mount_overlay(lower, base)`` mounts an overlay with its upper/work/merged under
    ``base`` and returns the merged dir; every mount is undone at teardown."""
    assert os.geteuid() == 0, "overlay mounts need root: run the integration tier as root"
    mounted: list[Path] = []

    def mount(lower: Path, base: Path) -> Path:
        upper, work, merged = base / "upper", base / "work", base / "merged"
        for d in (upper, work, merged):
            d.mkdir(parents=True)
        options = f"lowerdir={lower},upperdir={upper},workdir={work}"
        proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
                              capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"mount -t overlay -o {options} failed: {proc.stderr}"
        mounted.append(merged)
        return merged

    yield mount
    for merged in reversed(mounted):
        if subprocess.run(["umount", str(merged)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "-l", str(merged)], capture_output=True, check=False)


# -- capture, as the checkpoint engine and the store do it ----------------------------

def _binding() -> Binding:
    return Binding(namespace="team-a", sandbox="agent-1", sandbox_uid="uid-1",
                   checkpoint="ckpt-1", criu_version="4.2", kernel=os.uname().release)


def _chunks(path: Path, size: int) -> tuple[str, ...]:
    data = path.read_bytes()
    assert len(data) == size
    return tuple(hashlib.sha256(data[o:o + CHUNK]).hexdigest() for o in range(0, size, CHUNK))


def _capture(source: Path, staging: Path, section: str = SECTION_ROOTFS) -> list[Entry]:
    """cp -a (checkpoint._copy_tree), scan_tree (what the store lists), then the entries
    go through the manifest's JSON and strict parsing as a restore reads them.
    ``staging`` then holds every file's content at its entry path, like a download."""
    _copy_tree(source, staging)
    entries = [
        dataclasses.replace(e, chunks=_chunks(staging / e.path, e.size))
        if e.kind == KIND_FILE else e
        for e in scan_tree(staging)
    ]
    manifest = Manifest(binding=_binding(), created_at=utc_now(), chunk_size=CHUNK,
                        sections={section: tuple(entries)}, restore={}, totals=Totals())
    return list(Manifest.from_json(manifest.to_json()).sections[section])


# -- comparing trees ------------------------------------------------------------------

def _xattrs(path: str) -> dict[str, bytes]:
    return {name: os.getxattr(path, name, follow_symlinks=False)
            for name in sorted(os.listxattr(path, follow_symlinks=False))}


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything under ``root`` (not root), not following links."""
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        for name in sorted(os.listdir(os.path.join(root, rel_dir))):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            st = os.lstat(os.path.join(root, rel))
            yield rel, st
            if stat.S_ISDIR(st.st_mode):
                pending.append(rel)


def _snapshot(root: Path) -> dict[str, dict[str, Any]]:
    """Everything the capture carries: type, mode, owner, mtime, content, link target."""
    out: dict[str, dict[str, Any]] = {}
    for rel, st in _walk(root):
        full = os.path.join(root, rel)
        item: dict[str, Any] = {
            "type": stat.S_IFMT(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
            "mtime_ns": st.st_mtime_ns,
        }
        if not stat.S_ISLNK(st.st_mode):
            item["mode"] = oct(stat.S_IMODE(st.st_mode))
        if stat.S_ISREG(st.st_mode):
            with open(full, "rb") as f:
                item["sha256"] = hashlib.sha256(f.read()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            item["target"] = os.readlink(full)
        out[rel] = item
    return out


def _all_xattrs(root: Path) -> dict[str, dict[str, bytes]]:
    return {rel: x for rel, _ in _walk(root) if (x := _xattrs(os.path.join(root, rel)))}


def _inode_groups(root: Path) -> set[frozenset[str]]:
    """The sets of names that share one inode (hardlinks), for non-directories."""
    by_inode: dict[int, set[str]] = {}
    for rel, st in _walk(root):
        if not stat.S_ISDIR(st.st_mode):
            by_inode.setdefault(st.st_ino, set()).add(rel)
    return {frozenset(names) for names in by_inode.values() if len(names) > 1}


def _listing(root: Path) -> dict[str, str]:
    """Names and contents of everything under ``root``, to see that nothing changed."""
    out: dict[str, str] = {}
    for rel, st in _walk(root):
        full = os.path.join(root, rel)
        if stat.S_ISREG(st.st_mode):
            out[rel] = Path(full).read_text(errors="replace")
        elif stat.S_ISLNK(st.st_mode):
            out[rel] = "-> " + os.readlink(full)
        else:
            out[rel] = oct(st.st_mode)
    return out


# -- the scenario ---------------------------------------------------------------------

def _build_lower(lower: Path) -> None:
    """A small image layer."""
    (lower / "etc").mkdir(parents=True)
    (lower / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    (lower / "etc" / "motd").write_text("welcome\n")
    (lower / "etc" / "owned").write_text("root's\n")
    (lower / "etc" / "deleteme").write_text("gone after the change\n")
    (lower / "etc" / "old-name").write_text("renamed\n")
    (lower / "data" / "sub").mkdir(parents=True)
    (lower / "data" / "old1").write_text("lower data 1\n")
    (lower / "data" / "sub" / "deep").write_text("lower deep\n")
    (lower / "olddir" / "inner").mkdir(parents=True)
    (lower / "olddir" / "inner" / "f").write_text("removed with its dir\n")
    (lower / "thing").write_text("a file that becomes a dir\n")
    (lower / "libdir").mkdir()
    (lower / "libdir" / "x.so").write_bytes(b"\x7fELF")
    (lower / "usr" / "bin").mkdir(parents=True)
    (lower / "usr" / "bin" / "tool").write_text("#!/bin/sh\necho tool\n")
    (lower / "usr" / "bin" / "tool").chmod(0o755)
    (lower / "lowerhl1").write_text("lower hardlink\n")
    os.link(lower / "lowerhl1", lower / "lowerhl2")
    os.symlink("usr/bin", lower / "bin")


def _change_merged(m: Path) -> None:
    """What an agent does in its sandbox, in the first merged view."""
    home = m / "home" / "agent"
    home.mkdir(parents=True)
    os.chown(m / "home", 0, 0)
    os.chown(home, UID, GID)
    # Regular files: modes, owners, sizes, names.
    (home / "secret").write_text("token\n")
    os.chown(home / "secret", UID, GID)
    (home / "secret").chmod(0o600)
    (home / "run.sh").write_text("#!/bin/sh\nexit 0\n")
    (home / "run.sh").chmod(0o755)
    (home / "big.bin").write_bytes(BIG)
    (home / "empty-file").write_bytes(b"")
    (home / "sp ace ünï\ncode").write_text("odd name\n")
    os.close(os.open(os.path.join(os.fsencode(home), b"latin1-caf\xe9"),
                     os.O_WRONLY | os.O_CREAT, 0o644))  # a name that is not UTF-8
    (m / "usr" / "local" / "bin").mkdir(parents=True)
    (m / "usr" / "local" / "bin" / "suid-root").write_text("#!/bin/sh\n")
    (m / "usr" / "local" / "bin" / "suid-root").chmod(0o4755)
    (home / "suid-user").write_text("#!/bin/sh\n")
    os.chown(home / "suid-user", UID, GID)
    (home / "suid-user").chmod(0o6750)  # chown after chmod would clear these bits
    # Directories: setgid (inherited by children), sticky, empty, private.
    shared = m / "shared"
    shared.mkdir()
    os.chown(shared, UID, GID)
    shared.chmod(0o2775)
    (shared / "note").write_text("group 5678 by inheritance\n")
    (shared / "sub").mkdir()  # inherits the setgid bit and the group
    (m / "scratch").mkdir()
    (m / "scratch").chmod(0o1777)
    (home / "empty").mkdir()
    (home / "empty").chmod(0o700)
    # Extended attributes on a new file and on a copied-up lower file.
    os.setxattr(home / "secret", "user.agent", b"hello")
    os.setxattr(m / "etc" / "hosts", "user.origin", b"lower")
    os.setxattr(home / "empty", "user.dir", b"on a directory")
    os.setxattr(shared, "trusted.hermit-test", b"\x00\xffbinary")
    # File capabilities (set after owner and mode: a chown clears them), one inode with
    # two names; trusted.* on a symlink (user.* cannot be set on one).
    (m / "usr" / "local" / "bin" / "ping").write_text("#!/bin/sh\n")
    (m / "usr" / "local" / "bin" / "ping").chmod(0o755)
    os.setxattr(m / "usr" / "local" / "bin" / "ping", "security.capability", CAP_NET_RAW)
    os.link(m / "usr" / "local" / "bin" / "ping", home / "ping-too")
    (home / "agent-ping").write_text("#!/bin/sh\n")
    os.chown(home / "agent-ping", UID, GID)
    os.setxattr(home / "agent-ping", "security.capability", CAP_NET_RAW)
    # Symlinks: relative, absolute, dangling, owned by the agent.
    os.symlink("../../etc/hosts", home / "link-rel")
    os.symlink("/etc/hosts", home / "link-abs")
    os.symlink("/nonexistent/target", home / "dangling")
    os.chown(home / "link-rel", UID, GID, follow_symlinks=False)
    os.setxattr(home / "link-abs", "trusted.on-symlink", b"kept", follow_symlinks=False)
    # Hardlinks: two names, one inode.
    (home / "hl-a").write_text("shared inode\n")
    os.link(home / "hl-a", home / "hl-b")
    # A FIFO.
    os.mkfifo(home / "fifo")
    os.chown(home / "fifo", UID, GID)
    (home / "fifo").chmod(0o640)
    # Lower files changed: content, mode only, owner only (each a copy-up).
    with open(m / "etc" / "hosts", "a") as f:
        f.write("10.0.0.1 db\n")
    (m / "etc" / "motd").chmod(0o600)
    os.chown(m / "etc" / "owned", UID, GID)
    # Deletions (whiteouts): a lower file, a whole lower directory.
    (m / "etc" / "deleteme").unlink()
    for path in (m / "olddir" / "inner" / "f", m / "olddir" / "inner", m / "olddir"):
        path.unlink() if path.is_file() else path.rmdir()
    # A lower directory replaced by a new one (opaque dir).
    (m / "data" / "sub" / "deep").unlink()
    (m / "data" / "sub").rmdir()
    (m / "data" / "old1").unlink()
    (m / "data").rmdir()
    (m / "data").mkdir()
    (m / "data" / "new1").write_text("new data\n")
    # A lower file replaced by a dir; a lower dir replaced by a symlink.
    (m / "thing").unlink()
    (m / "thing").mkdir()
    (m / "thing" / "inside").write_text("inside the new dir\n")
    (m / "libdir" / "x.so").unlink()
    (m / "libdir").rmdir()
    os.symlink("usr/lib", m / "libdir")
    # Renames: a lower file (copy-up + whiteout), a new file.
    os.rename(m / "etc" / "old-name", m / "etc" / "new-name")
    os.rename(home / "run.sh", home / "start.sh")


@pytest.fixture
def scenario(tmp_path: Path, mount_overlay: MountOverlay) -> tuple[Path, Path, Path]:
    """(lower, first merged view after the changes, its upperdir)."""
    lower = tmp_path / "lower"
    _build_lower(lower)
    merged = mount_overlay(lower, tmp_path / "ov1")
    _change_merged(merged)
    return lower, merged, tmp_path / "ov1" / "upper"


def _restore(tmp_path: Path, mount_overlay: MountOverlay, lower: Path,
             upper: Path) -> tuple[list[Entry], Path]:
    entries = _capture(upper, tmp_path / "staging")
    merged = mount_overlay(lower, tmp_path / "ov2")
    apply_tree(entries, tmp_path / "staging", merged)
    return entries, merged


def test_capture_holds_overlay_markers(scenario: tuple[Path, Path, Path],
                                       tmp_path: Path) -> None:
    """The upperdir really has what the other tests rely on (overlayfs did its part)."""
    _, _, upper = scenario
    entries = {e.path: e for e in _capture(upper, tmp_path / "staging")}
    whiteouts = {p for p, e in entries.items() if e.kind == KIND_WHITEOUT}
    assert {"etc/deleteme", "etc/old-name", "olddir"} <= whiteouts
    assert entries["data"].kind == KIND_DIR and entries["data"].opaque
    assert not entries["etc"].opaque and not entries["home"].opaque
    assert entries["libdir"].kind == KIND_SYMLINK
    assert entries["shared/sub"].mode == 0o2755
    assert (entries["home/agent/secret"].uid, entries["home/agent/secret"].gid) == (UID, GID)
    assert entries["home/agent/big.bin"].chunks and len(entries["home/agent/big.bin"].chunks) == 4
    assert "lowerhl1" not in entries and "usr/bin/tool" not in entries  # untouched lower
    # Hardlinks: later names point at the first; the same inode, so the same description.
    assert entries["home/agent/hl-a"].link is None
    assert entries["home/agent/hl-b"].link == "home/agent/hl-a"
    assert entries["usr/local/bin/ping"].link == "home/agent/ping-too"
    assert entries["home/agent/hl-b"].chunks == entries["home/agent/hl-a"].chunks
    # Extended attributes, but never overlayfs' own (the opaque dir has trusted.overlay.opaque).
    assert dict(entries["home/agent/secret"].xattrs) == {"user.agent": b"hello"}
    assert dict(entries["home/agent/agent-ping"].xattrs) == {"security.capability": CAP_NET_RAW}
    assert dict(entries["home/agent/link-abs"].xattrs) == {"trusted.on-symlink": b"kept"}
    assert entries["data"].xattrs == ()
    assert not [n for e in entries.values() for n, _ in e.xattrs if "overlay" in n]


def test_apply_reproduces_the_merged_view(scenario: tuple[Path, Path, Path],
                                          tmp_path: Path, mount_overlay: MountOverlay) -> None:
    lower, first, upper = scenario
    _, second = _restore(tmp_path, mount_overlay, lower, upper)

    before, after = _snapshot(first), _snapshot(second)
    assert sorted(after) == sorted(before)  # names: nothing missing, nothing extra
    for path in before:
        assert after[path] == before[path], path
    # The interesting cases, spelled out.
    home = second / "home" / "agent"
    for gone in ("etc/deleteme", "etc/old-name", "olddir", "data/old1", "data/sub",
                 "libdir/x.so", "home/agent/run.sh"):
        assert not os.path.lexists(second / gone), f"{gone} came back"
    assert sorted(os.listdir(second / "data")) == ["new1"]
    assert sorted(os.listdir(second / "thing")) == ["inside"]
    assert (second / "etc" / "new-name").read_text() == "renamed\n"
    assert (second / "etc" / "hosts").read_text() == "127.0.0.1 localhost\n10.0.0.1 db\n"
    assert (home / "big.bin").read_bytes() == BIG
    assert stat.S_IMODE(os.stat(home / "suid-user").st_mode) == 0o6750
    assert stat.S_IMODE(os.stat(second / "shared").st_mode) == 0o2775
    assert os.stat(second / "shared" / "note").st_gid == GID
    assert stat.S_ISFIFO(os.lstat(home / "fifo").st_mode)
    assert os.readlink(home / "link-rel") == "../../etc/hosts"
    assert os.lstat(home / "link-rel").st_uid == UID
    assert os.readlink(home / "link-abs") == "/etc/hosts"
    assert os.readlink(second / "libdir") == "usr/lib"
    assert (home / "hl-b").read_text() == "shared inode\n"
    assert os.listdir(home / "empty") == []
    # Lower files the change did not touch are still the lower layer's.
    assert (second / "usr" / "bin" / "tool").read_text() == "#!/bin/sh\necho tool\n"
    assert os.lstat(second / "lowerhl1").st_ino == os.lstat(second / "lowerhl2").st_ino


def test_apply_keeps_xattrs(scenario: tuple[Path, Path, Path], tmp_path: Path,
                            mount_overlay: MountOverlay) -> None:
    lower, first, upper = scenario
    _, second = _restore(tmp_path, mount_overlay, lower, upper)
    assert _all_xattrs(first)  # user.agent and user.origin are there to lose
    assert _all_xattrs(second) == _all_xattrs(first)
    home = second / "home" / "agent"
    for capable in (home / "agent-ping", home / "ping-too", second / "usr/local/bin/ping"):
        assert os.getxattr(capable, "security.capability") == CAP_NET_RAW, capable
    assert os.stat(home / "agent-ping").st_uid == UID
    assert os.getxattr(home / "link-abs", "trusted.on-symlink", follow_symlinks=False) == b"kept"


def test_apply_keeps_hardlinks_one_inode(scenario: tuple[Path, Path, Path], tmp_path: Path,
                                         mount_overlay: MountOverlay) -> None:
    lower, first, upper = scenario
    _, second = _restore(tmp_path, mount_overlay, lower, upper)
    assert frozenset({"home/agent/hl-a", "home/agent/hl-b"}) in _inode_groups(first)
    assert _inode_groups(second) == _inode_groups(first)


def test_hardlink_whose_first_name_is_under_a_mount_point(tmp_path: Path) -> None:
    """The first name is left alone (a mount of the new container): the next kept name
    gets the content from staging, and the later ones link to it."""
    source, target = tmp_path / "src", tmp_path / "target"
    (source / "mnt").mkdir(parents=True)
    (source / "mnt" / "first").write_text("one inode\n")
    (source / "mnt" / "first").chmod(0o640)
    for name in ("second", "third"):
        os.link(source / "mnt" / "first", source / name)
    entries = _capture(source, tmp_path / "staging")
    assert [e.link for e in entries if e.path in ("second", "third")] == ["mnt/first"] * 2
    (target / "mnt").mkdir(parents=True)
    (target / "mnt" / "first").write_text("the mount's own file\n")
    apply_tree(entries, tmp_path / "staging", target, skip=["/mnt"])
    assert (target / "mnt" / "first").read_text() == "the mount's own file\n"
    assert (target / "second").read_text() == "one inode\n"
    assert stat.S_IMODE(os.stat(target / "second").st_mode) == 0o640
    assert os.stat(target / "second").st_ino == os.stat(target / "third").st_ino
    assert os.stat(target / "second").st_ino != os.stat(target / "mnt" / "first").st_ino


def test_apply_twice_is_idempotent(scenario: tuple[Path, Path, Path], tmp_path: Path,
                                   mount_overlay: MountOverlay) -> None:
    """A restore retried on the same container ends in the same state."""
    lower, first, upper = scenario
    entries, second = _restore(tmp_path, mount_overlay, lower, upper)
    apply_tree(entries, tmp_path / "staging", second)
    assert _snapshot(second) == _snapshot(first)


def test_apply_keeps_bind_mounts_of_the_running_container(tmp_path: Path) -> None:
    """The target container is running: runc bind-mounted kubelet's resolv.conf onto a
    placeholder in its own mount namespace, and the captured tree has such a placeholder
    too (runc created it in the old container's upperdir). Replacing it would detach the
    mount there, so the restore passes the container's mount points to skip."""
    source, target = tmp_path / "old-upper", tmp_path / "rootfs"
    for root in (source, target):
        (root / "etc").mkdir(parents=True)
        (root / "etc" / "resolv.conf").write_bytes(b"")
    kubelet = tmp_path / "kubelet-resolv.conf"
    kubelet.write_text("nameserver 10.96.0.10\n")
    entries = _capture(source, tmp_path / "staging")
    mountpoint = target / "etc" / "resolv.conf"
    holder = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f"mount --bind '{kubelet}' '{mountpoint}' && echo ready && exec sleep 600"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        in_container = Path(f"/proc/{holder.pid}/root") / str(mountpoint).lstrip("/")
        assert in_container.read_text() == "nameserver 10.96.0.10\n"
        apply_tree(entries, tmp_path / "staging", target, skip=["/etc/resolv.conf"])
        assert in_container.read_text() == "nameserver 10.96.0.10\n", "the mount is gone"
    finally:
        holder.kill()
        holder.wait()


# -- replace=True: a workspace volume restored as it was -------------------------------

def test_replace_makes_the_target_exactly_the_tree(tmp_path: Path) -> None:
    source = tmp_path / "workspace-then"
    (source / "proj" / "src").mkdir(parents=True)
    (source / "proj" / "src" / "main.py").write_text("print('hi')\n")
    (source / "proj" / "README").write_text("kept\n")
    (source / "proj" / "keys").write_text("private\n")
    os.chown(source / "proj" / "keys", UID, GID)
    (source / "proj" / "keys").chmod(0o600)
    os.symlink("src/main.py", source / "proj" / "entry")
    os.mkfifo(source / "proj" / "pipe")
    (source / "empty").mkdir()
    entries = _capture(source, tmp_path / "staging", SECTION_WORKSPACE)

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("host file\n")
    target = tmp_path / "workspace-now"
    (target / "proj" / "src").mkdir(parents=True)
    (target / "proj" / "src" / "main.py").write_text("a newer, wrong version\n")
    (target / "proj" / "stale").write_text("not in the checkpoint\n")
    (target / "junk" / "deep").mkdir(parents=True)
    (target / "junk" / "deep" / "f").write_text("x\n")
    (target / "empty").mkdir()
    (target / "empty" / "was-not-empty").write_text("x\n")
    os.symlink(outside, target / "to-outside")
    os.symlink(outside, target / "proj" / "src-link")
    target.chmod(0o775)
    outside_before = _listing(outside)

    apply_tree(entries, tmp_path / "staging", target, replace=True)

    assert _snapshot(target) == _snapshot(source)
    assert sorted(os.listdir(target)) == ["empty", "proj"]
    assert _listing(outside) == outside_before, "replace reached through a symlink"
    assert target.is_dir() and not target.is_symlink()  # the mount point itself stays


def test_without_replace_unlisted_files_stay(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "d").mkdir(parents=True)
    (source / "d" / "new").write_text("new\n")
    entries = _capture(source, tmp_path / "staging")
    target = tmp_path / "target"
    (target / "d").mkdir(parents=True)
    (target / "d" / "other").write_text("other\n")
    (target / "top").write_text("top\n")
    apply_tree(entries, tmp_path / "staging", target)
    assert sorted(_listing(target)) == ["d", "d/new", "d/other", "top"]


# -- hostile trees --------------------------------------------------------------------

@pytest.fixture
def jail(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(target, staging, outside): ``outside`` is a host directory next to the target
    holding a victim file; nothing a tree says may change it."""
    host = tmp_path / "host"
    target, staging, outside = host / "target", host / "staging", host / "outside"
    for d in (target, staging, outside):
        d.mkdir(parents=True)
    (outside / "victim").write_text("host file\n")
    (staging / "payload").write_text("pwned\n")
    return target, staging, outside


def _host_state(tmp_path: Path, target: Path) -> dict[str, str]:
    """Everything on the host under tmp_path except inside the target."""
    return {p: v for p, v in _listing(tmp_path).items()
            if not (p + "/").startswith(os.path.relpath(target, tmp_path) + "/")}


def _file(path: str, size: int = 6) -> Entry:
    return Entry(path, KIND_FILE, 0o644, 0, 0, 0, size=size)


@pytest.mark.parametrize("path", [
    "../escaped", "a/../../escaped", "./escaped", "a//b", "/escaped", "ESCAPE_ABS",
])
def test_unsafe_entry_paths_are_refused(jail: tuple[Path, Path, Path], tmp_path: Path,
                                        path: str) -> None:
    target, staging, outside = jail
    if path == "ESCAPE_ABS":
        path = str(outside / "escaped")  # the host path of a real directory
    (target / "a").mkdir()
    before = _host_state(tmp_path, target)
    for entry in (_file(path), Entry(path, KIND_DIR, 0o755), Entry(path, KIND_WHITEOUT),
                  Entry(path, KIND_SYMLINK, 0o777, target="/")):
        with pytest.raises(RestoreFailed, match="ManifestError"):
            apply_tree([Entry("a", KIND_DIR, 0o755), entry], staging, target)
    assert _host_state(tmp_path, target) == before
    assert sorted(_listing(target)) == ["a"]  # refused before anything was written


def test_unknown_kinds_are_refused(jail: tuple[Path, Path, Path]) -> None:
    target, staging, _ = jail
    with pytest.raises(RestoreFailed, match="unknown kind 'chardev'"):
        apply_tree([Entry("null", "chardev", 0o666)], staging, target)
    assert os.listdir(target) == []


@pytest.mark.parametrize("bad", ["later", "symlink", "missing", "chain", "differs"])
def test_unsound_hardlinks_are_refused(jail: tuple[Path, Path, Path], bad: str) -> None:
    target, staging, _ = jail
    (staging / "a").write_text("pwned\n")
    first, link = _file("a"), dataclasses.replace(_file("b"), link="a")
    entries = {
        "later": [link, first],
        "symlink": [Entry("a", KIND_SYMLINK, 0o777, target="/etc/shadow"), link],
        "missing": [dataclasses.replace(_file("b"), link="nope")],
        "chain": [first, link, dataclasses.replace(_file("c"), link="b")],
        "differs": [first, dataclasses.replace(link, mode=0o4755)],
    }[bad]
    with pytest.raises(RestoreFailed, match=r"ManifestError: file tree/.* hardlink of"):
        apply_tree(entries, staging, target)
    assert os.listdir(target) == []


@pytest.mark.parametrize("name", ["trusted.overlay.opaque", "user.overlay.redirect",
                                  "security.selinux", "system.posix_acl_access", "user.a b"])
def test_foreign_xattrs_are_refused(jail: tuple[Path, Path, Path], name: str) -> None:
    target, staging, _ = jail
    entry = dataclasses.replace(Entry("d", KIND_DIR, 0o755), xattrs=((name, b"y"),))
    with pytest.raises(RestoreFailed, match=r"ManifestError: .*extended attribute"):
        apply_tree([entry], staging, target)
    assert os.listdir(target) == []


THROUGH = r"RestoreFailed: .*its parent {} is a symlink in the target; nothing is written"


@pytest.mark.parametrize("planted", ["by-the-target", "by-the-tree"])
def test_hardlinks_through_a_symlink_are_refused(jail: tuple[Path, Path, Path],
                                                 tmp_path: Path, planted: str) -> None:
    """A hardlink's new name, or the name it links to, behind a symlink: the target's own
    (its first name "evil/victim" is not listed as under a dir) or one the tree put in
    place of a directory it had just written (both check_entries-inconsistent trees).
    The target also has a directory at the host path of ``outside``, so a write through
    the symlink would succeed inside the chroot: it is refused all the same."""
    target, staging, outside = jail
    inner = target / str(outside).lstrip("/")
    inner.mkdir(parents=True)
    (staging / "evil").mkdir()
    (staging / "evil" / "victim").write_text("pwned\n")
    (staging / "copy").write_text("pwned\n")
    first, link = _file("evil/victim"), dataclasses.replace(_file("copy"), link="evil/victim")
    if planted == "by-the-target":
        os.symlink(outside, target / "evil")
        entries = [first, link]
    else:
        (inner / "victim").write_text("the container's own file\n")
        entries = [Entry("evil", KIND_DIR, 0o755), first,
                   Entry("evil", KIND_SYMLINK, 0o777, target=str(outside)), link]
    before = _host_state(tmp_path, target)
    inner_before = _listing(inner)
    with pytest.raises(RestoreFailed, match=THROUGH.format("evil")):
        apply_tree(entries, staging, target)
    assert _listing(inner) == inner_before, "written through the symlink"
    assert not (target / "copy").exists()
    assert _host_state(tmp_path, target) == before, "the tree changed the host"
    assert (outside / "victim").read_text() == "host file\n"


# Each way a later entry could use a symlink the same tree planted at its parent.
_THROUGH_ENTRIES: dict[str, Entry] = {
    "whiteout": Entry("esc/victim", KIND_WHITEOUT),
    "file": Entry("esc/payload", KIND_FILE, 0o4755, 0, 0, 0, size=6),
    "dir": Entry("esc/newdir", KIND_DIR, 0o777),
    "opaque-dir": Entry("esc/victim-dir", KIND_DIR, 0o777, opaque=True),
    "symlink": Entry("esc/victim", KIND_SYMLINK, 0o777, target="/etc/shadow"),
    "fifo": Entry("esc/fifo", KIND_FIFO, 0o666),
}


@pytest.mark.parametrize("through", sorted(_THROUGH_ENTRIES))
@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("kind", ["absolute", "relative"])
def test_writes_through_a_symlink_planted_by_the_tree_are_refused(
        jail: tuple[Path, Path, Path], tmp_path: Path, kind: str, mirror: bool,
        through: str) -> None:
    """The classic attack: the tree plants a symlink to ``outside``, then writes, creates,
    deletes or empties "through" it (check_entries refuses such a tree when it is parsed;
    fsapply refuses it on its own). ``mirror``: the target also has a directory at the
    host path of ``outside``, where a write that followed the symlink inside the chroot
    would land; nothing lands there either."""
    target, staging, outside = jail
    (outside / "victim-dir").mkdir()
    (outside / "victim-dir" / "keep").write_text("host file\n")
    link = str(outside) if kind == "absolute" else "../" * 30 + str(outside).lstrip("/")
    (staging / "esc").mkdir()
    (staging / "esc" / "payload").write_text("pwned\n")
    inner = target / str(outside).lstrip("/")
    if mirror:
        inner.mkdir(parents=True)
        (inner / "victim").write_text("the container's own file\n")
        (inner / "victim-dir").mkdir()
        (inner / "victim-dir" / "keep").write_text("the container's own file\n")
    before = _host_state(tmp_path, target)
    inner_before = _listing(inner) if mirror else {}
    entries = [Entry("esc", KIND_SYMLINK, 0o777, target=link), _THROUGH_ENTRIES[through]]
    with pytest.raises(RestoreFailed, match=THROUGH.format("esc")):
        apply_tree(entries, staging, target)
    assert os.readlink(target / "esc") == link  # the symlink itself is the tree's to make
    if mirror:
        assert _listing(inner) == inner_before, "written through the symlink"
    assert _host_state(tmp_path, target) == before, "the tree changed the host"
    assert (outside / "victim").read_text() == "host file\n"


def test_a_manifest_that_writes_through_its_own_symlink_is_refused_when_parsed() -> None:
    """The first wall: such a tree never gets past parsing (no parent directory entry)."""
    entries = [Entry("esc", KIND_SYMLINK, 0o777, target="/etc"),
               Entry("esc/passwd", KIND_FILE, 0o644, 0, 0, 0, size=0)]
    manifest = Manifest(binding=_binding(), created_at=utc_now(), chunk_size=CHUNK,
                        sections={SECTION_ROOTFS: ()}, restore={}, totals=Totals())
    raw = json.loads(manifest.to_json())
    raw["sections"][SECTION_ROOTFS] = [e.to_dict() for e in entries]
    with pytest.raises(ManifestError, match="'esc/passwd' has no parent directory entry"):
        Manifest.from_dict(raw)


@pytest.mark.parametrize("tree", ["consistent", "inconsistent", "inconsistent-replace"])
def test_symlinks_already_in_the_target_are_not_followed(
        jail: tuple[Path, Path, Path], tmp_path: Path, tree: str) -> None:
    """The container's own files are untrusted too: its symlinks may point at host paths.
    The target also has a directory at the host path of ``outside`` (as a container
    could), where writes that followed the symlinks inside the chroot would land."""
    target, staging, outside = jail
    os.symlink(outside, target / "evil-abs")
    os.symlink("../" * 30 + str(outside).lstrip("/"), target / "evil-rel")
    (target / "real").mkdir()
    os.symlink(outside / "victim", target / "real" / "file-link")
    inner = target / str(outside).lstrip("/")
    inner.mkdir(parents=True)
    (inner / "victim").write_text("the container's own file\n")
    (staging / "evil-abs").mkdir()
    (staging / "evil-abs" / "payload").write_text("pwned\n")
    (staging / "real").mkdir()
    (staging / "real" / "file-link").write_text("pwned\n")
    before = _host_state(tmp_path, target)
    if tree == "consistent":
        # The symlinks' paths are listed as dirs: the symlinks are replaced; a symlink
        # that is itself an entry's path is replaced, not followed.
        apply_tree([Entry("evil-abs", KIND_DIR, 0o755), _file("evil-abs/payload"),
                    Entry("evil-rel", KIND_DIR, 0o755, opaque=True),
                    Entry("real", KIND_DIR, 0o755), _file("real/file-link")], staging, target)
        assert not (target / "evil-abs").is_symlink() and not (target / "evil-rel").is_symlink()
        assert (target / "evil-abs" / "payload").read_text() == "pwned\n"
        link = target / "real" / "file-link"
        assert not link.is_symlink() and link.read_text() == "pwned\n"
    else:
        # Not listed (check_entries would refuse this): paths lead through the symlinks.
        entries = [_file("evil-abs/payload"), Entry("evil-abs/sub", KIND_DIR, 0o755, opaque=True),
                   Entry("evil-rel/victim", KIND_WHITEOUT), _file("real/file-link")]
        if tree == "inconsistent-replace":
            with pytest.raises(RestoreFailed, match="No such file or directory"):
                apply_tree(entries, staging, target, replace=True)
            assert os.listdir(target) == []
        else:
            with pytest.raises(RestoreFailed, match=THROUGH.format("evil-abs")):
                apply_tree(entries, staging, target)
            assert (target / "evil-abs").is_symlink()
    if tree != "inconsistent-replace":  # (replace emptied the target, inner included)
        assert _listing(inner) == {"victim": "the container's own file\n"}
    assert _host_state(tmp_path, target) == before, "the tree changed the host"
    assert (outside / "victim").read_text() == "host file\n"


_AUDIT = """
import json, os, runpy, sys
state = {"chrooted": False, "imports": []}
def hook(event, args):
    if event == "import" and state["chrooted"]:
        state["imports"].append(args[0])
sys.addaudithook(hook)
real_chroot = os.chroot
def chroot(path):
    real_chroot(path)
    state["chrooted"] = True
os.chroot = chroot
try:
    runpy.run_module("hermit_node.engine.fsapply", run_name="__main__")
finally:
    sys.stdout.write(json.dumps(state) + "\\n")
"""


@pytest.mark.parametrize("fail", [False, True])
def test_nothing_is_imported_from_the_target_after_chroot(
        jail: tuple[Path, Path, Path], tmp_path: Path, fail: bool) -> None:
    """After the chroot, an import would run the container's Python files as host root;
    the tree itself can plant them. No import may happen, on success or on failure."""
    target, staging, _ = jail
    (staging / "d").mkdir()
    (staging / "d" / "f").write_text("hello\n")
    entries = [Entry("d", KIND_DIR, 0o755, opaque=True), _file("d/f"),
               Entry("d/l", KIND_SYMLINK, 0o777, target="f"), Entry("gone", KIND_WHITEOUT)]
    (target / "gone").mkdir()
    (target / "gone" / "x").write_text("x\n")
    if fail:
        entries.append(_file("d/missing"))  # not in staging: FileNotFoundError after chroot
    request = {"staging": str(staging), "target": str(target), "replace": True,
               "entries": [e.to_dict() for e in entries]}
    proc = subprocess.run([sys.executable, "-c", _AUDIT], input=json.dumps(request),
                          capture_output=True, text=True, timeout=60, check=False)
    assert (proc.returncode != 0) == fail, proc.stderr
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state["chrooted"], proc.stderr
    assert state["imports"] == [], f"imported after chroot: {state['imports']}"
    assert (target / "d" / "f").read_text() == "hello\n"


# -- privileges: setuid/setgid bits and file capabilities only where the image has them --

def _build_privileged_lower(lower: Path) -> None:
    """An image with setuid, setgid and capable binaries, and symlinks to the host's."""
    (lower / "usr" / "bin").mkdir(parents=True)
    for name, mode, owner in (("su", 0o4755, (0, 0)), ("games", 0o4755, (5, 60)),
                              ("wall", 0o2755, (0, 5)), ("passwd", 0o4755, (0, 0)),
                              ("plain", 0o755, (0, 0)), ("ping", 0o755, (0, 0))):
        path = lower / "usr" / "bin" / name
        path.write_text(f"#!/bin/sh\necho {name}\n")
        os.chown(path, *owner)
        path.chmod(mode)
    os.setxattr(lower / "usr" / "bin" / "ping", "security.capability", CAP_NET_RAW)
    os.symlink("usr/bin", lower / "bin")
    os.symlink("/usr/bin", lower / "host-bin")  # the host's, if a lookup followed it


def _change_privileged(m: Path) -> None:
    """What a tenant (or a forged manifest) puts in the writable layer."""
    ubin = m / "usr" / "bin"
    for name in ("su", "ping"):  # new content, the image's privileges
        with open(ubin / name, "a") as f:
            f.write("# upgraded\n")
    (ubin / "su").chmod(0o4755)  # (a write may clear it)
    os.setxattr(ubin / "ping", "security.capability", CAP_NET_RAW)
    os.chown(ubin / "games", 0, 0)  # setuid root where the image has setuid games
    (ubin / "games").chmod(0o4755)
    (ubin / "plain").chmod(0o6755)  # the image has neither bit
    (m / "usr" / "local" / "bin").mkdir(parents=True)
    (m / "usr" / "local" / "bin" / "sudo").write_text("#!/bin/sh\n")
    (m / "usr" / "local" / "bin" / "sudo").chmod(0o4755)
    (m / "tool").write_text("#!/bin/sh\n")
    os.setxattr(m / "tool", "security.capability", CAP_NET_RAW)
    os.link(ubin / "passwd", m / "passwd-too")  # a second name the image does not have
    (m / "shared").mkdir()
    (m / "shared").chmod(0o2775)  # a setgid directory grants nothing: kept
    # Where the image has symlinks (one to the host's /usr/bin, whose su is setuid root),
    # real directories with a setuid su: the lookup must not follow the image's symlinks.
    for name in ("bin", "host-bin"):
        (m / name).unlink()
        (m / name).mkdir()
        (m / name / "su").write_text("#!/bin/sh\n")
        (m / name / "su").chmod(0o4755)


def test_privileges_are_kept_only_where_the_image_grants_them(
        tmp_path: Path, mount_overlay: MountOverlay) -> None:
    """A checkpoint's writable layer applied onto a real overlay through the manifest
    policy: setuid/setgid bits and file capabilities survive only where the new
    container's image has the same bit (same owner) or capability at the same path."""
    lower = tmp_path / "lower"
    _build_privileged_lower(lower)
    first = mount_overlay(lower, tmp_path / "ov1")
    _change_privileged(first)
    entries = _capture(tmp_path / "ov1" / "upper", tmp_path / "staging")
    second = mount_overlay(lower, tmp_path / "ov2")
    lookup = image_lookup(second)
    assert lookup("usr/bin/su") is not None and lookup("bin/su") is None
    assert lookup("host-bin/su") is None and lookup("usr/bin/nope") is None

    admitted, stripped = drop_privileges(entries, FROM_IMAGE, lookup)
    apply_tree(admitted, tmp_path / "staging", second)

    def mode(rel: str) -> int:
        return stat.S_IMODE(os.lstat(second / rel).st_mode)

    def capability(rel: str) -> bytes | None:
        return _xattrs(str(second / rel)).get("security.capability")

    assert (mode("usr/bin/su"), (second / "usr/bin/su").read_text()) == \
        (0o4755, "#!/bin/sh\necho su\n# upgraded\n")
    assert capability("usr/bin/ping") == CAP_NET_RAW
    assert (mode("usr/bin/games"), mode("usr/bin/plain")) == (0o755, 0o755)
    assert (mode("usr/local/bin/sudo"), capability("tool")) == (0o755, None)
    assert mode("passwd-too") == mode("usr/bin/passwd") == 0o755  # one inode, both names
    assert os.stat(second / "passwd-too").st_ino == os.stat(second / "usr/bin/passwd").st_ino
    assert mode("shared") == 0o2775
    assert (mode("bin/su"), mode("host-bin/su")) == (0o755, 0o755)
    assert sorted(stripped) == [
        "bin/su (setuid)", "host-bin/su (setuid)", "passwd-too (setuid)",
        "tool (file capability)", "usr/bin/games (setuid)", "usr/bin/passwd (setuid)",
        "usr/bin/plain (setuid, setgid)", "usr/local/bin/sudo (setuid)"]
