"""The local staging area: room before a checkpoint, clean-up at start and after failures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hermit_common.errors import CheckpointFailed
from hermit_node.engine import staging


def test_check_room_names_the_path_and_the_bytes() -> None:
    staging.check_room(Path("/w"), [("images", 100)], free=200, reserve=100)
    with pytest.raises(CheckpointFailed) as info:
        staging.check_room(Path("/var/lib/hermit"), [("the memory images", 300),
                                                     ("a copy of the workspace", 50)],
                           free=400, reserve=64)
    message = str(info.value)
    assert "/var/lib/hermit" in message
    assert "300 bytes for the memory images + 50 bytes for a copy of the workspace" in message
    assert "414 bytes needed, 400 bytes free" in message


def test_tree_bytes_counts_regular_files_and_hardlinks_once(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"x" * 1000)
    os.link(tmp_path / "d" / "a", tmp_path / "b")
    (tmp_path / "c").write_bytes(b"y" * 24)
    os.symlink("a", tmp_path / "d" / "link")
    assert staging.tree_bytes(tmp_path) == 1024
    assert staging.tree_bytes(tmp_path / "missing") == 0


def test_memory_bytes_v2_then_v1(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    v1.mkdir()
    (v1 / "memory.usage_in_bytes").write_text("4096\n")
    assert staging.memory_bytes([v2, v1]) == 4096
    (v2 / "memory.current").write_text("8192\n")
    assert staging.memory_bytes([v2, v1]) == 8192
    assert staging.memory_bytes([]) == 0


def test_check_checkpoint_room_on_a_real_filesystem(tmp_path: Path) -> None:
    tree = tmp_path / "ws"
    tree.mkdir()
    (tree / "f").write_bytes(b"z" * 10)
    staging.check_checkpoint_room(tmp_path / "work", cgroup_dirs=[],
                                  trees=[("the workspace", tree)])
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.current").write_text(str(1 << 60))  # more than any disk
    with pytest.raises(CheckpointFailed, match=r"not enough free space in .*work"):
        staging.check_checkpoint_room(tmp_path / "work", cgroup_dirs=[cg], trees=[])
    # A stopping checkpoint tries anyway: without it the sandbox is lost.
    staging.check_checkpoint_room(tmp_path / "work", cgroup_dirs=[cg], trees=[], strict=False)


def test_clean_removes_what_earlier_runs_left(tmp_path: Path) -> None:
    (tmp_path / "checkpoints" / "ns" / "box" / "c1" / "criu").mkdir(parents=True)
    (tmp_path / "restores" / "ns").mkdir(parents=True)
    (tmp_path / "restores" / "stray.log").write_text("x")
    (tmp_path / "keys").mkdir()  # not a staging dir: untouched
    removed = staging.clean(tmp_path)
    assert len(removed) == 3
    assert list((tmp_path / "checkpoints").iterdir()) == []
    assert list((tmp_path / "restores").iterdir()) == []
    assert (tmp_path / "keys").is_dir()
    assert staging.clean(tmp_path / "nothing-here") == []


def test_discard_keeps_only_the_log(tmp_path: Path) -> None:
    local = tmp_path / "restores" / "ns" / "box" / "c1"
    (local / "criu").mkdir(parents=True)
    (local / "criu" / "pages-1.img").write_bytes(b"p" * 100)
    (local / "criu" / "restore.log").write_text("Error (criu/cr-restore.c): boom\n")
    staging.discard(local, local / "criu" / "restore.log")
    assert not local.exists()
    assert (local.parent / "c1.restore.log").read_text().startswith("Error")
    staging.discard(local, local / "criu" / "restore.log")  # nothing there: no error
