"""S3 garbage collection of one sandbox, run by the node-agent that serves it.

After a routine checkpoint of a sandbox is Completed, the job that took it (it holds
the sandbox's job slot on this node, so no other checkpoint of it runs here) waits
briefly for the operator to record it (retention deletes old Checkpoints in the same
pass), then collects the sandbox's prefix in the store it was written to: manifests of
Checkpoints that no longer exist, and the chunks no remaining manifest references
(``CheckpointStore.collect``). It never races an upload of the same sandbox:

- only the node-agent of the node running the sandbox's current, live pod serves its
  checkpoints, and this job runs there;
- it does not start while another Checkpoint of the sandbox is Dumping or Uploading;
- before every delete request it checks again that the pod is still here, running and
  not terminating, and that no notice came: a new pod elsewhere can only upload after
  its restore, and its restore waits for this pod to be gone (the incarnation fence,
  fence.py);
- nothing younger than ``min_age_seconds`` is deleted.

The pure parts are the functions; ``Collector`` applies them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from hermit_common import protocol
from hermit_common.errors import HermitError
from hermit_node.control import planner
from hermit_node.control.kube import Kube, KubeError
from hermit_node.control.planner import CheckpointView, SandboxPod

if TYPE_CHECKING:
    from hermit_common.gc import CollectResult
    from hermit_common.store import CheckpointStore

log = logging.getLogger(__name__)

# How long the job waits for the operator to record the new checkpoint (and so to apply
# retention) before it collects anyway; what retention removes later goes next time.
SETTLE_SECONDS = 15.0
SETTLE_POLL_SECONDS = 1.0


def _of(checkpoints: Iterable[Mapping[str, Any]], namespace: str,
        sandbox: str) -> list[CheckpointView]:
    """The sandbox's Checkpoints among ``checkpoints``."""
    return [v for v in map(CheckpointView.from_object, checkpoints)
            if v.sandbox_key == (namespace, sandbox)]


def kept_checkpoints(checkpoints: Iterable[Mapping[str, Any]], namespace: str,
                     sandbox: str) -> set[str]:
    """Names of the sandbox's Checkpoints that exist: their manifests stay (a fork, a
    fallback or a recovery may read any of them)."""
    return {v.name for v in _of(checkpoints, namespace, sandbox)}


def others_in_flight(checkpoints: Iterable[Mapping[str, Any]], namespace: str, sandbox: str,
                     name: str) -> list[str]:
    """The sandbox's other Checkpoints a node-agent is writing (Dumping, Uploading)."""
    return sorted(v.name for v in _of(checkpoints, namespace, sandbox)
                  if v.name != name and v.phase in protocol.ACTIVE)


def recorded(sandbox: Mapping[str, Any] | None, name: str) -> bool:
    """The operator has recorded checkpoint ``name`` as the sandbox's lastCheckpoint."""
    last = ((sandbox or {}).get("status") or {}).get("lastCheckpoint") or {}
    return last.get("name") == name


def still_serving(pods: Iterable[SandboxPod], sp: SandboxPod) -> bool:
    """The pod the checkpoint was taken from is still on this node, running, not
    terminating, and still the sandbox's current one here."""
    current = planner.current_pods(pods).get(sp.key)
    return current is not None and current.uid == sp.uid and current.running


class Collector:
    """Runs ``CheckpointStore.collect`` for a sandbox after its routine checkpoints."""

    def __init__(self, kube: Kube, *, min_age_seconds: float,
                 settle_seconds: float = SETTLE_SECONDS,
                 stopping: threading.Event | None = None) -> None:
        self._kube = kube
        self._min_age = min_age_seconds
        self._settle = settle_seconds
        self._stopping = stopping or threading.Event()

    def after_checkpoint(self, name: str, sp: SandboxPod, store: CheckpointStore,
                         halted: Callable[[], bool]) -> CollectResult | None:
        """Collects ``sp``'s sandbox in ``store`` after its checkpoint ``name``; None when
        it did not run (halted, busy, the API or the store did not answer: next time)."""
        try:
            return self._collect(name, sp, store, halted)
        except (KubeError, HermitError) as exc:
            log.warning("garbage collection of %s/%s skipped: %s", sp.namespace, sp.sandbox,
                        exc)
            return None

    def _collect(self, name: str, sp: SandboxPod, store: CheckpointStore,
                 halted: Callable[[], bool]) -> CollectResult | None:
        self._wait_recorded(name, sp, halted)
        checkpoints = self._kube.list_checkpoints(sp.namespace)
        busy = others_in_flight(checkpoints, sp.namespace, sp.sandbox, name)
        if halted() or busy:
            log.info("garbage collection of %s/%s skipped: %s", sp.namespace, sp.sandbox,
                     f"{', '.join(busy)} in flight" if busy else "halted")
            return None
        keep = kept_checkpoints(checkpoints, sp.namespace, sp.sandbox)

        def may_delete() -> bool:
            if halted():
                return False
            pods = planner.sandbox_pods(self._kube.list_node_pods(), sp.node)
            return still_serving(pods, sp)

        return store.collect(sp.namespace, sp.sandbox, keep=keep,
                             min_age_seconds=self._min_age, may_delete=may_delete)

    def _wait_recorded(self, name: str, sp: SandboxPod, halted: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self._settle
        while not halted() and time.monotonic() < deadline:
            if recorded(self._kube.get_sandbox(sp.namespace, sp.sandbox), name):
                # The operator deletes what retention drops right after that status write.
                self._stopping.wait(SETTLE_POLL_SECONDS)
                return
            self._stopping.wait(SETTLE_POLL_SECONDS)
