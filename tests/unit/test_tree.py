"""scan_tree and Entry: overlay semantics, determinism, and path safety of untrusted input."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hermit_common.errors import CheckpointFailed
from hermit_common.tree import (
    Entry,
    ManifestError,
    check_entries,
    check_rel_path,
    scan_tree,
)


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
    assert entries["hosts.link"].kind == "file"  # hardlinks are separate files
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


def test_check_entries_refuses_duplicates_and_bad_chunk_counts() -> None:
    with pytest.raises(ManifestError, match="twice"):
        check_entries([Entry("a", "whiteout"), Entry("a", "whiteout")], 1024, "fs")
    with pytest.raises(ManifestError, match="expected 2"):
        check_entries([Entry("a", "file", size=1025, chunks=("a" * 64,))], 1024, "fs")
    check_entries([Entry("d", "dir"), Entry("d/a", "file", size=1024, chunks=("a" * 64,))],
                  1024, "fs")
