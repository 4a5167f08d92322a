"""Running one checkpoint job: claim the Checkpoint (``Dumping``, with where it goes),
run the engine, report its progress into the Checkpoint's status (``_CheckpointReport``),
record Completed or Failed, then let the collector delete old checkpoints."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from hermit_common import protocol
from hermit_common.errors import CheckpointFailed, HermitError
from hermit_common.protocol import KubeObject
from hermit_common.store import UploadProgress
from hermit_node.control import metrics, planner
from hermit_node.control.kube import Kube, KubeConflict, KubeError, KubeTransient
from hermit_node.control.notices import Notices
from hermit_node.control.planner import CheckpointView, SandboxPod
from hermit_node.control.ports import (
    NO_CAPTURE_WATCH,
    AfterCheckpoint,
    CaptureWatch,
    Checkpointer,
    StoreResolver,
)
from hermit_node.control.storage import Location, StorageError
from hermit_node.control.writes import Writes
from hermit_node.engine.checkpoint import CheckpointProgress, CheckpointResult, CheckpointTarget
from hermit_node.host import locate

if TYPE_CHECKING:
    from hermit_common.store import CheckpointStore

log = logging.getLogger("hermit_node")

CLAIM_ATTEMPTS = 3  # claims of one Checkpoint per loop (each 409 re-reads it)


class _StatusWriter(Protocol):
    def __call__(self, namespace: str, name: str, status: KubeObject, *,
                 forever: bool = False) -> None: ...


class _CheckpointReport:
    """The ``CheckpointProgress`` of one checkpoint job: writes it into the Checkpoint's
    status. The ``CaptureWatch`` is told while the captured tree is still frozen. Uploading
    once the tree is captured, then ``progress`` as chunks are stored,
    throttled by ``planner.progress_due`` (about ten writes at most): progress is for
    people, a failed write is not retried and never reaches the upload. Completed once
    durable, retried until it lands (before a stopping checkpoint's tree is ended: durable
    must mean kept). The job's freezing slot is given up as soon as the sandbox no longer
    needs it: a routine checkpoint's once it is thawed, a stopping one's once durable."""

    def __init__(self, kube: Kube, namespace: str, name: str, *, stop: bool, began: float,
                 write_status: _StatusWriter, clock: Callable[[], datetime],
                 unfrozen: Callable[[], None], stop_durable: Callable[[], None],
                 captured: Callable[[], None] = lambda: None) -> None:
        self._kube, self._namespace, self._name = kube, namespace, name
        self._captured = captured  # CaptureWatch.captured of this checkpoint
        self._stop, self._began = stop, began
        self._write_status, self._clock = write_status, clock
        self._unfrozen = unfrozen  # Jobs.unfrozen: the job's freezing slot goes on
        self._stop_durable = stop_durable  # a stopping checkpoint is durable (metrics)
        self._mark = planner.ProgressMark(time.monotonic(), 0.0)
        self.recorded = threading.Event()  # durable and Completed

    def captured(self) -> None:
        try:
            self._captured()
        except Exception:  # anything: the checkpoint must go on
            log.exception("checkpoint %s/%s: telling its capture", self._namespace, self._name)

    def uploading(self, frozen_ms: int, dump_ms: int) -> None:
        self._write_status(self._namespace, self._name,
                           planner.status_uploading(frozen_ms, dump_ms))
        self._mark = planner.ProgressMark(time.monotonic(), 0.0)
        if not self._stop:
            # A routine checkpoint's sandbox runs again as it uploads: its upload needs
            # no freezing slot, so a notice's checkpoints go on.
            self._unfrozen()

    def progressed(self, progress: UploadProgress) -> None:
        fraction, now = planner.upload_fraction(progress), time.monotonic()
        if not planner.progress_due(self._mark, now, fraction):
            return
        self._mark = planner.ProgressMark(now, fraction)
        try:
            self._kube.patch_checkpoint_status(self._namespace, self._name,
                                               planner.status_progress(progress))
        except Exception as exc:  # anything: the upload must go on
            log.debug("upload progress of %s/%s not written: %s", self._namespace,
                      self._name, exc)

    def durable(self, result: CheckpointResult) -> None:
        # Before a migrating checkpoint kills the old tree: durable must mean kept.
        self._write_status(self._namespace, self._name,
                           planner.status_completed(result, self._clock(), stopped=self._stop,
                                                    seconds=time.monotonic() - self._began),
                           forever=True)
        self.recorded.set()
        if self._stop:
            self._stop_durable()
        # Durable and recorded: the engine ends a stopping checkpoint's tree right after
        # this; what is left (removing the staging directory) needs no freezing slot.
        self._unfrozen()


class Checkpointing:
    """Runs checkpoint jobs (``run``) for the node ``node``."""

    def __init__(self, node: str, kube: Kube, checkpointer: Checkpointer, *,
                 stores: StoreResolver | None, writes: Writes, notices: Notices,
                 collector: AfterCheckpoint, release: Callable[[str], None],
                 unfrozen: Callable[[], None], proc_root: Path,
                 clock: Callable[[], datetime],
                 routine_upload_seconds: float | None,
                 capture_watch: CaptureWatch = NO_CAPTURE_WATCH) -> None:
        self.node = node
        self._kube = kube
        self._checkpointer = checkpointer
        self._stores = stores  # None: the engine's own store (nothing in status.storage)
        self._writes = writes
        self._notices = notices
        self._collector = collector  # NoCollector: nothing is deleted from S3
        self._release = release  # Taken.release: not started, the next loop retries
        self._unfrozen = unfrozen  # Jobs.unfrozen
        self._proc_root = proc_root
        self._clock = clock
        self._routine_upload = routine_upload_seconds  # None: routine uploads unbounded
        self._capture_watch = capture_watch

    def run(self, ckpt: KubeObject, sp: SandboxPod) -> None:
        view = CheckpointView.from_object(ckpt)
        namespace, name, stop = view.namespace, view.name, view.stopping
        began = time.monotonic()
        started, store = self._begin_checkpoint(ckpt, sp)
        if not started:
            return
        log.info("checkpoint %s/%s of %s (%s, stop=%s) started%s", namespace, name, sp.pod,
                 view.reason, stop, self._notices.time_left())
        report = _CheckpointReport(
            self._kube, namespace, name, stop=stop, began=began,
            write_status=self._writes.write_status, clock=self._clock,
            unfrozen=self._unfrozen, stop_durable=self._notices.record_margin,
            captured=lambda: self._capture_watch.captured(sp, name, view.reason))
        try:
            result = self._take(ckpt, sp, stop, report, store)
        except Exception as exc:
            if report.recorded.is_set():  # durable and Completed: only what came after it failed
                log.exception("checkpoint %s/%s: after it was durable", namespace, name)
            else:
                self._checkpoint_failed(ckpt, exc, time.monotonic() - began)
            return
        metrics.record_checkpoint(
            reason=view.reason, frozen_ms=result.frozen_ms,
            dump_ms=result.dump_ms, capture_ms=result.capture_ms, upload_ms=result.upload_ms,
            total_seconds=time.monotonic() - began,
            image_bytes=result.image_bytes, uploaded_bytes=result.uploaded_bytes,
            stored_bytes=result.stored_bytes)
        log.info("checkpoint %s/%s Completed in %.1f s%s", namespace, name,
                 time.monotonic() - began, self._notices.time_left())
        if not stop and store is not None:
            self._collector.after_checkpoint(name, sp, store, self._notices.halted)

    def _begin_checkpoint(self, ckpt: KubeObject, sp: SandboxPod
                          ) -> tuple[bool, CheckpointStore | None]:
        """Decide where the checkpoint goes and record Dumping with that location. (False,
        None) when it did not start: an API hiccup (the next loop retries) or a storage
        that cannot be used (the checkpoint is Failed, with why, and the sandbox runs on)."""
        view = CheckpointView.from_object(ckpt)
        namespace, name = view.namespace, view.name
        try:
            store, location = self._store_for(sp)
        except KubeTransient as exc:
            log.warning("%s", exc)
            self._release(view.uid)
            return False, None
        except HermitError as exc:
            self._checkpoint_failed(ckpt, CheckpointFailed(
                f"checkpoint {namespace}/{name} failed, sandbox left running: {exc}"), 0.0)
            return False, None
        try:
            claimed = self._claim(ckpt, planner.status_dumping(
                self.node, self._clock(), sp.restore_from,
                location.to_status() if location is not None else None))
        except KubeError as exc:
            log.warning("%s", exc)
            claimed = False
        if not claimed:
            self._release(view.uid)
            return False, None
        return True, store

    def _claim(self, ckpt: KubeObject, status: KubeObject) -> bool:
        """Take a Pending Checkpoint with its first status write, only on the version read,
        so two node-agents never both take it. A 409 means it changed: read it again and
        claim that version while it is still Pending (the operator adopting it changes its
        metadata); False once someone else took it (or it is gone)."""
        view = CheckpointView.from_object(ckpt)
        namespace, name = view.namespace, view.name
        current: KubeObject | None = ckpt
        for _ in range(CLAIM_ATTEMPTS):
            if current is None or not planner.claimable(current):
                break
            try:
                self._kube.claim_checkpoint(
                    namespace, name, status,
                    CheckpointView.from_object(current).resource_version)
                return True
            except KubeConflict:
                current = self._kube.get_checkpoint(namespace, name)
        log.info("Checkpoint %s/%s was taken by someone else, or keeps changing: looking "
                 "at it again on the next loop", namespace, name)
        return False

    def _store_for(self, sp: SandboxPod) -> tuple[CheckpointStore | None, Location | None]:
        """The store of the sandbox's next checkpoint (its spec.checkpoint.storage, read
        now, or the default store) and where that is; (None, None) without ``stores``."""
        if self._stores is None:
            return None, None
        sandbox = self._kube.get_sandbox(sp.namespace, sp.sandbox)
        if sandbox is None:
            raise StorageError(f"AgentSandbox {sp.namespace}/{sp.sandbox} does not exist: "
                               "cannot tell where its checkpoints go")
        return self._stores.for_sandbox(sandbox)

    def _take(self, ckpt: KubeObject, sp: SandboxPod, stop: bool,
              report: CheckpointProgress,
              store: CheckpointStore | None) -> CheckpointResult:
        """Run the engine on the pod's container."""
        view = CheckpointView.from_object(ckpt)
        namespace, name = view.namespace, view.name
        if sp.container_id is None:
            raise HermitError(f"pod {sp.namespace}/{sp.pod} has no container id")
        pid = locate.find_init_pid(sp.container_id, self._proc_root)
        return self._checkpointer.checkpoint(CheckpointTarget(
            namespace=namespace, sandbox=sp.sandbox, sandbox_uid=sp.sandbox_uid,
            checkpoint=name, init_pid=pid, workspace_path=sp.workspace_path,
            image_digest=sp.image_digest, parent=sp.restore_from or ""), stop=stop,
            deadline=planner.upload_deadline(self._notices.deadline(), time.monotonic(),
                                             view.reason, self._routine_upload),
            progress=report, store=store, urgent=planner.upload_is_urgent(view.reason))

    def _checkpoint_failed(self, ckpt: KubeObject, exc: Exception, seconds: float) -> None:
        """Failed, with why, on the Checkpoint and in an Event (the sandbox runs on)."""
        view = CheckpointView.from_object(ckpt)
        namespace, name = view.namespace, view.name
        message = str(exc) if isinstance(exc, HermitError) else \
            f"unexpected {type(exc).__name__}: {exc}"
        if not isinstance(exc, HermitError):
            log.exception("checkpoint %s/%s", namespace, name)
        metrics.record_checkpoint_failure(seconds, reason=view.reason, exc=exc)
        log.error("checkpoint %s/%s failed: %s", namespace, name, protocol.one_line(message))
        self._writes.write_status(namespace, name,
                           planner.status_failed(message, self._clock(), self.node))
        self._writes.event(ckpt, protocol.one_line(message))
