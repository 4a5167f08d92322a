"""The checkpoint engine tells its caller how a checkpoint goes through one small interface
(``CheckpointProgress``), in order: captured while the tree is still frozen, uploading
once captured (a routine checkpoint's tree thawed first), progressed per chunk, durable
once the manifest is stored and, for a stopping checkpoint, before its tree is ended
(durable must mean kept)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hermit_common.store import UploadProgress
from hermit_node.engine import checkpoint as engine
from hermit_node.engine.checkpoint import (
    NO_PROGRESS,
    CheckpointEngine,
    CheckpointResult,
    CheckpointTarget,
)
from hermit_node.host import freezer, pagemap
from tests.support.node_agent import RESULT

STEP = UploadProgress(1, 2, 10, 20, 0)


class Told:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def captured(self) -> None:
        self.events.append("told captured")

    def uploading(self, frozen_ms: int, dump_ms: int) -> None:
        self.events.append(f"uploading {dump_ms}")

    def progressed(self, progress: UploadProgress) -> None:
        self.events.append(f"progressed {progress.chunks_done}")

    def durable(self, result: CheckpointResult) -> None:
        self.events.append(f"durable {result.manifest_uri}")


class Session:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def finish(self, sections: Any, restore: Any, *, on_progress: Any, layouts: Any) -> Any:
        on_progress(STEP)
        self.events.append("manifest stored")
        return SimpleNamespace(image_bytes=1, uploaded_bytes=1, stored_bytes=1,
                               manifest_uri="s3://b/m", chunks_staged=0)


def _run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, stop: bool,
         progress: Any) -> list[str]:
    events: list[str] = []
    monkeypatch.setattr(CheckpointEngine, "_capture",
                        lambda self, plan, cap, routine: events.append("captured"))
    monkeypatch.setattr(freezer, "thaw", lambda cgroup: events.append("thawed"))
    monkeypatch.setattr(freezer, "end_frozen",
                        lambda cgroup, pid: events.append("tree ended"))
    monkeypatch.setattr(pagemap, "image_layout", lambda path, size: {})
    monkeypatch.setattr(engine, "_result", lambda plan, cap, uploaded, **kw: dataclasses.replace(
        RESULT, manifest_uri=uploaded.manifest_uri))
    plan = SimpleNamespace(cgroup=tmp_path, restore={}, store=SimpleNamespace(
        settings=SimpleNamespace(chunk_size_bytes=4096)))
    cap = engine._Capture(frozen_at=time.monotonic(), dump_ms=7,
                          sections={engine.SECTION_IMAGES: tmp_path})
    cap.session = Session(events)  # type: ignore[assignment]
    target = CheckpointTarget(namespace="ns", sandbox="sb", sandbox_uid="u",
                              checkpoint="c1", init_pid=42)
    eng = CheckpointEngine(None, None, tmp_path)  # type: ignore[arg-type]
    eng._capture_and_upload(target, plan, cap, stop=stop, deadline=None,  # type: ignore[arg-type]
                            progress=progress if progress is not None else Told(events))
    return events


def test_a_routine_checkpoint_reports_after_its_thaw_and_keeps_its_tree(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _run(monkeypatch, tmp_path, stop=False, progress=None) == [
        "captured", "told captured", "thawed", "uploading 7", "progressed 1", "manifest stored",
        "durable s3://b/m"]


def test_a_stopping_checkpoint_is_durable_before_its_tree_is_ended(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _run(monkeypatch, tmp_path, stop=True, progress=None) == [
        "captured", "told captured", "uploading 7", "progressed 1", "manifest stored",
        "durable s3://b/m", "tree ended"]


def test_no_progress_is_told_nothing_and_the_checkpoint_goes_on(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _run(monkeypatch, tmp_path, stop=True, progress=NO_PROGRESS) == [
        "captured", "manifest stored", "tree ended"]
