"""The node-agent's main loop: notices, Checkpoint requests and restores on this node.

Four things run: the watcher thread (interruption notices from the cloud), the watches
that keep a local copy of this node's pods, the Checkpoints labelled with it and its
Node object (``informer.WatchedNode``), the reconcile loop (on every change of that
copy, and at least every ``reconcile_interval_seconds``: start what is due, from the
copy, with no API call) and a small pool of jobs (one per sandbox at a time) that
drive the checkpoint and restore engines. Decisions come from ``planner`` (pure); this
module only applies them. API errors are logged and retried on the next loop. SIGTERM
of the agent stops the loops, lets running jobs finish and does nothing else: no
taint, no checkpoint. ``hermit_node.main`` builds the agent and starts those threads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from hermit_common import api, protocol
from hermit_common.chunkcache import CacheTally
from hermit_common.errors import (
    CheckpointFailed,
    CheckpointRefused,
    HermitError,
    RestoreFailed,
    Retryable,
    retryable,
)
from hermit_common.health import Heartbeats, Verdict
from hermit_common.pin import Pin
from hermit_common.protocol import KubeObject
from hermit_common.s3errors import CheckpointNotFound
from hermit_common.store import UploadProgress
from hermit_node.control import background, metrics, planner, requests
from hermit_node.control import health as agent_health
from hermit_node.control.kube import Kube, KubeConflict, KubeError, KubeTransient
from hermit_node.control.planner import CheckpointView, SandboxPod
from hermit_node.control.storage import Location, StorageError
from hermit_node.control.watchers import Notice
from hermit_node.engine.checkpoint import (
    NO_PROGRESS,
    CheckpointProgress,
    CheckpointResult,
    CheckpointTarget,
)
from hermit_node.engine.restore import RestoreResult, RestoreTarget
from hermit_node.host import freezer, locate

if TYPE_CHECKING:
    from hermit_common.store import CheckpointStore

log = logging.getLogger("hermit_node")

_T = TypeVar("_T")

WORKERS = 4
# Checkpoints at once (each freezes its sandbox until captured, a stopping one until
# durable): see Jobs.
FREEZING = 2
STATUS_ATTEMPTS = 5
CLAIM_ATTEMPTS = 3  # claims of one Checkpoint per loop (each 409 re-reads it)
# How often the loop looks at a checkpoint in flight on another node that a pod here waits
# for: a restore starts at most this long after it is Completed.
REMOTE_POLL_SECONDS = 0.25
# While a pod waits for the operator to name it or to verify its checkpoint.
AUTHORITY_POLL_SECONDS = 1.0


class Checkpointer(Protocol):
    def checkpoint(self, target: CheckpointTarget, *, stop: bool = False,
                   keep_local: bool = False, deadline: float | None = None,
                   progress: CheckpointProgress = NO_PROGRESS,
                   store: CheckpointStore | None = None,
                   urgent: bool = False) -> CheckpointResult: ...


class Restorer(Protocol):
    lazy: bool  # restores leave the tree's pages to a lazy-pages daemon of this process

    def restore(self, target: RestoreTarget, *, timeout: float = 120.0,
                store: CheckpointStore | None = None) -> RestoreResult: ...


class StoreResolver(Protocol):
    """Which store a sandbox's next checkpoint goes to, and which one an existing
    checkpoint is read from (``storage.Stores``)."""

    def for_sandbox(self, sandbox: KubeObject) -> tuple[CheckpointStore, Location]: ...

    def for_checkpoint(self, ckpt: KubeObject,
                       owner: KubeObject | None) -> CheckpointStore: ...


class NodeView(Protocol):
    """This node's pods, the Checkpoints labelled with it and its Node object, as last
    seen (``informer.WatchedNode``); KubeError while they are not known yet."""

    def pods_now(self) -> list[KubeObject]: ...

    def checkpoints_now(self) -> list[KubeObject]: ...

    def node_now(self) -> KubeObject | None: ...

    def healthy(self) -> bool: ...


class TreeControl(Protocol):
    """Thaws or ends a container's frozen tree (the cgroup freezer)."""

    def settle(self, init_pid: int, *, kill: bool) -> bool: ...

    def restore_left(self, init_pid: int) -> str: ...

    def end(self, init_pid: int) -> int: ...


class NoTrees:
    """A ``TreeControl`` that finds nothing frozen and nothing restored (tests)."""

    def settle(self, init_pid: int, *, kill: bool) -> bool:
        return False

    def restore_left(self, init_pid: int) -> str:
        return freezer.NOTHING_RESTORED

    def end(self, init_pid: int) -> int:
        return 0


NO_TREES: TreeControl = NoTrees()


class Health(Protocol):
    """This agent's health (``health.AgentHealth``): the loop beats when the API answers,
    and the node is labelled once the agent is ready."""

    @property
    def beats(self) -> Heartbeats: ...

    def readiness(self) -> Verdict: ...


class NoHealth:
    """A ``Health`` that is never ready (no probes: the node is never labelled)."""

    def __init__(self) -> None:
        self.beats = Heartbeats()  # beaten, never read

    def readiness(self) -> Verdict:
        return Verdict(False, "the node-agent reports no health")


NO_HEALTH: Health = NoHealth()


class AfterCheckpoint(Protocol):
    """What runs after a routine checkpoint (``collect.Collector``: old ones deleted)."""

    def after_checkpoint(self, name: str, sp: SandboxPod, store: CheckpointStore,
                         halted: Callable[[], bool]) -> object: ...


class NoCollector:
    """An ``AfterCheckpoint`` that deletes nothing from the store."""

    def after_checkpoint(self, name: str, sp: SandboxPod, store: CheckpointStore,
                         halted: Callable[[], bool]) -> None:
        return None


