"""The node's upload limiter (hermit_common.bandwidth) on real uploads to a real MinIO:
two checkpoints uploading at once stay within the limit and share it; an urgent upload
started during a routine one has the bandwidth to itself and ends well before it."""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hermit_common.bandwidth import ROUTINE, URGENT, UploadLimiter
from hermit_common.manifest import Binding
from hermit_common.store import CheckpointStore, UploadProgress, UploadResult
from tests.support.minio import MinioServer
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

MIB = 1024 * 1024
LIMIT = 8 * MIB  # bytes per second
SIZE = 24 * MIB  # incompressible bytes per checkpoint
CHUNK = MIB
CONCURRENCY = 4
NS = "team-bw"


@pytest.fixture
def store(minio_server: MinioServer, request: pytest.FixtureRequest) -> CheckpointStore:
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    s = CheckpointStore(minio_server.settings(f"bw-{name}-{os.getpid()}",
                                              chunk_size_bytes=CHUNK,
                                              transfer_concurrency=CONCURRENCY))
    s.ensure_bucket()
    return s


def _tree(root: Path) -> dict[str, Path]:
    (root / "criu").mkdir(parents=True)
    (root / "criu" / "pages-1.img").write_bytes(os.urandom(SIZE))
    return {"criu": root / "criu"}


@dataclass
class Run:
    """One upload on its own thread: when it ended, what it stored, its progress."""

    sandbox: str
    sections: dict[str, Path]
    result: UploadResult | None = None
    error: BaseException | None = None
    ended: float = 0.0
    uploaded: int = 0  # compressed bytes PUT so far (its progress reports)
    progressed: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def on_progress(self, progress: UploadProgress) -> None:
        self.uploaded = progress.uploaded_bytes
        if progress.chunks_done >= 4:
            self.progressed.set()


def _start(store: CheckpointStore, limiter: UploadLimiter, klass: str, run: Run) -> None:
    binding = Binding(namespace=NS, sandbox=run.sandbox, sandbox_uid=f"{run.sandbox}-uid",
                      checkpoint=f"{run.sandbox}-c1", criu_version="4.2.1", kernel="6.18.0",
                      cpu_flags=("sse4_2",), image_digest=None)

    def upload() -> None:
        try:
            with limiter.upload(klass) as ticket:
                run.result = store.upload(binding, run.sections, {}, pace=ticket.acquire,
                                          on_progress=run.on_progress)
        except BaseException as exc:  # reported by _join
            run.error = exc
        finally:
            run.ended = time.monotonic()

    run.thread = threading.Thread(target=upload, name=f"upload-{run.sandbox}", daemon=True)
    run.thread.start()


def _join(*runs: Run, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for run in runs:
        assert run.thread is not None
        run.thread.join(max(0.0, deadline - time.monotonic()))
        assert not run.thread.is_alive(), f"upload of {run.sandbox} still running"
        if run.error is not None:
            raise run.error
        assert run.result is not None


def test_two_uploads_share_the_limit(store: CheckpointStore, tmp_path: Path) -> None:
    limiter = UploadLimiter(LIMIT)
    a, b = Run("box-a", _tree(tmp_path / "a")), Run("box-b", _tree(tmp_path / "b"))
    began = time.monotonic()
    _start(store, limiter, ROUTINE, a)
    _start(store, limiter, ROUTINE, b)
    _join(a, b)
    assert a.result is not None and b.result is not None
    elapsed = max(a.ended, b.ended) - began
    sent = a.result.uploaded_bytes + b.result.uploaded_bytes
    throughput = sent / elapsed
    print(f"\ntwo routine uploads: {sent / MIB:.1f} MiB in {elapsed:.2f} s = "
          f"{throughput / MIB:.2f} MiB/s (limit {LIMIT / MIB:.0f} MiB/s); ended "
          f"{a.ended - began:.2f} s and {b.ended - began:.2f} s")
    assert sent >= 2 * SIZE  # incompressible: every byte went
    assert throughput <= LIMIT * 1.1
    assert throughput >= LIMIT * 0.75  # the limit, not something slower, set the pace
    # Turns go round: they end together, not one after the other.
    assert abs(a.ended - b.ended) <= 0.15 * elapsed


def test_an_urgent_upload_goes_ahead_of_a_routine_one(store: CheckpointStore,
                                                       tmp_path: Path) -> None:
    limiter = UploadLimiter(LIMIT)
    routine, urgent = Run("box-r", _tree(tmp_path / "r")), Run("box-u", _tree(tmp_path / "u"))
    began = time.monotonic()
    _start(store, limiter, ROUTINE, routine)
    assert routine.progressed.wait(60.0), "the routine upload did not get going"
    urgent_began = time.monotonic()
    routine_at_urgent_start = routine.uploaded
    _start(store, limiter, URGENT, urgent)
    wait_until("the urgent upload to end", 60.0, lambda: urgent.ended > 0, 0.01)
    routine_during_urgent = routine.uploaded - routine_at_urgent_start
    _join(urgent, routine)
    assert urgent.result is not None and routine.result is not None
    urgent_seconds = urgent.ended - urgent_began
    print(f"\nurgent upload: {urgent.result.uploaded_bytes / MIB:.1f} MiB in "
          f"{urgent_seconds:.2f} s ({urgent.result.uploaded_bytes / urgent_seconds / MIB:.2f} "
          f"MiB/s), ended {urgent.ended - began:.2f} s; routine one ended "
          f"{routine.ended - began:.2f} s, had sent {routine_at_urgent_start / MIB:.1f} MiB "
          f"when it began and {routine_during_urgent / MIB:.1f} MiB while it ran")
    # The urgent upload had the whole limit: about SIZE / LIMIT seconds.
    assert urgent_seconds <= SIZE / LIMIT * 1.35
    # The routine one only finished the chunks it was already sending (CONCURRENCY
    # threads, the progress one chunk behind), then waited.
    assert routine_during_urgent <= (CONCURRENCY + 1) * (CHUNK + 4096)
    # And it ended well after: what it had left took its time once the urgent one was done.
    left = SIZE - routine_at_urgent_start - routine_during_urgent
    assert routine.ended - urgent.ended >= 0.7 * left / LIMIT
