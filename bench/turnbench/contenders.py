"""The four checkpoint policies, all on the node-agent's own checkpoint engine.

- ``full-dump``: at every turn's end a full CRIU dump (the engine's freeze, dump and file
  capture), then the whole image set as one gzip tarball in one PUT (``FullDumpStore``:
  no chunks, no dedup) - the naive baseline;
- ``interval``: Hermit's pipeline (chunk dedup, zstd) every ``interval`` seconds, whatever
  the agent does;
- ``turn-aware``: at every turn's end the node-agent's inspector (``snapshot.take`` +
  ``inspector.decide``) says skip, files-only or full; a checkpoint is taken unless skip,
  and its baseline is the turn's end state with the counters read at the dump and after
  the thaw (``snapshot.take`` while frozen, ``snapshot.after_thaw``, ``inspector.settled``),
  as ``hermit_node.turns.turns`` does;
- ``off``: nothing.

Checkpoints run one at a time on a worker thread (as the node-agent's loop serves them),
while the agent goes on: the agent only waits when it execs into a frozen sandbox.
"""

from __future__ import annotations

import gzip
import queue
import shutil
import tarfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.turnbench.sandbox import WORKSPACE, Box
from hermit_common import protocol
from hermit_common.manifest import Manifest, Totals, utc_now
from hermit_common.store import (
    CheckpointStore,
    Layouts,
    ProgressCallback,
    UploadResult,
    UploadSession,
)
from hermit_node.engine import inspector, snapshot
from hermit_node.engine.checkpoint import (
    NO_PROGRESS,
    CheckpointEngine,
    CheckpointProgress,
    CheckpointResult,
    CheckpointTarget,
    NoProgress,
)
from hermit_node.engine.inspector import Snapshot

NAMESPACE = "bench"
CONTENDERS = ("full-dump", "interval", "turn-aware", "off")


class FullDumpStore(CheckpointStore):
    """The naive upload: every section in one gzip tarball, one PUT, nothing reused. The
    engine uploads through an ``UploadSession`` (``begin_upload``, then ``finish``), so
    this overrides what the session calls: nothing is staged while CRIU writes, and the
    finish is the tarball."""

    def _stage(self, session: UploadSession, path: str, offset: int, length: int) -> None:
        pass  # the naive upload starts once everything is written

    def _finish(self, session: UploadSession, sections: Mapping[str, Path],
                restore: Mapping[str, Any], on_progress: ProgressCallback | None,
                layouts: Layouts | None) -> UploadResult:
        started, binding = time.monotonic(), session.binding
        first = next(iter(sections.values()))
        tarball = first.parent / "full-dump.tar.gz"
        raw = 0
        with gzip.open(tarball, "wb", compresslevel=6) as gz, \
                tarfile.open(fileobj=gz, mode="w") as tar:
            for name, path in sections.items():
                tar.add(path, arcname=name)
                raw += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        key = f"{self.settings.prefix}/full-dump/{binding.sandbox}/{binding.checkpoint}.tar.gz"
        self.client.upload_file(str(tarball), self.settings.bucket, key)
        size = tarball.stat().st_size
        manifest = Manifest(binding=binding, created_at=utc_now(), chunk_size=1,
                            sections={}, restore=dict(restore),
                            totals=Totals(image_bytes=raw, stored_bytes=size))
        return UploadResult(
            manifest_uri=f"s3://{self.settings.bucket}/{key}", manifest_digest="",
            manifest=manifest, image_bytes=raw, uploaded_bytes=size, stored_bytes=size,
            chunks_total=1, chunks_uploaded=1, duration=time.monotonic() - started)


@dataclass
class Taken:
    """One checkpoint a policy took."""

    name: str
    reason: str  # turn-end, interval, notice
    turn: int  # the last turn that had ended when it froze the sandbox (-1: none)
    mid_turn: bool  # a turn was running when it froze the sandbox
    result: CheckpointResult | None = None
    durable_at: float = 0.0  # time.monotonic()
    error: str = ""


@dataclass
class Progress:
    """Where the agent is; read by the policies."""

    ended: int = -1  # the last turn that ended
    running: bool = False  # a turn's commands are running


