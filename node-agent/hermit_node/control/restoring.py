"""Running one restore job: only for a pod of the operator's, from a checkpoint it
verified, once no older incarnation of the sandbox may run; the pod's restore annotations
say how it goes (``Restoring``, then ``Restored`` or ``Failed``)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from hermit_common import api, protocol
from hermit_common.errors import CheckpointRefused, HermitError, RestoreFailed, retryable
from hermit_node.control import metrics, planner
from hermit_node.control.kube import Kube, KubeError
from hermit_node.control.planner import SandboxPod
from hermit_node.control.ports import RestoreFence, Restorer, StoreResolver
from hermit_node.control.writes import Writes
from hermit_node.engine.restore import RestoreResult, RestoreTarget
from hermit_node.host import locate

if TYPE_CHECKING:
    from hermit_common.store import CheckpointStore

log = logging.getLogger("hermit_node")


class Restoring:
    """Runs restore jobs (``run``), and knows which pods wait for the operator."""

    def __init__(self, kube: Kube, restorer: Restorer, *, stores: StoreResolver | None,
                 fence: RestoreFence, writes: Writes, release: Callable[[str], None],
                 proc_root: Path, clock: Callable[[], datetime]) -> None:
        self._kube = kube
        self._restorer = restorer
        self._stores = stores  # None: the engine's own store
        self._fence = fence  # NoFence: restores do not wait for older incarnations (tests)
        self._writes = writes
        self._release = release  # Taken.release: not started, the next loop retries
        self._proc_root = proc_root
        self._clock = clock
        self._lock = threading.Lock()
        # Pods (uids) whose restore waits for the operator (planner.restore_authority).
        self._authority_waits: set[str] = set()

    def waits_for_authority(self) -> bool:
        """A pod here waits for the operator to name it or to verify its checkpoint."""
        with self._lock:
            return bool(self._authority_waits)

    def forget(self, waiting: set[str]) -> None:
        """Only pods still waiting (planner.awaiting) may wait for the operator."""
        with self._lock:
            self._authority_waits &= waiting

    def run(self, sp: SandboxPod) -> None:
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
            self._writes.annotate(sp, planner.restore_annotations(
                protocol.RESTORE_FAILED, message, retryable=retryable(exc)))
            return
        metrics.record_restore(time.monotonic() - began, ok=True)
        metrics.record_chunks(cached=result.chunks_cached, fetched=result.chunks_fetched)
        self._writes.annotate(sp, planner.restore_annotations(
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
        self._writes.annotate(sp, planner.restore_annotations(
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
        unreadable = planner.unreadable_format(ckpt, name)
        if unreadable is not None:  # retryable: another node reads it
            raise RestoreFailed(unreadable)
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
