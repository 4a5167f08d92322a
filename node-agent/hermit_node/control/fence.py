"""The incarnation fence: a restore never starts while an older incarnation may still run.

A sandbox has at most one live copy. The operator deletes pod N and creates pod N+1 in
one pass, and a node that lost contact with the API server may still run pod N's tree.
Before it restores anything into pod N+1, the node-agent lists the sandbox's pods (label
``hermit.dev/sandbox``, owned by the same AgentSandbox uid) and waits while any pod of a
lower incarnation **may still run**: it exists in the API and its phase is not
``Succeeded`` or ``Failed``. A terminating pod may still run; a pod on a node that went
silent may still run. Such a pod stops holding the fence only when the kubelet reports
it ended, or the pod object is gone (the kubelet confirmed the deletion; or the node was
deleted, or tainted ``node.kubernetes.io/out-of-service``, and the pod garbage collector
removed its pods, which is how Kubernetes itself declares a node's pods dead).

While the fence holds, the restore is not started (no ``restore-phase`` is written) and
the next loop looks again; the new pod's ``hermit-init --restore`` gives up after its
timeout and the operator tries again on a fresh pod (docs/protocol.md flow 11).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from hermit_common import api
from hermit_common.protocol import KubeObject
from hermit_node.control import planner
from hermit_node.control.planner import SandboxPod

log = logging.getLogger(__name__)

POD_ENDED = frozenset(api.POD_ENDED)  # Kubernetes pod phases: nothing runs


def older_alive(pods: Iterable[Mapping[str, Any]], sp: SandboxPod) -> list[str]:
    """Names of the sandbox's pods of an older incarnation than ``sp`` that may still run."""
    out = []
    for pod in pods:
        other = planner.sandbox_pod(pod)
        if other is None or other.key != sp.key or other.sandbox_uid != sp.sandbox_uid:
            continue
        phase = (pod.get("status") or {}).get("phase")
        if other.incarnation < sp.incarnation and phase not in POD_ENDED:
            out.append(other.pod)
    return sorted(out)


class PodLister(Protocol):
    def list_sandbox_pods(self, namespace: str, sandbox: str) -> list[KubeObject]: ...


class Fence:
    """Asks the API whether a restore into ``sp`` may start; says why not once per pod."""

    def __init__(self, kube: PodLister) -> None:
        self._kube = kube
        self._told: set[str] = set()
        self._lock = threading.Lock()

    def holds(self, sp: SandboxPod) -> bool:
        """True while an older incarnation may still run (KubeError passes through)."""
        alive = older_alive(self._kube.list_sandbox_pods(sp.namespace, sp.sandbox), sp)
        with self._lock:
            if not alive:
                self._told.discard(sp.uid)
                return False
            if sp.uid in self._told:
                return True
            self._told.add(sp.uid)
        log.info("restore of %s/%s waits: older incarnation pod(s) %s may still run",
                 sp.namespace, sp.pod, ", ".join(alive))
        return True
