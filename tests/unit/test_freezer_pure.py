"""How the freezer ends a frozen tree on each cgroup version (files of a fake cgroup)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermit_node.host import freezer


def test_v2_ends_the_tree_with_cgroup_kill_then_thaws(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cgroup.freeze").write_text("1")
    (tmp_path / "cgroup.kill").write_text("")
    (tmp_path / "cgroup.procs").write_text("101\n102\n")
    (tmp_path / "child").mkdir()
    (tmp_path / "child" / "cgroup.procs").write_text("103\n")
    signalled: list[int] = []
    monkeypatch.setattr(freezer.os, "kill", lambda pid, sig: signalled.append(pid))
    assert freezer.end_frozen(tmp_path, 101) == 3
    assert (tmp_path / "cgroup.kill").read_text() == "1"
    assert (tmp_path / "cgroup.freeze").read_text() == "0"
    assert signalled == [], "the kernel kills the subtree; no pid is signalled one by one"


def test_v1_signals_every_process_then_thaws(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "freezer.state").write_text("FROZEN\n")
    (tmp_path / "cgroup.procs").write_text("101\n102\n")
    signalled: list[int] = []
    monkeypatch.setattr(freezer.os, "kill", lambda pid, sig: signalled.append(pid))
    assert freezer.end_frozen(tmp_path, 101) == 3
    assert signalled == [101, 102, 101]
    assert (tmp_path / "freezer.state").read_text() == "THAWED"
