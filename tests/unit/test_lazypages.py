"""Lazy restore without CRIU: the node check, the fallback, and a failed daemon's tree."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hermit_common.pin import Pin
from hermit_common.store import CheckpointStore, Deferred
from hermit_node.engine import lazypages, pagesource, restore
from hermit_node.engine.restore import RestoreEngine, RestoreTarget
from hermit_node.host.criu import Criu, CriuError


def fake_criu(tmp_path: Path, script: str) -> str:
    """An executable standing in for criu: ``script`` is its shell body."""
    path = tmp_path / "criu"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


def test_uffd_is_available_when_criu_check_passes(tmp_path: Path) -> None:
    assert lazypages.unavailable(fake_criu(tmp_path, 'echo "uffd-noncoop is supported"')) is None


def test_uffd_unavailable_names_criu_s_answer(tmp_path: Path) -> None:
    criu = fake_criu(tmp_path, 'echo "UFFD is not supported"; exit 1')
    assert lazypages.unavailable(criu) == \
        "criu check --feature uffd-noncoop: UFFD is not supported"
    assert "cannot run" in str(lazypages.unavailable(str(tmp_path / "missing")))


def test_a_node_without_uffd_restores_fully(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    criu = Criu(fake_criu(tmp_path, "exit 1"))
    store: CheckpointStore = object()  # type: ignore[assignment]
    assert RestoreEngine(criu, store, tmp_path, lazy=True).lazy is False
    assert "HERMIT_LAZY_RESTORE is on, but this node cannot restore lazily" in caplog.text
    assert RestoreEngine(Criu(fake_criu(tmp_path, "exit 0")), store, tmp_path,
                         lazy=True).lazy is True
    assert RestoreEngine(criu, store, tmp_path).lazy is False


def test_a_daemon_that_never_listens_fails_the_start(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    (images / lazypages.LOG_FILE).write_text("(00.01) Error (criu/uffd.c:1): uffd: no uffd\n")
    with pytest.raises(CriuError, match="did not start: uffd: no uffd"):
        lazypages.LazyPages.start(fake_criu(tmp_path, "exit 1"), images)


def _daemon(tmp_path: Path, script: str) -> lazypages.LazyPages:
    proc = subprocess.Popen(["sh", "-c", script])
    return lazypages.LazyPages(proc, tmp_path, time.monotonic())


def _watched(daemon: lazypages.LazyPages, tree: subprocess.Popen[bytes],
             timeout: float = 30.0) -> lazypages.Filled:
    ended: list[lazypages.Filled] = []
    finished = threading.Event()

    def done(filled: lazypages.Filled) -> None:
        ended.append(filled)
        finished.set()

    lazypages.watch(daemon, tree_root=lambda: tree.pid, timeout=timeout, done=done)
    assert finished.wait(30), "the watch never ended"
    return ended[0]


def test_a_daemon_that_fails_takes_the_tree_down(tmp_path: Path) -> None:
    tree = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        filled = _watched(_daemon(tmp_path, "exit 3"), tree)
        assert not filled.ok and "exit code 3" in filled.message
        assert tree.wait(timeout=10) == -9
    finally:
        tree.kill()


def test_a_daemon_past_its_deadline_is_stopped_and_takes_the_tree_down(tmp_path: Path) -> None:
    tree = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        filled = _watched(_daemon(tmp_path, "sleep 60"), tree, timeout=0.2)
        assert not filled.ok and "not every page was in" in filled.message
        assert tree.wait(timeout=10) == -9
    finally:
        tree.kill()


def test_a_daemon_that_finishes_leaves_the_tree_running(tmp_path: Path) -> None:
    tree = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        filled = _watched(_daemon(tmp_path, "exit 0"), tree)
        assert filled.ok
        assert tree.poll() is None
    finally:
        tree.kill()
        tree.wait()


def _streamed(tmp_path: Path, script: str) -> lazypages.Streamed:
    fetcher = threading.Thread(target=lambda: None)
    fetcher.start()
    deferred = Deferred(lambda *_: None, {}, 1)
    return lazypages.Streamed(_daemon(tmp_path, script), pagesource.Arrivals(), deferred,
                              fetcher, threading.Event())


@pytest.mark.parametrize(("script", "ok"), [("exit 0", True), ("exit 3", False)])
def test_on_filled_hears_when_the_fill_ends_after_the_staging_dir_is_gone(
        tmp_path: Path, script: str, ok: bool) -> None:
    """What a caller (the turn benchmark, a status report) waits on for "every page in"."""
    local = tmp_path / "staging"
    (local / "images").mkdir(parents=True)
    init = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    heard: list[tuple[lazypages.Filled, bool]] = []
    finished = threading.Event()

    def on_filled(filled: lazypages.Filled) -> None:
        heard.append((filled, local.exists()))
        finished.set()

    try:
        began = time.monotonic()
        target = RestoreTarget(pin=Pin("ns", "sb", "c", uid="u"), init_pid=init.pid)
        restore._fill_in_background(_streamed(tmp_path, script), target, local, on_filled)
        assert finished.wait(30), "on_filled was never called"
    finally:
        init.kill()
        init.wait()
    ((filled, staging_left),) = heard
    assert filled.ok is ok and not staging_left
    assert began <= filled.ended_at <= time.monotonic()