class _Settled(NoProgress):
    """The processes read at the dump (tree still frozen), and once the tree runs again
    (its upload starts) how it settled since the checkpoint's snapshot ``settle``,
    appended to ``pending``."""

    def __init__(self, box: Box, settle: Snapshot, pending: list[Snapshot]) -> None:
        self._box, self._settle, self._pending = box, settle, pending
        self._at_dump: Snapshot | None = None

    def captured(self) -> None:
        self._at_dump = snapshot.at_dump(self._box.runtime_id)

    def uploading(self, frozen_ms: int, dump_ms: int) -> None:
        post = snapshot.after_thaw(self._box.runtime_id, WORKSPACE)
        assert self._at_dump is not None, "captured() comes before uploading()"
        self._pending.append(inspector.settled(self._settle, self._at_dump, post))


@dataclass
class Policy:
    """A checkpoint policy for one sandbox: ``turn_ended`` and its timer queue jobs."""

    name: str
    box: Box
    engine: CheckpointEngine
    uid: str
    store: CheckpointStore | None = None  # None: the engine's (Hermit's pipeline)
    interval: float = 0.0
    progress: Progress = field(default_factory=Progress)
    taken: list[Taken] = field(default_factory=list)
    decisions: list[inspector.Decision] = field(default_factory=list)
    _jobs: queue.Queue[Callable[[], None] | None] = field(default_factory=queue.Queue)
    _worker: threading.Thread | None = None
    _baseline: Snapshot | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def target(self, name: str) -> CheckpointTarget:
        return CheckpointTarget(namespace=NAMESPACE, sandbox=self.box_name, sandbox_uid=self.uid,
                                checkpoint=name, init_pid=self.box.container.init_pid,
                                image_digest=self.box.node.image_digest())

    @property
    def box_name(self) -> str:
        return f"{self.name}-{self.uid[:8]}"

    def start(self) -> None:
        self._worker = threading.Thread(target=self._serve, daemon=True, name="bench-ckpt")
        self._worker.start()
        if self.name == "interval":
            threading.Thread(target=self._tick, daemon=True, name="bench-interval").start()

    def _tick(self) -> None:
        """A routine checkpoint every ``interval`` seconds, whatever the agent does."""
        while not self._stop.wait(self.interval):
            self._queue("interval")

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def drain(self) -> None:
        """Stop the interval timer, wait for every queued checkpoint, stop the worker."""
        self._stop.set()
        self._jobs.put(None)
        if self._worker is not None:
            self._worker.join()

    def _queue(self, reason: str, settle: Snapshot | None = None) -> None:
        taken = Taken(f"c{len(self.taken) + 1}-{reason}", reason, self.progress.ended,
                      self.progress.running)
        self.taken.append(taken)
        self._jobs.put(lambda: self._take(taken, settle))

    def _take(self, taken: Taken, settle: Snapshot | None) -> None:
        taken.turn, taken.mid_turn = self.progress.ended, self.progress.running
        pending: list[Snapshot] = []
        progress: CheckpointProgress = NO_PROGRESS
        if settle is not None:
            progress = _Settled(self.box, settle, pending)
        try:
            taken.result = self.engine.checkpoint(self.target(taken.name), store=self.store,
                                                  progress=progress)
            taken.durable_at = time.monotonic()
            if pending:
                self._baseline = pending[0]
        except Exception as exc:  # recorded and shown: the run goes on
            taken.error = str(exc)

    def turn_ended(self) -> None:
        """Called right after a turn's last command returned."""
        if self.name == "full-dump":
            self._queue("turn")
        elif self.name == "turn-aware":
            after = snapshot.take(self.box.runtime_id, WORKSPACE)
            decision = inspector.decide(self._baseline, after)
            self.decisions.append(decision)
            if decision.decision != protocol.TURN_SKIP:
                self._queue("turn", settle=after)

    def latest_durable(self, now: float) -> Taken | None:
        """The newest checkpoint durable at ``now`` (what a crash then would restore)."""
        done = [t for t in self.taken if t.result is not None and t.durable_at <= now]
        return max(done, key=lambda t: t.durable_at) if done else None


def make_policy(name: str, box: Box, engine: CheckpointEngine, uid: str,
                naive_store: CheckpointStore, interval: float) -> Policy:
    return Policy(name, box, engine, uid,
                  store=naive_store if name == "full-dump" else None, interval=interval)


def remove_local(engine: CheckpointEngine, policy: Policy) -> None:
    shutil.rmtree(engine.local_dir(policy.target("x")).parent, ignore_errors=True)
