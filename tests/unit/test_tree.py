"""scan_tree and Entry: overlay semantics, determinism, and path safety of untrusted input."""

from __future__ import annotations

import base64
import dataclasses
import os
import stat
import struct
from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import CheckpointFailed
from hermit_common.tree import (
    MAX_XATTR_VALUE,
    Entry,
    ManifestError,
    check_entries,
    check_rel_path,
    is_captured_xattr,
    scan_tree,
)

CAP_NET_RAW = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)  # security.capability v2


def _build(root: Path) -> None:
    (root / "etc").mkdir()
    (root / "etc" / "hosts").write_bytes(b"127.0.0.1 localhost\n")
    (root / "etc" / "hosts").chmod(0o640)
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_bytes(b"#!/bin/sh\n")
    (root / "bin" / "tool").chmod(0o755)
    (root / "empty").write_bytes(b"")
    os.symlink("/usr/bin/python3", root / "bin" / "python")
    os.link(root / "etc" / "hosts", root / "hosts.link")
    os.mkfifo(root / "pipe")


def test_scan_describes_files_dirs_symlinks(tmp_path: Path) -> None:
    _build(tmp_path)
    entries = {e.path: e for e in scan_tree(tmp_path)}
    assert set(entries) == {"bin", "bin/python", "bin/tool", "empty", "etc", "etc/hosts",
                            "hosts.link", "pipe"}
    hosts = entries["etc/hosts"]
    assert (hosts.kind, hosts.size, hosts.mode) == ("file", 20, 0o640)
    assert hosts.uid == os.getuid() and hosts.chunks == ()
    assert hosts.mtime_ns == os.lstat(tmp_path / "etc" / "hosts").st_mtime_ns
    assert entries["hosts.link"].kind == "file"  # a later name of etc/hosts' inode
    assert entries["hosts.link"].link == "etc/hosts" and entries["etc/hosts"].link is None
    assert dataclasses.replace(entries["hosts.link"], path="etc/hosts", link=None) == hosts
    assert entries["bin/python"].kind == "symlink"
    assert entries["bin/python"].target == "/usr/bin/python3"
    assert entries["bin"].kind == "dir" and not entries["bin"].opaque
    assert entries["pipe"].kind == "fifo"


def test_scan_is_sorted_and_deterministic(tmp_path: Path) -> None:
    _build(tmp_path)
    first = scan_tree(tmp_path)
    assert [e.path for e in first] == sorted(e.path for e in first)
    assert scan_tree(tmp_path) == first


def test_whiteout_char_device_0_0(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "creating a whiteout (mknod c 0 0) needs root"
    (tmp_path / "d").mkdir()
    os.mknod(tmp_path / "d" / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))
    entries = {e.path: e for e in scan_tree(tmp_path)}
    assert entries["d/gone"] == Entry(path="d/gone", kind="whiteout")
    assert entries["d/gone"].to_dict() == {"path": "d/gone", "kind": "whiteout"}


