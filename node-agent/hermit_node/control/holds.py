"""The termination hold (docs/protocol.md, "Evictions"): which pods being deleted wait,
in their preStop hook, for their stopping checkpoint."""

from __future__ import annotations

import logging
import threading

from hermit_node.control import planner
from hermit_node.control.kube import Kube, KubeError
from hermit_node.control.planner import SandboxPod

log = logging.getLogger("hermit_node")


class Holds:
    def __init__(self, kube: Kube) -> None:
        self._kube = kube
        self._lock = threading.Lock()
        # Pods (uids) being deleted under the termination hold, judged once: None when it
        # is held for its stopping checkpoint, else why not (``judge``).
        self._held: dict[str, str | None] = {}

    def now(self) -> frozenset[str]:
        with self._lock:
            return frozenset(uid for uid, why in self._held.items() if why is None)

    def judge(self, pods: list[SandboxPod]) -> None:
        """Pods being deleted under the termination hold (their preStop hook sleeps while
        this agent saves them): each is judged once (``planner.hold_verdict``, one read of
        its AgentSandbox) and, when it needs it, held: ``Requesting.stopping`` asks for its
        Eviction checkpoint and ``NodeAgent._serve`` serves it although the pod is being
        deleted."""
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
