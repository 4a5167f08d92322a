"""The interruption notice every watcher produces, whatever the cloud."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

Provider = Literal["aws", "gcp", "azure"]

# Notice.kind values.
SPOT_INTERRUPTION = "spot-interruption"  # AWS instance-action
REBALANCE_RECOMMENDATION = "rebalance-recommendation"  # AWS, advisory: no deadline
SCHEDULED_MAINTENANCE = "scheduled-maintenance"  # AWS/GCP/Azure planned events
PREEMPTION = "preemption"  # GCP preempted, Azure Preempt
TERMINATION = "termination"  # Azure Terminate

# Kinds after which the node goes away (or its memory is lost) at the deadline.
INTERRUPTION_KINDS = frozenset({SPOT_INTERRUPTION, PREEMPTION, TERMINATION})


@dataclass(frozen=True)
class Notice:
    """One interruption notice as seen on this node.

    ``deadline`` is the aware UTC time by which the node may be gone; ``None``
    only for advisory notices (an AWS rebalance recommendation).
    ``event_id`` is stable across polls of the same event and is what an
    acknowledgment (Azure ``StartRequests``) refers to.
    """

    provider: Provider
    kind: str
    action: str
    deadline: datetime | None
    received_at: datetime
    event_id: str
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def key(self) -> tuple[str, str, str]:
        """Identity of the event: the same key is yielded by ``watch()`` only once."""
        return (self.provider, self.kind, self.event_id)

    @property
    def is_interruption(self) -> bool:
        """True when the node is going away, not merely advised to."""
        return self.kind in INTERRUPTION_KINDS or (
            self.kind == SCHEDULED_MAINTENANCE and self.action not in ("migrate", "freeze")
        )

    @property
    def asks_early_checkpoint(self) -> bool:
        """An advisory notice that the node is at elevated risk of interruption (an AWS
        rebalance recommendation): worth an early routine checkpoint of every sandbox."""
        return self.kind == REBALANCE_RECOMMENDATION

    def seconds_left(self, now: datetime) -> float:
        """Seconds from ``now`` to the deadline (negative once passed, inf without one)."""
        if self.deadline is None:
            return math.inf
        return (self.deadline - now).total_seconds()