def test_other_device_nodes_are_refused(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "mknod needs root"
    os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    with pytest.raises(CheckpointFailed, match="device node 1:3"):
        scan_tree(tmp_path)


def test_opaque_dir_from_trusted_xattr(tmp_path: Path) -> None:
    (tmp_path / "opaque").mkdir()
    (tmp_path / "plain").mkdir()
    try:
        os.setxattr(tmp_path / "opaque", "trusted.overlay.opaque", b"y")
    except OSError as exc:
        pytest.fail(f"{tmp_path} does not support trusted.* xattrs (need root): {exc}")
    entries = {e.path: e for e in scan_tree(tmp_path)}
    assert entries["opaque"].opaque is True
    assert entries["plain"].opaque is False
    assert entries["opaque"].to_dict()["opaque"] is True
    assert "opaque" not in entries["plain"].to_dict()


def test_xattr_whiteout_file(tmp_path: Path) -> None:
    (tmp_path / "wh").write_bytes(b"")
    os.setxattr(tmp_path / "wh", "trusted.overlay.whiteout", b"")
    assert scan_tree(tmp_path) == [Entry(path="wh", kind="whiteout")]


def test_scan_missing_root(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFailed, match="no such directory"):
        scan_tree(tmp_path / "nope")


def test_non_utf8_names_round_trip(tmp_path: Path) -> None:
    name = os.fsdecode(b"caf\xe9")
    (tmp_path / name).write_bytes(b"x")
    (entry,) = scan_tree(tmp_path)
    assert Entry.from_dict(entry.to_dict()) == entry


def test_entry_round_trip(tmp_path: Path) -> None:
    _build(tmp_path)
    for entry in scan_tree(tmp_path):
        assert Entry.from_dict(entry.to_dict()) == entry
    with_chunks = Entry("f", "file", 0o644, 1, 2, 3, size=5, chunks=("a" * 64,))
    assert Entry.from_dict(with_chunks.to_dict()) == with_chunks


@pytest.mark.parametrize("path", [
    "/etc/passwd", "../escape", "a/../../b", "a//b", "a/./b", ".", "", "a/", "nul\x00byte",
    "x" * 300, 7, None,
])
def test_unsafe_paths_are_rejected(path: object) -> None:
    with pytest.raises(ManifestError):
        check_rel_path(path)
    with pytest.raises(ManifestError):
        Entry.from_dict({"path": path, "kind": "whiteout"})


@pytest.mark.parametrize("data,match", [
    ({"path": "a", "kind": "device"}, "unknown kind"),
    ({"path": "a", "kind": "file", "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 0,
      "size": 1}, "chunks"),
    ({"path": "a", "kind": "file", "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 0,
      "size": 1, "chunks": ["../../etc"]}, "sha256"),
    ({"path": "a", "kind": "dir", "mode": True, "uid": 0, "gid": 0, "mtime_ns": 0}, "mode"),
    ({"path": "a", "kind": "dir", "mode": 0o7777 + 1, "uid": 0, "gid": 0, "mtime_ns": 0},
     "out of range"),
    ({"path": "a", "kind": "symlink", "mode": 0, "uid": 0, "gid": 0, "mtime_ns": 0,
      "target": "x\x00"}, "target"),
    ({"path": "a", "kind": "whiteout", "extra": 1}, "unexpected"),
    ("not an object", "not an object"),
])
def test_malformed_entries_are_rejected(data: object, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        Entry.from_dict(data)


@pytest.mark.parametrize("kind,foreign", [
    ("file", "target"), ("symlink", "chunks"), ("dir", "size"), ("fifo", "opaque"),
])
def test_fields_of_another_kind_are_rejected(kind: str, foreign: str) -> None:
    data = {**Entry("a", kind).to_dict(), foreign: 0}
    with pytest.raises(ManifestError, match=rf"\({kind}\) has unexpected fields \['{foreign}'\]"):
        Entry.from_dict(data)


def test_check_entries_refuses_paths_through_symlinks() -> None:
    entries = [Entry("link", "symlink", 0o777, target="/etc"),
               Entry("link/passwd", "file", 0o644)]
    with pytest.raises(ManifestError, match="no parent directory"):
        check_entries(entries, 1024, "fs")


def test_check_entries_wants_each_parent_listed_before_its_children(tmp_path: Path) -> None:
    """An applier that goes in order has then made every parent a real directory (not a
    symlink the target had there) before it writes under it."""
    with pytest.raises(ManifestError, match="'d/a' has no parent directory entry listed before"):
        check_entries([Entry("d/a", "whiteout"), Entry("d", "dir")], 1024, "fs")
    check_entries([Entry("d", "dir"), Entry("d/a", "whiteout")], 1024, "fs")
    # scan_tree's order (bytes of the path) always puts parents first.
    for name in ("a", "a-b", "a/b", "a.b", "a0", "a/b/c"):
        (tmp_path / "t" / name).mkdir(parents=True, exist_ok=True)
    check_entries(scan_tree(tmp_path / "t"), 1024, "fs")


def test_check_entries_refuses_duplicates_and_bad_chunk_counts() -> None:
    with pytest.raises(ManifestError, match="twice"):
        check_entries([Entry("a", "whiteout"), Entry("a", "whiteout")], 1024, "fs")
    with pytest.raises(ManifestError, match="expected 2"):
        check_entries([Entry("a", "file", size=1025, chunks=("a" * 64,))], 1024, "fs")
    check_entries([Entry("d", "dir"), Entry("d/a", "file", size=1024, chunks=("a" * 64,))],
                  1024, "fs")


# -- hardlinks ------------------------------------------------------------------------

def test_scan_links_later_names_to_the_first(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "one").write_bytes(b"shared")
    os.link(tmp_path / "b" / "one", tmp_path / "a-first")
    os.link(tmp_path / "b" / "one", tmp_path / "c")
    (tmp_path / "single").write_bytes(b"shared")  # the same content, another inode
    entries = scan_tree(tmp_path)
    links = {e.path: e.link for e in entries if e.kind == "file"}
    assert links == {"a-first": None, "b/one": "a-first", "c": "a-first", "single": None}
    assert {e.size for e in entries if e.kind == "file"} == {6}  # the content is described
    with_chunks = [dataclasses.replace(e, chunks=("a" * 64,)) if e.kind == "file" else e
                   for e in entries]
    check_entries(with_chunks, 1024, "fs")
    for entry in entries:
        assert Entry.from_dict(entry.to_dict()) == entry
    assert entries[2].to_dict()["link"] == "a-first" and "link" not in entries[0].to_dict()


def _f(path: str, **kw: Any) -> Entry:
    return Entry(path, "file", 0o644, 1, 2, 3, size=5, chunks=("a" * 64,), **kw)


def test_check_entries_accepts_sound_hardlinks() -> None:
    check_entries([_f("a"), Entry("d", "dir"), _f("d/b", link="a"), _f("e", link="a")],
                  1024, "fs")


@pytest.mark.parametrize("entries,match", [
    ([_f("b", link="a"), _f("a")], "not an earlier file"),
    ([_f("b", link="a")], "not an earlier file"),
    ([_f("a", link="a")], "not an earlier file"),
    ([Entry("a", "dir"), _f("b", link="a")], "not an earlier file"),
    ([Entry("a", "symlink", 0o777, target="x"), _f("b", link="a")], "not an earlier file"),
    ([Entry("a", "fifo"), _f("b", link="a")], "not an earlier file"),
    ([_f("a"), _f("b", link="a"), _f("c", link="b")], "not itself a hardlink"),
    ([_f("a"), dataclasses.replace(_f("b", link="a"), size=6, chunks=("b" * 64,))], "differ"),
    ([_f("a"), dataclasses.replace(_f("b", link="a"), mode=0o4755)], "differ"),
    ([_f("a"), _f("b", link="a", xattrs=(("user.x", b"1"),))], "differ"),
    ([Entry("a", "dir"), Entry("b", "dir", link="a")], "has a link; only files"),
])
def test_check_entries_refuses_unsound_hardlinks(entries: list[Entry], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        check_entries(entries, 1024, "fs")


@pytest.mark.parametrize("link,match", [
    ("../a", "link of"), ("/a", "absolute"), ("", "link of"), (None, "link of"), (7, "link of"),
    ("f", "hardlink of itself"),
])
def test_malformed_links_are_rejected(link: object, match: str) -> None:
    data = {**_f("f").to_dict(), "link": link}
    with pytest.raises(ManifestError, match=match):
        Entry.from_dict(data)


@pytest.mark.parametrize("kind", ["dir", "symlink", "fifo", "whiteout"])
def test_only_files_have_links(kind: str) -> None:
    data = {**Entry("a", kind, target="x" if kind == "symlink" else None).to_dict(), "link": "b"}
    with pytest.raises(ManifestError, match=r"unexpected fields \['link'\]"):
        Entry.from_dict(data)


# -- extended attributes --------------------------------------------------------------

def test_scan_captures_xattrs_of_every_kind(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "trusted.* and security.capability need root"
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_bytes(b"x")
    os.symlink("f", tmp_path / "l")
    os.mkfifo(tmp_path / "p")
    os.setxattr(tmp_path / "f", "user.b", b"2")
    os.setxattr(tmp_path / "f", "user.a", b"")
    os.setxattr(tmp_path / "f", "security.capability", CAP_NET_RAW)
    os.setxattr(tmp_path / "f", "trusted.mine", b"\x00\xff")
    os.setxattr(tmp_path / "d", "user.dir", b"d")
    os.setxattr(tmp_path / "l", "trusted.link", b"l", follow_symlinks=False)
    os.setxattr(tmp_path / "p", "trusted.fifo", b"p")
    entries = {e.path: e for e in scan_tree(tmp_path)}
    assert entries["f"].xattrs == (("security.capability", CAP_NET_RAW),
                                   ("trusted.mine", b"\x00\xff"), ("user.a", b""),
                                   ("user.b", b"2"))
    assert entries["d"].xattrs == (("user.dir", b"d"),)
    assert entries["l"].xattrs == (("trusted.link", b"l"),)
    assert entries["p"].xattrs == (("trusted.fifo", b"p"),)
    assert entries["f"].to_dict()["xattrs"] == {
        "security.capability": base64.b64encode(CAP_NET_RAW).decode(), "trusted.mine": "AP8=",
        "user.a": "", "user.b": "Mg=="}
    for entry in entries.values():
        assert Entry.from_dict(entry.to_dict()) == entry
    check_entries([dataclasses.replace(e, chunks=("a" * 64,)) if e.kind == "file" else e
                   for e in entries.values()], 1024, "fs")


def test_scan_leaves_overlay_markers_out_of_xattrs(tmp_path: Path) -> None:
    (tmp_path / "opaque").mkdir()
    os.setxattr(tmp_path / "opaque", "trusted.overlay.opaque", b"y")
    os.setxattr(tmp_path / "opaque", "trusted.overlay.origin", b"\x00")
    os.setxattr(tmp_path / "opaque", "user.overlay.opaque", b"y")
    (tmp_path / "copied-up").write_bytes(b"x")
    os.setxattr(tmp_path / "copied-up", "trusted.overlay.origin", b"\x00")
    os.setxattr(tmp_path / "copied-up", "user.kept", b"1")
    entries = {e.path: e for e in scan_tree(tmp_path)}
    assert entries["opaque"].opaque and entries["opaque"].xattrs == ()
    assert "xattrs" not in entries["opaque"].to_dict()
    assert entries["copied-up"].xattrs == (("user.kept", b"1"),)


def test_entries_without_xattrs_serialize_as_before() -> None:
    old = {"path": "f", "kind": "file", "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 1,
           "size": 0, "chunks": []}
    entry = Entry.from_dict(old)
    assert entry.xattrs == () and entry.link is None
    assert entry.to_dict() == old


@pytest.mark.parametrize("name,captured", [
    ("user.x", True), ("trusted.x", True), ("security.capability", True), ("security.ima", True),
    ("trusted.overlay.opaque", False), ("trusted.overlay.origin", False),
    ("user.overlay.opaque", False), ("security.selinux", False), ("security.SMACK64", False),
    ("security.apparmor", False), ("system.posix_acl_access", False), ("user", False),
])
def test_captured_xattr_names(name: str, captured: bool) -> None:
    assert is_captured_xattr(name) is captured


def _with_xattrs(xattrs: object) -> dict[str, Any]:
    return {**_f("f").to_dict(), "xattrs": xattrs}


@pytest.mark.parametrize("xattrs,match", [
    ({}, "not a non-empty object"),
    ([["user.a", ""]], "not a non-empty object"),
    ({"user.a": 1}, "not base64"),
    ({"user.a": "not base64!"}, "not valid base64"),
    ({"user.a": "YQ"}, "not valid base64"),  # padding missing
    ({"user.a": "YR=="}, "not canonical base64"),  # "a" with stray bits
    ({"user.a": "\u00e9"}, "not valid base64"),
    ({"user.a": "A" * (4 * (MAX_XATTR_VALUE // 3 + 2))}, "at most"),
    ({"user.a": base64.b64encode(bytes(MAX_XATTR_VALUE + 1)).decode()}, "at most"),
    ({f"user.{i}": base64.b64encode(bytes(MAX_XATTR_VALUE)).decode() for i in range(4)},
     "more than"),
    ({"user.": ""}, "invalid extended attribute name"),
    ({"user.a b": ""}, "invalid extended attribute name"),
    ({"user.\u00e9": ""}, "invalid extended attribute name"),
    ({"user.a\x00": ""}, "invalid extended attribute name"),
    ({"user." + "x" * 251: ""}, "invalid extended attribute name"),
    ({"system.posix_acl_access": ""}, "invalid extended attribute name"),
    ({"trusted.overlay.opaque": "eQ=="}, "never captured"),
    ({"user.overlay.whiteout": ""}, "never captured"),
    ({"security.selinux": ""}, "never captured"),
])
def test_malformed_xattrs_are_rejected(xattrs: object, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        Entry.from_dict(_with_xattrs(xattrs))


def test_xattr_limits_are_inclusive() -> None:
    value = base64.b64encode(bytes(MAX_XATTR_VALUE)).decode()
    entry = Entry.from_dict(_with_xattrs({"user.a": value, "user." + "x" * 250: ""}))
    assert entry.xattrs[0] == ("user.a", bytes(MAX_XATTR_VALUE))
    assert Entry.from_dict(entry.to_dict()) == entry


def test_whiteouts_have_no_xattrs() -> None:
    with pytest.raises(ManifestError, match=r"unexpected fields \['xattrs'\]"):
        Entry.from_dict({"path": "a", "kind": "whiteout", "xattrs": {"user.a": ""}})


def test_check_entries_checks_xattrs_of_built_entries() -> None:
    with pytest.raises(ManifestError, match="never captured"):
        check_entries([Entry("d", "dir", xattrs=(("trusted.overlay.opaque", b"y"),))], 1024, "fs")
    with pytest.raises(ManifestError, match="sorted and unique"):
        check_entries([Entry("d", "dir", xattrs=(("user.b", b""), ("user.a", b"")))], 1024, "fs")


def test_scan_refuses_xattrs_a_manifest_cannot_carry(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    os.setxattr(tmp_path / "f", "user.with space", b"1")
    with pytest.raises(CheckpointFailed, match="invalid extended attribute name"):
        scan_tree(tmp_path)
