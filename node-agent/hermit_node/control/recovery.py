"""At start-up: finish what an earlier run of this node-agent left half done (its
checkpoints, trees left frozen, restores cut short)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from hermit_common import protocol
from hermit_common.errors import HermitError
from hermit_common.pin import Pin
from hermit_common.protocol import KubeObject
from hermit_common.s3errors import CheckpointNotFound
from hermit_node.control import planner
from hermit_node.control.kube import Kube, KubeError
from hermit_node.control.planner import CheckpointView, SandboxPod
from hermit_node.control.ports import Restorer, StoreResolver, TreeControl
from hermit_node.control.writes import Writes
from hermit_node.host import freezer, locate

log = logging.getLogger("hermit_node")


class Recovery:
    def __init__(self, node: str, kube: Kube, restorer: Restorer, *,
                 stores: StoreResolver | None, trees: TreeControl, writes: Writes,
                 proc_root: Path, clock: Callable[[], datetime]) -> None:
        self.node = node
        self._kube = kube
        self._restorer = restorer
        # None: no recovery from the store (the engines' own store for everything).
        self._stores = stores
        self._trees = trees
        self._writes = writes
        self._proc_root = proc_root
        self._clock = clock
        self._recovered = False  # every checkpoint an earlier run left behind is decided
        self._settled = False  # frozen trees and cut-short restores were dealt with
        # Pods (uids) an earlier run of the agent left Restoring: since when (monotonic).
        self._left_restoring: dict[str, float] = {}

    def recover(self, checkpoints: list[KubeObject] | None, pods: list[SandboxPod]) -> None:
        """Once the node's Checkpoints are known, until every one an earlier run left
        behind is decided."""
        if not self._recovered and checkpoints is not None:
            self._recovered = self._recover_now(checkpoints, pods)

    def _recover_now(self, checkpoints: list[KubeObject], pods: list[SandboxPod]) -> bool:
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

    def settle_restores(self, pods: list[SandboxPod]) -> None:
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
            self._writes.annotate(sp, planner.restore_annotations(
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
        self._writes.annotate(sp, planner.restore_annotations(
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
                self._writes.write_status(namespace, name, planner.status_recovered(
                    stored.totals.to_dict(), store.manifest_uri(namespace, sandbox, name),
                    digest, stored.binding.to_dict(), self._clock()), forever=True)
                return True
        message = "the node-agent restarted while taking this checkpoint"
        self._writes.write_status(namespace, name,
                           planner.status_failed(message, self._clock(), self.node))
        self._writes.event(ckpt, message)
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
