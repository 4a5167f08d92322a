"""The Checkpoints this node-agent requests itself: a stopping one (Preemption or
Eviction) of every sandbox on a node that goes, or of a pod being deleted under the
termination hold, and an early routine one (Rebalance) after a rebalance recommendation."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from hermit_common import protocol
from hermit_common.protocol import KubeObject
from hermit_node.control import planner, requests
from hermit_node.control.kube import Kube, KubeError
from hermit_node.control.notices import Notices
from hermit_node.control.planner import SandboxPod

log = logging.getLogger("hermit_node")

Serve = Callable[[list[KubeObject], list[SandboxPod]], None]


class Requesting:
    def __init__(self, node: str, kube: Kube, notices: Notices, *,
                 held: Callable[[], frozenset[str]], serve: Serve,
                 clock: Callable[[], datetime]) -> None:
        self.node = node
        self._kube = kube
        self._notices = notices
        self._held = held  # Holds.now: the pods held for their stopping checkpoint
        self._serve = serve  # queues the job of each request made
        self._clock = clock

    def stopping(self, node: KubeObject | None, pods: list[SandboxPod],
                                      checkpoints: list[KubeObject] | None
                                      ) -> list[KubeObject]:
        """A cloud notice or a drain of the node: make sure every sandbox on it has a
        stopping checkpoint request (Preemption or Eviction); neither: only the pods being
        deleted under the termination hold (Eviction). Returns the requests it made."""
        notice = self._notices.interruption()
        reason = protocol.PREEMPTION if notice is not None else (
            planner.node_disruption(node) if node is not None else None)
        held = self._held()
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

    def early(self, pods: list[SandboxPod],
               checkpoints: list[KubeObject] | None) -> list[KubeObject]:
        """After a rebalance recommendation: an early routine (``Rebalance``) checkpoint
        request for every sandbox on the node (``planner.early_requests``), made once; the
        requests that could not be made are tried again on the next loop. Nothing once an
        interruption notice came: its stopping checkpoints do the work."""
        advised, notice = self._notices.now()
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
            self._notices.advised_done(advised)
        return made