NO_COLLECTOR: AfterCheckpoint = NoCollector()


class RestoreFence(Protocol):
    """Whether an older incarnation of a sandbox may still run (``fence.Fence``)."""

    def holds(self, sp: SandboxPod) -> bool: ...


class NoFence:
    """A ``RestoreFence`` that never holds a restore back (tests)."""

    def holds(self, sp: SandboxPod) -> bool:
        return False


NO_FENCE: RestoreFence = NoFence()


class UploadPromoter(Protocol):
    """The node's upload bandwidth (``bandwidth.UploadLimiter``), shared with the engine."""

    def promote(self, key: object) -> int: ...


class NoLimiter:
    """An ``UploadPromoter`` without a limiter: no upload waits, so none is promoted."""

    def promote(self, key: object) -> int:
        return 0


NO_LIMITER: UploadPromoter = NoLimiter()


def utc_now() -> datetime:
    return datetime.now(UTC)


class _StatusWriter(Protocol):
    def __call__(self, namespace: str, name: str, status: KubeObject, *,
                 forever: bool = False) -> None: ...


class _CheckpointReport:
    """The ``CheckpointProgress`` of one checkpoint job: writes it into the Checkpoint's
    status. Uploading once the tree is captured, then ``progress`` as chunks are stored,
    throttled by ``planner.progress_due`` (about ten writes at most): progress is for
    people, a failed write is not retried and never reaches the upload. Completed once
    durable, retried until it lands (before a stopping checkpoint's tree is ended: durable
    must mean kept). The job's freezing slot is given up as soon as the sandbox no longer
    needs it: a routine checkpoint's once it is thawed, a stopping one's once durable."""

    def __init__(self, kube: Kube, namespace: str, name: str, *, stop: bool, began: float,
                 write_status: _StatusWriter, clock: Callable[[], datetime],
                 unfrozen: Callable[[], None], stop_durable: Callable[[], None]) -> None:
        self._kube, self._namespace, self._name = kube, namespace, name
        self._stop, self._began = stop, began
        self._write_status, self._clock = write_status, clock
        self._unfrozen = unfrozen  # Jobs.unfrozen: the job's freezing slot goes on
        self._stop_durable = stop_durable  # a stopping checkpoint is durable (metrics)
        self._mark = planner.ProgressMark(time.monotonic(), 0.0)
        self.recorded = threading.Event()  # durable and Completed

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


# Job priorities, first served first: a stopping checkpoint (protocol.is_stopping: a
# notice, a drain or a Suspend), a restore (a sandbox waits for it), a routine checkpoint
# (it can wait), a prefetch (an optimisation: at most ``BACKGROUND`` run at once, so
# workers stay free). Not bandwidth.URGENT, which is the migrating reasons only.
PRIORITY_STOPPING, PRIORITY_RESTORE, PRIORITY_ROUTINE, PRIORITY_PREFETCH = 0, 1, 2, 3
BACKGROUND = 1


@dataclass(order=True)
class _Queued:
    priority: int
    seq: int  # first come, first served within a priority
    key: tuple[str, str] = field(compare=False)
    fn: Callable[[], None] = field(compare=False)
    freezes: bool = field(compare=False)


