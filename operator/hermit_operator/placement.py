"""Where a sandbox pod waits for a node, and when it falls back to on-demand: pure.

A sandbox that requires spot nodes (podspec.selects_spot_nodes) gets a pod labelled
``hermit.dev/capacity: spot``. When the scheduler finds no node for it (PodScheduled False,
reason Unschedulable, no spec.nodeName) the pod is ``Unplaced``: the Ready condition says
why (situations.py). With spec.placement.fallbackToOnDemandAfterSeconds, once the pod has
waited that long since it was created, reconcile replaces it with one labelled
``on-demand`` that requires a node without any spot label, restoring the same checkpoint.
Every other new pod (a resume, a move, a restore retry, a replacement after a loss) asks
for spot again. Nothing here reads the clock: ``now`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from hermit_common import api, protocol
from hermit_common.protocol import KubeObject
from hermit_operator import podspec
from hermit_operator.conditions import FALSE, get_condition

UNSCHEDULABLE = "Unschedulable"  # the scheduler's reason on the pod's PodScheduled condition
POD_SCHEDULED = "PodScheduled"


@dataclass(frozen=True)
class Unplaced:
    """A pod no node has taken: the scheduler's message, the capacity it asks for
    (api.CAPACITIES, None: no spot requirement), when it moves to an on-demand node
    (None: never), and the checkpoint format level its node must read (None: any node)."""

    pod: str
    message: str
    capacity: str | None = None
    fallback_at: datetime | None = None
    format_level: int | None = None

    def due(self, now: datetime) -> bool:
        """Whether the fallback to an on-demand node is due."""
        return self.fallback_at is not None and now >= self.fallback_at



def unschedulable(pod: KubeObject) -> str | None:
    """The scheduler's message when it found no node for the pod (Pending, unbound,
    PodScheduled False with reason Unschedulable), else None."""
    status = pod.get("status") or {}
    if (pod.get("spec") or {}).get("nodeName") or \
            status.get("phase") not in (None, api.POD_PENDING):
        return None
    scheduled = get_condition(status.get("conditions") or [], POD_SCHEDULED) or {}
    if scheduled.get("status") != FALSE or scheduled.get("reason") != UNSCHEDULABLE:
        return None
    return protocol.one_line(str(scheduled.get("message") or "no node fits the pod"), 512)


def unplaced(sandbox: KubeObject, pod: KubeObject) -> Unplaced | None:
    """The sandbox's pod when no node has taken it, with its fallback time: its creation
    plus spec.placement.fallbackToOnDemandAfterSeconds, for a pod that asks for spot."""
    message = unschedulable(pod)
    if message is None:
        return None
    meta = pod.get("metadata") or {}
    capacity = podspec.capacity_of(pod)
    after = podspec.fallback_after_seconds(sandbox)
    created = protocol.parse_time(meta.get("creationTimestamp"))
    fallback_at = None
    if capacity == api.CAPACITY_SPOT and after is not None and created is not None:
        fallback_at = created + timedelta(seconds=after)
    return Unplaced(str(meta.get("name")), message, capacity, fallback_at,
                    podspec.required_format_level(pod))
