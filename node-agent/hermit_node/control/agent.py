"""The node-agent's main loop: notices, Checkpoint requests and restores on this node.

Four things run: the watcher thread (interruption notices from the cloud), the watches
that keep a local copy of this node's pods, the Checkpoints labelled with it and its
Node object (``informer.WatchedNode``), the reconcile loop (on every change of that
copy, and at least every ``reconcile_interval_seconds``: start what is due, from the
copy, with no API call) and a small pool of jobs (one per sandbox at a time) that
drive the checkpoint and restore engines. Decisions come from ``planner`` (pure); this
module only applies them, through the small modules beside it that each do one part:
``checkpointing`` and ``restoring`` (the jobs), ``recovery`` (what an earlier run left
half done), ``holds`` (the termination hold), ``requesting`` (the Checkpoints the agent
asks for itself), ``nodemarks`` (taint and ready label), ``prefetch``, with ``jobs``
(the worker pool), ``notices``, ``writes`` and ``ports`` (its collaborators). API errors
are logged and retried on the next loop. SIGTERM of the agent stops the loops, lets
running jobs finish and does nothing else: no taint, no checkpoint. ``hermit_node.main``
builds the agent and starts those threads.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TypeVar

from hermit_common import protocol
from hermit_common.protocol import KubeObject
from hermit_node.control import health as agent_health
from hermit_node.control import metrics, planner
from hermit_node.control.checkpointing import Checkpointing
from hermit_node.control.holds import Holds
from hermit_node.control.jobs import (
    PRIORITY_RESTORE,
    PRIORITY_ROUTINE,
    PRIORITY_STOPPING,
    Jobs,
    Taken,
)
from hermit_node.control.kube import Kube, KubeError
from hermit_node.control.nodemarks import NodeMarks
from hermit_node.control.notices import Notices
from hermit_node.control.planner import CheckpointView, SandboxPod
from hermit_node.control.ports import (
    NO_CAPTURE_WATCH,
    NO_COLLECTOR,
    NO_FENCE,
    NO_HEALTH,
    NO_LIMITER,
    NO_TREES,
    AfterCheckpoint,
    CaptureWatch,
    Checkpointer,
    Health,
    NodeView,
    RestoreFence,
    Restorer,
    StoreResolver,
    TreeControl,
    UploadPromoter,
    utc_now,
)
from hermit_node.control.prefetch import Prefetches
from hermit_node.control.recovery import Recovery
from hermit_node.control.requesting import Requesting
from hermit_node.control.restoring import Restoring
from hermit_node.control.watchers import Notice
from hermit_node.control.writes import Writes

log = logging.getLogger("hermit_node")

_T = TypeVar("_T")

# How often the loop looks at a checkpoint in flight on another node that a pod here waits
# for: a restore starts at most this long after it is Completed.
REMOTE_POLL_SECONDS = 0.25
# While a pod waits for the operator to name it or to verify its checkpoint.
AUTHORITY_POLL_SECONDS = 1.0


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
                 limiter: UploadPromoter = NO_LIMITER, prefetch: bool = False,
                 capture_watch: CaptureWatch = NO_CAPTURE_WATCH) -> None:
        self.node = node
        self._kube = kube
        self._view = view
        self._health = health
        self._clock = clock
        self._stopping = stopping or threading.Event()
        self._jobs = jobs or Jobs()
        # The Checkpoints and pods this process took up, each served once.
        self._taken = Taken(self._jobs, limiter)
        self._notices = Notices(clock, self._stopping)
        writes = Writes(kube, self._stopping)
        # stores None: the engines' own store for everything (no per-sandbox storage,
        # nothing recorded in status.storage, no recovery from the store after a restart).
        self._checkpoints = Checkpointing(
            node, kube, checkpointer, stores=stores, writes=writes, notices=self._notices,
            collector=collector, release=self._taken.release, unfrozen=self._jobs.unfrozen,
            proc_root=proc_root, clock=clock, routine_upload_seconds=routine_upload_seconds,
            capture_watch=capture_watch)
        self._restores = Restoring(kube, restorer, stores=stores, fence=fence, writes=writes,
                                   release=self._taken.release, proc_root=proc_root,
                                   clock=clock)
        self._recovery = Recovery(node, kube, restorer, stores=stores, trees=trees,
                                  writes=writes, proc_root=proc_root, clock=clock)
        self._holds = Holds(kube)
        self._marks = NodeMarks(node, kube, self._notices, health)
        self._requesting = Requesting(node, kube, self._notices, held=self._holds.now,
                                      serve=self._serve, clock=clock)
        self._prefetches = Prefetches(kube, stores, self._jobs, on=prefetch,
                                      halted=self._notices.halted)
        self._reconciling = threading.Lock()  # the watcher thread and the loop both reconcile
        # A waiting pod's checkpoint is in flight on another node (its phase is read, not
        # watched): the loop looks again sooner (``next_wait``).
        self._remote_wait = False

    # -- notices --------------------------------------------------------------------

    def on_notice(self, notice: Notice) -> None:
        metrics.record_notice(notice.provider, notice.kind)
        left = notice.seconds_left(self._clock())
        if notice.asks_early_checkpoint:
            moot = self._notices.advise(notice)
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
        self._notices.interrupted(notice)
        self.reconcile_once()

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
        self._recovery.recover(checkpoints, pods)
        self._holds.judge(pods)
        self._recovery.settle_restores(pods)
        self._marks.taint_on_notice(node)
        made = [*self._requesting.stopping(node, pods, checkpoints),
                *self._requesting.early(pods, checkpoints)]
        self._marks.mark_ready(node)
        if checkpoints is not None:
            self._forget_finished(checkpoints, pods)
            checkpoints = [*checkpoints, *made]
            self._serve(checkpoints, pods)
        known = self._with_sources(pods, checkpoints)
        self._prefetches.start(pods, known)
        for sp in planner.pods_to_restore(pods, known):
            self._prefetches.stop(sp.uid)
            self._taken.start(sp.uid, sp.key, functools.partial(self._restores.run, sp),
                              priority=PRIORITY_RESTORE)

    def next_wait(self, interval: float) -> float:
        """How long the loop may wait for a change: less while a pod here waits for a
        checkpoint in flight on another node (its Completed is not watched from here)."""
        if self._remote_wait:
            return min(interval, REMOTE_POLL_SECONDS)
        waiting = self._restores.waits_for_authority()
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
        for ckpt, sp in planner.checkpoints_to_serve(checkpoints, pods, self._holds.now()):
            view = CheckpointView.from_object(ckpt)
            self._taken.start(view.uid, sp.key,
                              functools.partial(self._checkpoints.run, ckpt, sp),
                              priority=PRIORITY_STOPPING if view.stopping else PRIORITY_ROUTINE,
                              freezes=True)

    @staticmethod
    def _read(read: Callable[[], _T]) -> _T | None:
        try:
            return read()
        except KubeError as exc:
            log.warning("%s", exc)
            return None

    def _forget_finished(self, checkpoints: list[KubeObject], pods: list[SandboxPod]) -> None:
        """Forget what no longer waits (planner.awaiting): the jobs taken, once none runs
        for them, and the pods waiting for the operator."""
        waiting = planner.awaiting(checkpoints, pods)
        self._taken.forget_finished(waiting)
        self._restores.forget(waiting)

    def shutdown(self) -> None:
        self._jobs.shutdown()