class Jobs:
    """A few worker threads that run at most one job per key (a sandbox) at a time, the
    queued job of the first priority first (``PRIORITY_STOPPING``, ``PRIORITY_RESTORE``,
    ``PRIORITY_ROUTINE``; in submission order within one), and at most ``freezing`` jobs
    that freeze a sandbox (checkpoints) at once.

    A job only freezes its sandbox once it runs, so a sandbox never stays frozen while it
    waits for a worker; and a stopping checkpoint keeps its sandbox frozen until durable, so
    fewer of them at once on a node of few cores makes each one durable, and its sandbox
    free, sooner (``FREEZING``) and makes no more durable by a notice's deadline with more
    of them sharing the node than with fewer. Routine work queued when a notice comes waits
    behind every stopping checkpoint.
    """

    def __init__(self, workers: int = WORKERS, freezing: int = FREEZING) -> None:
        self._freezing_limit = max(1, min(freezing, workers))
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._busy: set[tuple[str, str]] = set()
        self._freezing = 0
        self._background = 0  # prefetches running
        self._seq = 0
        self._closed = False
        self._local = threading.local()  # the job a worker thread runs
        self._threads = [threading.Thread(target=self._work, name=f"hermit-job-{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, key: tuple[str, str], fn: Callable[[], None], *,
               priority: int = PRIORITY_ROUTINE, freezes: bool = False) -> bool:
        """Queue ``fn`` unless a job for ``key`` is queued or runs; True when queued."""
        with self._cond:
            if key in self._busy or self._closed:
                return False
            self._busy.add(key)
            self._seq += 1
            self._queue.append(_Queued(priority, self._seq, key, fn, freezes))
            self._queue.sort()
            self._cond.notify()
        return True

    def _next(self) -> _Queued | None:
        """The most urgent queued job that may start now (under the condition's lock)."""
        for job in self._queue:
            if job.priority >= PRIORITY_PREFETCH and self._background >= BACKGROUND:
                continue
            if not job.freezes or self._freezing < self._freezing_limit:
                self._queue.remove(job)
                self._freezing += job.freezes
                self._background += job.priority >= PRIORITY_PREFETCH
                return job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                while (job := self._next()) is None:
                    if self._closed and not self._queue:
                        return
                    self._cond.wait()
            self._local.job = job
            try:
                job.fn()
            except Exception:  # a bug in a job must not take the agent down
                log.exception("job for %s/%s crashed", *job.key)
            finally:
                self._local.job = None
                with self._cond:
                    self._busy.discard(job.key)
                    self._freezing -= job.freezes
                    self._background -= job.priority >= PRIORITY_PREFETCH
                    self._cond.notify_all()

    def unfrozen(self) -> None:
        """Called by a job once its checkpoint is durable (its sandbox thawed, or about to
        be ended): its freezing slot goes to the next checkpoint while it cleans up (the
        removal of its staging directory took 3-5 s on a loaded node)."""
        job = getattr(self._local, "job", None)
        if job is None or not job.freezes:
            return
        with self._cond:
            job.freezes = False
            self._freezing -= 1
            self._cond.notify_all()

    def busy(self) -> set[tuple[str, str]]:
        with self._cond:
            return set(self._busy)

    def shutdown(self) -> None:
        """Run what is queued, then stop the workers; nothing is queued after this."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()


class NodeAgent:
    """Applies the planner's decisions for one node."""

    def __init__(self, node: str, kube: Kube, checkpointer: Checkpointer, restorer: Restorer,
                 *, view: NodeView,
                 stores: StoreResolver | None = None, trees: TreeControl = NO_TREES,
                 jobs: Jobs | None = None, proc_root: Path = Path("/proc"),
                 clock: Callable[[], datetime] = utc_now,
                 stopping: threading.Event | None = None,
                 health: Health = NO_HEALTH,
                 collector: AfterCheckpoint = NO_COLLECTOR, fence: RestoreFence = NO_FENCE,
                 routine_upload_seconds: float | None = None,
                 limiter: UploadPromoter = NO_LIMITER, prefetch: bool = False) -> None:
        self.node = node
        self._kube = kube
        self._view = view
        self._checkpointer = checkpointer
        self._restorer = restorer
        # None: the engines' own store for everything (no per-sandbox storage, nothing
        # recorded in status.storage, no recovery from the store after a restart).
        self._stores = stores
        self._trees = trees
        self._health = health
        self._collector = collector  # NoCollector: nothing is deleted from S3
        self._fence = fence  # NoFence: restores do not wait for older incarnations (tests)
        self._routine_upload = routine_upload_seconds  # None: routine uploads unbounded
        self._limiter = limiter  # the node's upload bandwidth, shared with the engine
        self._stopping = stopping or threading.Event()
        self._jobs = jobs or Jobs()
        self._proc_root = proc_root
        self._clock = clock
        self._notice: Notice | None = None
        # An advisory notice (rebalance recommendation) whose early checkpoints are not all
        # requested yet: set once per notice the watcher yields, cleared once they are.
        self._advised: Notice | None = None
        self._tainted = False
        self._recovered = False  # every checkpoint an earlier run left behind is decided
        self._settled = False  # frozen trees and cut-short restores were dealt with
        self._lock = threading.Lock()
        self._reconciling = threading.Lock()  # the watcher thread and the loop both reconcile
        # uids of the Checkpoints and pods this process took up: forgotten once the local
        # copy no longer shows them waiting (planner.awaiting) and no job runs for them.
        self._taken: set[str] = set()
        self._running: set[str] = set()
        # Prefetches (docs/storage.md#prefetch-and-the-chunk-cache), by pod uid: the event
        # that stops one. An entry stays while its pod waits, so each pod gets one.
        self._prefetch_on = prefetch and stores is not None
        self._prefetches: dict[str, threading.Event] = {}
        # A waiting pod's checkpoint is in flight on another node (its phase is read, not
        # watched): the loop looks again sooner (``next_wait``).
        self._remote_wait = False
        # Pods (uids) whose restore waits for the operator (planner.restore_authority).
        self._authority_waits: set[str] = set()
        # Pods (uids) being deleted under the termination hold, judged once: None when it
        # is held for its stopping checkpoint, else why not (``_hold``).
        self._held: dict[str, str | None] = {}
        # Pods (uids) an earlier run of the agent left Restoring: since when (monotonic).
        self._left_restoring: dict[str, float] = {}

    # -- notices --------------------------------------------------------------------

    def on_notice(self, notice: Notice) -> None:
        metrics.record_notice(notice.provider, notice.kind)
        left = notice.seconds_left(self._clock())
        if notice.asks_early_checkpoint:
            with self._lock:
                moot = self._notice is not None
                self._advised = None if moot else notice
            log.warning("advisory notice on %s (%s, %s): %s", self.node, notice.provider,
                        notice.kind, "nothing to do after the interruption notice" if moot
                        else "an early checkpoint of every sandbox, which keeps running")
            self.reconcile_once()
            return
        if not notice.is_interruption:
            log.info("advisory notice on %s (%s, %s): nothing to do", self.node,
                     notice.provider, notice.kind)
            return
        log.warning("interruption notice on %s: %s %s, %.0f s left", self.node,
                    notice.provider, notice.kind, left)
        with self._lock:
            if self._notice is None:
                self._notice = notice
        self.reconcile_once()

    def _taint_on_notice(self, node: KubeObject | None) -> None:
        """A cloud notice: taint and cordon the node, once, so nothing new lands there."""
        with self._lock:
            notice = self._notice
        if notice is not None and not self._tainted and node is not None:
            try:
                patch = planner.node_taint_patch(node, notice.kind)
                if patch is not None:
                    self._kube.patch_node(patch)
                self._tainted = True
                log.info("node %s tainted %s and cordoned", self.node, notice.kind)
            except KubeError as exc:
                log.warning("cannot taint node %s yet: %s", self.node, exc)

    def _request_stopping_checkpoints(self, node: KubeObject | None, pods: list[SandboxPod],
                                      checkpoints: list[KubeObject] | None
                                      ) -> list[KubeObject]:
        """A cloud notice or a drain of the node: make sure every sandbox on it has a
        stopping checkpoint request (Preemption or Eviction); neither: only the pods being
        deleted under the termination hold (Eviction). Returns the requests it made."""
        with self._lock:
            notice = self._notice
        reason = protocol.PREEMPTION if notice is not None else (
            planner.node_disruption(node) if node is not None else None)
        held = self._held_now()
        if reason is None:
            # Not a drain of the node: only pods being deleted under the termination hold.
            todo = planner.hold_requests(pods, held, checkpoints, self._clock())
            reason = protocol.EVICTION
        else:
            todo = planner.stop_requests(pods, reason, checkpoints, self._clock(), held)
        made = []
        for sp, tag in todo:
            try:
                # No operator round trip: the request is made here, and served at once.
                made.append(requests.create(self._kube, sp, reason, self.node, tag))
            except (KubeError, requests.NameTaken) as exc:
                log.warning("cannot request a %s checkpoint of %s/%s yet: %s", reason,
                            sp.namespace, sp.pod, exc)
                continue
            # Its job starts now, not once all the node's requests are made (thirty of
            # them took 3 s of a 120 s notice).
            self._serve(made[-1:], pods)
        return made

    def _early(self, pods: list[SandboxPod],
               checkpoints: list[KubeObject] | None) -> list[KubeObject]:
        """After a rebalance recommendation: an early routine (``Rebalance``) checkpoint
        request for every sandbox on the node (``planner.early_requests``), made once; the
        requests that could not be made are tried again on the next loop. Nothing once an
        interruption notice came: its stopping checkpoints do the work."""
        with self._lock:
            advised, notice = self._advised, self._notice
        if advised is None or checkpoints is None:
            return []
        made: list[KubeObject] = []
        done = notice is not None
        if not done:
            done = True
            for sp, tag in planner.early_requests(pods, checkpoints):
                try:
                    made.append(requests.create(self._kube, sp, protocol.REBALANCE,
                                                self.node, tag))
                except (KubeError, requests.NameTaken) as exc:
                    done = False
                    log.warning("cannot request a Rebalance checkpoint of %s/%s yet: %s",
                                sp.namespace, sp.pod, exc)
        if done:
            with self._lock:
                if self._advised is advised:
                    self._advised = None
        return made

    def _mark_ready(self, node: KubeObject | None) -> None:
        """Once this agent is ready (its /readyz), label its node with it
        (protocol.LABEL_NODE_AGENT): sandbox pods require the label. Written only while it
        is missing; an API error is logged and the next loop tries again. Never removed:
        a sandbox already on the node stays where it is when this agent stops being
        ready (docs/real-clusters.md, "Which nodes")."""
        if node is None or not self._health.readiness().ok:
            return
        patch = planner.node_ready_patch(node)
        if patch is None:
            return
        try:
            self._kube.patch_node(patch)
        except KubeError as exc:
            log.warning("cannot label node %s %s=%s yet: %s", self.node,
                        protocol.LABEL_NODE_AGENT, protocol.NODE_AGENT_READY, exc)
            return
        log.info("node %s labelled %s=%s", self.node, protocol.LABEL_NODE_AGENT,
                 protocol.NODE_AGENT_READY)

    # -- the termination hold (docs/protocol.md, "Evictions") ---------------------------

    def _held_now(self) -> frozenset[str]:
        with self._lock:
            return frozenset(uid for uid, why in self._held.items() if why is None)

    def _hold(self, pods: list[SandboxPod]) -> None:
        """Pods being deleted under the termination hold (their preStop hook sleeps while
        this agent saves them): each is judged once (``planner.hold_verdict``, one read of
        its AgentSandbox) and, when it needs it, held: ``_request_stopping_checkpoints`` asks
        for its Eviction checkpoint and ``_serve`` serves it although the pod is being deleted."""
        present = {sp.uid for sp in pods}
        with self._lock:
            self._held = {uid: why for uid, why in self._held.items() if uid in present}
            judged = set(self._held)
        for sp in pods:
            if sp.uid in judged or not planner.holds(sp):
                continue
            try:
                sandbox = self._kube.get_sandbox(sp.namespace, sp.sandbox)
            except KubeError as exc:
                log.warning("pod %s/%s is being deleted; its sandbox cannot be read yet: %s",
                            sp.namespace, sp.pod, exc)
                continue
            why = planner.hold_verdict(sp, sandbox)
            with self._lock:
                self._held[sp.uid] = why
            if why is None:
                log.warning("pod %s/%s is being deleted: its termination waits for its "
                            "stopping checkpoint", sp.namespace, sp.pod)
            else:
                log.info("pod %s/%s is being deleted: %s", sp.namespace, sp.pod, why)

    # -- the reconcile loop -------------------------------------------------------------

    def reconcile_once(self) -> None:
        """List, decide, start jobs. Never raises for API trouble: the next loop retries."""
        with self._reconciling:
            self._reconcile()

    def _reconcile(self) -> None:
        try:
            pods = planner.sandbox_pods(self._view.pods_now(), self.node)
        except KubeError as exc:
            log.warning("%s", exc)
            return
        if self._view.healthy():
            self._health.beats.beat(agent_health.API)
        node = self._read(self._view.node_now)
        checkpoints = self._read(self._view.checkpoints_now)
        if not self._recovered and checkpoints is not None:
            self._recovered = self._recover(checkpoints, pods)
        self._hold(pods)
        self._settle_restores(pods)
        self._taint_on_notice(node)
        made = [*self._request_stopping_checkpoints(node, pods, checkpoints),
                *self._early(pods, checkpoints)]
        self._mark_ready(node)
        if checkpoints is not None:
            self._forget_finished(checkpoints, pods)
            checkpoints = [*checkpoints, *made]
            self._serve(checkpoints, pods)
        known = self._with_sources(pods, checkpoints)
        self._prefetch(pods, known)
        for sp in planner.pods_to_restore(pods, known):
            self._stop_prefetch(sp.uid)
            self._start(sp.uid, sp.key, functools.partial(self.run_restore, sp),
                        priority=PRIORITY_RESTORE)

    def next_wait(self, interval: float) -> float:
        """How long the loop may wait for a change: less while a pod here waits for a
        checkpoint in flight on another node (its Completed is not watched from here)."""
        if self._remote_wait:
            return min(interval, REMOTE_POLL_SECONDS)
        with self._lock:
            waiting = bool(self._authority_waits)
        return min(interval, AUTHORITY_POLL_SECONDS) if waiting else interval

    def _with_sources(self, pods: list[SandboxPod], checkpoints: list[KubeObject] | None
                      ) -> list[KubeObject] | None:
        """``checkpoints`` and, read now, the Checkpoints that pods waiting for a restore
        name and this node's copy does not hold (a move's, labelled with the old node)."""
        if checkpoints is None:
            return None
        read: list[KubeObject] = []
        for namespace, name in planner.restore_sources_to_read(pods, checkpoints):
            ckpt = self._read(functools.partial(self._kube.get_checkpoint, namespace, name))
            if ckpt is not None:
                read.append(ckpt)
        self._remote_wait = any(CheckpointView.from_object(c).phase in protocol.IN_FLIGHT
                                for c in read)
        return [*checkpoints, *read]

    def _serve(self, checkpoints: list[KubeObject], pods: list[SandboxPod]) -> None:
        """Queue a job for each request to serve now (stopping ones first)."""
        for ckpt, sp in planner.checkpoints_to_serve(checkpoints, pods, self._held_now()):
            view = CheckpointView.from_object(ckpt)
            self._start(view.uid, sp.key, functools.partial(self.run_checkpoint, ckpt, sp),
                        priority=PRIORITY_STOPPING if view.stopping else PRIORITY_ROUTINE,
                        freezes=True)

    # -- prefetch ---------------------------------------------------------------------

    def _prefetch(self, pods: list[SandboxPod], known: list[KubeObject] | None) -> None:
        """A prefetch job (low priority) for each pod waiting for a checkpoint in flight,
        once per pod. A prefetch goes on while its pod still waits for its restore: the
        restore starts only once the pod runs, seconds after the checkpoint is durable, and
        a prefetch's first second can go to its credentials and manifest. It is stopped
        when the restore starts, the pod is gone, or a notice came here."""
        on = self._prefetch_on and not self._halted()
        waiting = {sp.uid: sp for sp in planner.pods_to_prefetch(pods, known)} if on else {}
        unrestored = {sp.uid for sp in pods if sp.restore_from and sp.restore_phase is None} \
            if on else set()
        with self._lock:
            for uid in [u for u in self._prefetches if u not in waiting.keys() | unrestored]:
                self._prefetches.pop(uid).set()
            new = [(sp, self._prefetches.setdefault(uid, threading.Event()))
                   for uid, sp in waiting.items() if uid not in self._prefetches]
        for sp, stop in new:
            self._jobs.submit((sp.namespace, f"{sp.pod}/prefetch"),
                              functools.partial(self.run_prefetch, sp, stop),
                              priority=PRIORITY_PREFETCH)

    def _stop_prefetch(self, uid: str) -> None:
        with self._lock:
            stop = self._prefetches.pop(uid, None)
        if stop is not None:
            stop.set()

    def run_prefetch(self, sp: SandboxPod, stop: threading.Event) -> None:
        """Fills the chunk cache from the sandbox's newest Completed checkpoint
        (``planner.prefetch_source``) while its pod waits; never fails anything."""
        if stop.is_set() or self._stores is None:
            return
        began, tally = time.monotonic(), CacheTally()
        try:
            source = planner.prefetch_source(
                self._kube.list_sandbox_checkpoints(sp.namespace, sp.sandbox), sp)
            owner = None if source is None else self._kube.get_sandbox(sp.namespace, sp.sandbox)
            if source is None or owner is None:
                log.info("prefetch for pod %s/%s: no earlier Completed checkpoint", sp.namespace,
                         sp.pod)
                return
            with background.lowest_priority():  # never at the cost of the node's real work
                self._stores.for_checkpoint(dict(source.ckpt), owner).prefetch(
                    source.pin.with_uid(sp.sandbox_uid), stop=stop, tally=tally)
            log.info("prefetched %d bytes of checkpoint %s/%s for pod %s in %.1f s%s",
                     tally.stored_bytes, sp.namespace, source.pin.checkpoint, sp.pod,
                     time.monotonic() - began, " (stopped)" if stop.is_set() else "")
        except Exception as exc:  # anything: a prefetch is only an optimisation
            log.warning("prefetch for pod %s/%s stopped: %s", sp.namespace, sp.pod, exc)
        finally:
            metrics.record_prefetch(tally.stored_bytes)

    @staticmethod
    def _read(read: Callable[[], _T]) -> _T | None:
        try:
            return read()
        except KubeError as exc:
            log.warning("%s", exc)
            return None

    def _forget_finished(self, checkpoints: list[KubeObject], pods: list[SandboxPod]) -> None:
        """Keep ``_taken`` bounded: a uid stays while its job runs or while the local copy
        still shows the object waiting (a status just written may not be seen yet)."""
        waiting = planner.awaiting(checkpoints, pods)
        with self._lock:
            self._taken = {uid for uid in self._taken if uid in waiting or uid in self._running}
            self._authority_waits &= waiting

    def _start(self, uid: str, key: tuple[str, str], fn: Callable[[], None], *,
               priority: int, freezes: bool = False) -> None:
        with self._lock:
            if uid in self._taken:
                return
            self._taken.add(uid)
            self._running.add(uid)

        def job() -> None:
            try:
                fn()
            finally:
                with self._lock:
                    self._running.discard(uid)

        if not self._jobs.submit(key, job, priority=priority, freezes=freezes):
            with self._lock:
                self._taken.discard(uid)  # busy with another job: next loop
                self._running.discard(uid)
            if priority == PRIORITY_STOPPING:
                # The job in the way (a routine checkpoint) now uploads as a notice's
                # does: this sandbox's stopping checkpoint waits for it.
                self._limiter.promote(key)

    def _release(self, uid: str) -> None:
        """Forget a job that did not get to write anything, so the next loop retries it."""
        with self._lock:
            self._taken.discard(uid)

    def _recover(self, checkpoints: list[KubeObject], pods: list[SandboxPod]) -> bool:
        """At start-up: finish what an earlier run of this agent left half done.

        A checkpoint whose manifest reached the store is Completed (durable means kept);
        one whose manifest did not is Failed. A tree left frozen is thawed, or ended
        when a stopping checkpoint of its incarnation is Completed. A restore cut short
        is Failed as retryable, so the operator tries again on a fresh pod. False when a
        checkpoint could not be decided (the store did not answer): the next loop retries.
        """
        stale = planner.stale_checkpoints(checkpoints, self.node, set())
        decided = all([self._finish_stale_checkpoint(ckpt) for ckpt in stale])
        if not self._settled:
            fresh = self._list_checkpoints_or(checkpoints) if stale else checkpoints
            for sp in pods:  # a pod being deleted may have been frozen under its hold
                if sp.container_live and sp.container_id:
                    self._settle_tree(sp, planner.completed_stop_of(fresh, sp))
            now = time.monotonic()
            self._left_restoring = {sp.uid: now for sp in planner.stale_restores(pods, set())}
            self._settled = True
        return decided

    def _settle_restores(self, pods: list[SandboxPod]) -> None:
        """Decide each restore an earlier run left Restoring (planner.cut_short_restore):
        its CRIU may have finished after that run died, and its tree then runs: adopted, it
        is the sandbox; never a second copy beside the fresh pod a Failed restore gets."""
        if not self._left_restoring:
            return
        for sp in pods:
            since = self._left_restoring.get(sp.uid)
            if since is None:
                continue
            if sp.restore_phase != protocol.RESTORING:
                self._left_restoring.pop(sp.uid)
                continue
            pid, left = self._restore_left(sp)
            action = planner.cut_short_restore(left, lazy=self._restorer.lazy,
                                               waited=time.monotonic() - since)
            if action is None:
                continue  # its CRIU is still at work: the next loop looks again
            self._left_restoring.pop(sp.uid)
            self._finish_cut_short(sp, pid, left, action)
        present = {sp.uid for sp in pods}
        for uid in [u for u in self._left_restoring if u not in present]:
            self._left_restoring.pop(uid)

    def _restore_left(self, sp: SandboxPod) -> tuple[int | None, str]:
        """The host pid of the init of a pod left Restoring (None: not found) and what its
        restore left there (``freezer.restore_left``)."""
        if sp.container_id is None:
            return None, freezer.NOTHING_RESTORED
        try:
            pid = locate.find_init_pid(sp.container_id, self._proc_root)
            return pid, self._trees.restore_left(pid)
        except (HermitError, OSError) as exc:
            log.warning("cannot tell what the restore of pod %s/%s left: %s", sp.namespace,
                        sp.pod, exc)
            return None, freezer.NOTHING_RESTORED

    def _finish_cut_short(self, sp: SandboxPod, pid: int | None, left: str,
                          action: str) -> None:
        if action == planner.ADOPT:
            log.warning("pod %s/%s: its restore finished after the node-agent restarted; "
                        "its tree runs: adopted", sp.namespace, sp.pod)
            self._annotate(sp, planner.restore_annotations(
                protocol.RESTORED, f"restored from Checkpoint {sp.restore_from} (the "
                "node-agent restarted after CRIU restored the tree; adopted)"))
            return
        if action == planner.END and pid:
            try:
                ended = self._trees.end(pid)
                log.warning("pod %s/%s: ended %d process(es) of a restore cut short (%s)",
                            sp.namespace, sp.pod, ended, left)
            except (HermitError, OSError) as exc:
                log.warning("cannot end the restore of pod %s/%s: %s", sp.namespace, sp.pod,
                            exc)
        self._annotate(sp, planner.restore_annotations(
            protocol.RESTORE_FAILED, "the node-agent restarted while restoring this pod",
            retryable=True))

    def _finish_stale_checkpoint(self, ckpt: KubeObject) -> bool:
        """Completed when its manifest is durable, else Failed; False when undecided."""
        view = CheckpointView.from_object(ckpt)
        namespace, name, sandbox = view.namespace, view.name, view.sandbox
        if self._stores is not None and sandbox:
            try:
                # Where it was being written (status.storage), with its sandbox's credentials.
                store = self._stores.for_checkpoint(
                    ckpt, self._kube.get_sandbox(namespace, sandbox))
                stored, digest = store.read_manifest(Pin(namespace, sandbox, name))
            except CheckpointNotFound:
                pass
            except HermitError as exc:
                # The store (or its Secret, or the API) cannot be reached: we cannot tell, so
                # leave it for a later loop rather than fail a checkpoint that may be durable.
                log.warning("cannot tell whether checkpoint %s/%s is durable: %s",
                            namespace, name, exc)
                return False
            else:
                log.warning("checkpoint %s/%s was durable before the agent restarted: "
                            "recording it Completed", namespace, name)
                self._write_status(namespace, name, planner.status_recovered(
                    stored.totals.to_dict(), store.manifest_uri(namespace, sandbox, name),
                    digest, stored.binding.to_dict(), self._clock()), forever=True)
                return True
        message = "the node-agent restarted while taking this checkpoint"
        self._write_status(namespace, name,
                           planner.status_failed(message, self._clock(), self.node))
        self._event(ckpt, message)
        return True

    def _list_checkpoints_or(self, fallback: list[KubeObject]) -> list[KubeObject]:
        """The node's Checkpoints read now: the local copy may not show the statuses just
        written yet."""
        try:
            return self._kube.list_node_checkpoints()
        except KubeError as exc:
            log.warning("%s", exc)
            return fallback

    def _settle_tree(self, sp: SandboxPod, completed_stop: str | None) -> None:
        """Thaw a tree an earlier run of the agent left frozen (or end it, when its
        stopping checkpoint is durable: its history continues elsewhere)."""
        if sp.container_id is None:
            return
        try:
            pid = locate.find_init_pid(sp.container_id, self._proc_root)
            if self._trees.settle(pid, kill=completed_stop is not None):
                log.warning("pod %s/%s was left frozen by an earlier run: %s", sp.namespace,
                            sp.pod, f"ended (checkpoint {completed_stop} is Completed)"
                            if completed_stop else "thawed")
        except (HermitError, OSError) as exc:
            log.warning("cannot check whether pod %s/%s is frozen: %s", sp.namespace, sp.pod,
                        exc)

    # -- checkpoint -------------------------------------------------------------------

    def run_checkpoint(self, ckpt: KubeObject, sp: SandboxPod) -> None:
        view = CheckpointView.from_object(ckpt)
        namespace, name, stop = view.namespace, view.name, view.stopping
        began = time.monotonic()
        started, store = self._begin_checkpoint(ckpt, sp)
        if not started:
            return
        log.info("checkpoint %s/%s of %s (%s, stop=%s) started%s", namespace, name, sp.pod,
                 view.reason, stop, self._time_left())
        report = _CheckpointReport(
            self._kube, namespace, name, stop=stop, began=began,
            write_status=self._write_status, clock=self._clock,
            unfrozen=self._jobs.unfrozen, stop_durable=self._record_notice_margin)
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
                 time.monotonic() - began, self._time_left())
        if not stop and store is not None:
            self._collector.after_checkpoint(name, sp, store, self._halted)

    def _halted(self) -> bool:
        """A notice came or the agent stops: background work gives way."""
        with self._lock:
            return self._notice is not None or self._stopping.is_set()

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
            deadline=planner.upload_deadline(self._deadline(), time.monotonic(),
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
        self._write_status(namespace, name,
                           planner.status_failed(message, self._clock(), self.node))
        self._event(ckpt, protocol.one_line(message))

    def _deadline(self) -> float | None:
        """The notice's deadline as a ``time.monotonic()`` value: uploads must end by then."""
        with self._lock:
            notice = self._notice
        if notice is None or notice.deadline is None:
            return None
        return time.monotonic() + notice.seconds_left(self._clock())

    def _record_notice_margin(self) -> None:
        """A stopping checkpoint is durable: how long before the notice's deadline."""
        with self._lock:
            notice = self._notice
        if notice is not None and notice.deadline is not None:
            metrics.record_notice_margin(str(notice.provider),
                                         notice.seconds_left(self._clock()))

    def _time_left(self) -> str:
        with self._lock:
            notice = self._notice
        if notice is None or notice.deadline is None:
            return ""
        return f"; {notice.seconds_left(self._clock()):.0f} s left before the node goes"

    def _write_status(self, namespace: str, name: str, status: KubeObject, *,
                      forever: bool = False) -> None:
        """Status writes matter (the operator waits on them): retry a few times, or with
        ``forever`` until it lands or the agent stops (a durable checkpoint's Completed)."""
        self._retry(f"the status of Checkpoint {namespace}/{name}", forever,
                    lambda: self._kube.patch_checkpoint_status(namespace, name, status))

    def _retry(self, what: str, forever: bool, call: Callable[[], None]) -> None:
        delay = 0.2
        attempt = 0
        while True:
            attempt += 1
            try:
                call()
                return
            except KubeError as exc:
                # Only a Retryable (transient) error may pass: a deleted object or a refusal
                # will not, and this loop retries at once, so unclassified is not enough.
                if (not forever and attempt >= STATUS_ATTEMPTS) or self._stopping.is_set() \
                        or not isinstance(exc, Retryable):
                    log.error("giving up on %s: %s", what, exc)
                    return
                log.warning("%s (attempt %d)", exc, attempt)
                self._stopping.wait(delay)
                delay = min(delay * 2, 5.0)

    def _event(self, ckpt: KubeObject, message: str) -> None:
        try:
            self._kube.checkpoint_event(ckpt, "Warning", api.REASON_CHECKPOINT_FAILED, message)
        except KubeError as exc:
            log.warning("%s", exc)

    # -- restore ----------------------------------------------------------------------

    def run_restore(self, sp: SandboxPod) -> None:
        name = str(sp.restore_from)
        if not self._authorized(sp):
            return
        if self._fenced(sp):
            self._release(sp.uid)  # not started: the next loop looks again
            return
        try:
            self._kube.annotate_pod(sp.namespace, sp.pod,
                                    planner.restore_annotations(protocol.RESTORING))
        except KubeError as exc:
            log.warning("%s", exc)
            self._release(sp.uid)
            return
        log.info("restoring pod %s/%s from Checkpoint %s", sp.namespace, sp.pod, name)
        began = time.monotonic()
        try:
            result = self._restore(sp, name)
        except Exception as exc:
            message = str(exc) if isinstance(exc, HermitError) else \
                f"unexpected {type(exc).__name__}: {exc}"
            if not isinstance(exc, HermitError):
                log.exception("restore of %s/%s", sp.namespace, sp.pod)
            metrics.record_restore(time.monotonic() - began, ok=False)
            log.error("restore of %s/%s failed: %s", sp.namespace, sp.pod,
                      protocol.one_line(message))
            # Permanent (refused: corrupt, foreign, incompatible): the same checkpoint never
            # restores; anything else may on a new pod (errors.retryable).
            self._annotate(sp, planner.restore_annotations(
                protocol.RESTORE_FAILED, message, retryable=retryable(exc)))
            return
        metrics.record_restore(time.monotonic() - began, ok=True)
        metrics.record_chunks(cached=result.chunks_cached, fetched=result.chunks_fetched)
        self._annotate(sp, planner.restore_annotations(
            protocol.RESTORED, planner.restored_message(name, result)))

    def _authorized(self, sp: SandboxPod) -> bool:
        """Only a pod of the operator's, from a checkpoint it verified (planner.restore_authority).
        A refusal is written on the pod (Failed, with why) and in an Event, and nothing else
        is done; a wait leaves the pod for a later loop."""
        try:
            sandbox = self._kube.get_sandbox(sp.namespace, sp.sandbox)
            ckpt = self._kube.get_checkpoint(sp.namespace, str(sp.restore_from))
        except KubeError as exc:
            log.warning("%s", exc)
            self._release(sp.uid)
            return False
        verdict = planner.restore_authority(sp, sandbox, ckpt, self._clock())
        with self._lock:
            if verdict.verdict == planner.WAIT:
                self._authority_waits.add(sp.uid)
            else:
                self._authority_waits.discard(sp.uid)
        if verdict.verdict == planner.ALLOW:
            return True
        if verdict.verdict == planner.WAIT:
            log.info("restore of %s/%s waits: %s", sp.namespace, sp.pod, verdict.message)
            self._release(sp.uid)
            return False
        log.warning("restore of %s/%s %s", sp.namespace, sp.pod, verdict.message)
        self._annotate(sp, planner.restore_annotations(
            protocol.RESTORE_FAILED, verdict.message, retryable=verdict.retryable))
        try:
            self._kube.pod_event(sp.namespace, sp.pod, sp.uid, "Warning",
                                 api.REASON_RESTORE_REFUSED, protocol.one_line(verdict.message))
        except KubeError as exc:
            log.warning("%s", exc)
        return False

    def _fenced(self, sp: SandboxPod) -> bool:
        """An older incarnation of the sandbox may still run (fence.py): do not start."""
        try:
            return self._fence.holds(sp)
        except KubeError as exc:
            log.warning("%s", exc)
            return True  # cannot tell: wait

    def _restore(self, sp: SandboxPod, name: str) -> RestoreResult:
        ckpt = self._kube.get_checkpoint(sp.namespace, name)
        origin = planner.restore_origin(ckpt, name)
        if isinstance(origin, str) or ckpt is None:
            # Gone for good, or not Completed yet (the same restore may work later).
            raise (CheckpointRefused if ckpt is None else RestoreFailed)(str(origin))
        sandbox_uid = sp.sandbox_uid
        owner = None  # the sandbox the checkpoint is of: its uid binds it, its Secret reads it
        if origin.sandbox != sp.sandbox or self._stores is not None:
            owner = self._kube.get_sandbox(sp.namespace, origin.sandbox)
        if origin.sandbox != sp.sandbox:  # a fork: the checkpoint is bound to its own sandbox
            if owner is None:
                raise CheckpointRefused(
                    f"Checkpoint {name} belongs to AgentSandbox {origin.sandbox}, which is gone")
            sandbox_uid = str((owner.get("metadata") or {}).get("uid"))
        # Read from where it was written (status.storage), whatever the spec says now.
        store = self._stores.for_checkpoint(ckpt, owner) if self._stores is not None else None
        if sp.container_id is None:
            raise RestoreFailed(f"pod {sp.namespace}/{sp.pod} has no container id")
        pid = locate.find_init_pid(sp.container_id, self._proc_root)
        target = RestoreTarget(
            pin=dataclasses.replace(origin, namespace=sp.namespace, uid=sandbox_uid),
            init_pid=pid, image_digest=sp.image_digest, workspace_path=sp.workspace_path)
        result = self._restorer.restore(target, store=store)
        if origin.sandbox != sp.sandbox and store is not None:
            self._inherit_key(sp, target, store)
        return result

    def _inherit_key(self, sp: SandboxPod, source: RestoreTarget,
                     store: CheckpointStore) -> None:
        """A fork was restored: give it its source's data key (sealed stores), so its
        chunks dedup with the source's. Never fails the restore: without it, the fork's
        first checkpoint makes a key of its own and uploads everything."""
        assert self._stores is not None
        try:
            sandbox = self._kube.get_sandbox(sp.namespace, sp.sandbox)
            if sandbox is None:
                return
            heir, _ = self._stores.for_sandbox(sandbox)
            store.inherit_data_key(source.pin, heir, sp.namespace, sp.sandbox, sp.sandbox_uid)
        except Exception as exc:  # anything: the restore is done
            log.warning("fork %s/%s does not inherit the data key of %s: %s", sp.namespace,
                        sp.sandbox, source.checkpoint, exc)

    def _annotate(self, sp: SandboxPod, annotations: dict[str, str | None]) -> None:
        self._retry(f"annotating pod {sp.namespace}/{sp.pod}", False,
                    lambda: self._kube.annotate_pod(sp.namespace, sp.pod, annotations))

    def shutdown(self) -> None:
        self._jobs.shutdown()
