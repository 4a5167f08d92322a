"""The sandbox's conditions, computed from what one reconcile saw and decided: pure.

``reconcile.plan()`` decides what to do and records the outcome as a ``Situation`` (one
of the small frozen dataclasses below, with the names and messages it needs). Each
condition type has one function here that maps a ``Seen`` (that situation, the
conditions as read and the sandbox's checkpoints) to the condition's new
(status, reason, message), or to None where the condition is left as it is.
``conditions()`` applies them all, once, with ``set_condition`` (lastTransitionTime
changes only on a flip; observedGeneration is the sandbox's generation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Final, NamedTuple

from hermit_common import api, protocol
from hermit_common.protocol import KubeObject
from hermit_operator import checkpoints as ck
from hermit_operator.conditions import (
    FALSE,
    TRUE,
    Condition,
    get_condition,
    set_condition,
)
from hermit_operator.placement import Unplaced


class Verdict(NamedTuple):
    """A condition's new status, reason and message."""

    status: str
    reason: str
    message: str


# -- the situations -----------------------------------------------------------------------

@dataclass(frozen=True)
class SpecInvalid:
    """The spec cannot be run."""

    message: str


@dataclass(frozen=True)
class Suspending:
    """spec.suspend: the live pod is checkpointed (``checkpoint``) before it is released."""

    checkpoint: str
    pod: str | None


@dataclass(frozen=True)
class Suspended:
    """spec.suspend: the sandbox has no pod."""


@dataclass(frozen=True)
class Finished:
    """The sandbox has succeeded or failed and its pod is gone: nothing to do."""


@dataclass(frozen=True)
class PodTerminating:
    pod: str


@dataclass(frozen=True)
class WaitingForCheckpoint:
    """A stopping checkpoint is in flight: the replacement waits for it."""

    message: str


@dataclass(frozen=True)
class ForkBlocked:
    """spec.restoreFrom cannot be restored yet: its Checkpoint is missing
    (CheckpointNotFound), in flight (CheckpointInProgress) or Failed (CheckpointFailed)."""

    reason: str
    message: str


@dataclass(frozen=True)
class RestoreWaiting:
    """A restore retry is scheduled for later (status.nextRestoreAt)."""


@dataclass(frozen=True)
class RestoreRetrying:
    """A restore failed: its pod is deleted, the same checkpoint is restored again later."""

    message: str


@dataclass(frozen=True)
class PodCreating:
    """A new incarnation's pod is created, restoring ``restore_from`` (None: from scratch).

    ``migration``: a stopping checkpoint of the old pod moves the sandbox (Migrating=True);
    ``no_usable``: no checkpoint could be restored, the pod starts from scratch;
    ``on_demand``: why the pod asks for an on-demand node (no spot node took the last one).
    """

    pod: str
    restore_from: str | None = None
    restore_reason: str = api.REASON_RESTORE_STARTED
    restore_message: str | None = None  # None: one that names the checkpoint and the pod
    migration: str | None = None
    no_usable: str | None = None
    on_demand: str | None = None


class PodState(Enum):
    PENDING = api.POD_PENDING
    NOT_READY = "NotReady"
    RUNNING = api.POD_RUNNING  # and ready
    SUCCEEDED = api.POD_SUCCEEDED
    FAILED = api.POD_FAILED


@dataclass(frozen=True)
class PodObserved:
    """The current pod exists and is mirrored; ``restored``: the checkpoint whose restore
    into it completed in this plan; ``unplaced``: no node has taken it (yet)."""

    pod: str
    node: str | None
    state: PodState
    detail: str = ""  # one line about its containers (reconcile.container_message)
    restored: str | None = None
    unplaced: Unplaced | None = None

    @property
    def ended(self) -> bool:
        return self.state in (PodState.SUCCEEDED, PodState.FAILED)


Situation = (SpecInvalid | Suspending | Suspended | Finished | PodTerminating
             | WaitingForCheckpoint | ForkBlocked | RestoreWaiting | RestoreRetrying
             | PodCreating | PodObserved)


@dataclass(frozen=True)
class Seen:
    """The conditions' only input: the situation, the conditions as read, the sandbox's
    checkpoints (oldest first)."""

    situation: Situation
    before: Sequence[Condition] = ()
    ckpts: Sequence[KubeObject] = ()

    def was(self, type_: str, status: str | None = None) -> bool:
        """Whether the condition was there (with this status, when given)."""
        cond = get_condition(self.before, type_)
        return cond is not None and (status is None or cond.get("status") == status)


# -- one function per condition type --------------------------------------------------------

def accepted(seen: Seen) -> Verdict:
    if isinstance(seen.situation, SpecInvalid):
        return Verdict(FALSE, api.REASON_INVALID_SPEC, seen.situation.message)
    return Verdict(TRUE, api.REASON_SPEC_VALID, "the spec can be run")


def checkpointing(seen: Seen) -> Verdict | None:
    """From the sandbox's checkpoints: one in flight, else the newest finished one."""
    if isinstance(seen.situation, SpecInvalid):
        return None
    busy = ck.active(seen.ckpts)
    if busy is not None:
        return Verdict(TRUE, api.REASON_CHECKPOINT_IN_PROGRESS, f"checkpoint {ck.name_of(busy)} "
                       f"({ck.reason_of(busy)}) is {ck.phase_of(busy)}")
    done = ck.newest_finished(seen.ckpts)
    if done is not None and ck.phase_of(done) == ck.COMPLETED:
        return Verdict(FALSE, api.REASON_CHECKPOINT_COMPLETED,
                       f"checkpoint {ck.name_of(done)} ({ck.reason_of(done)}) completed")
    if done is not None:
        return Verdict(FALSE, api.REASON_CHECKPOINT_FAILED, ck.failure_message(done))
    if seen.was(api.COND_CHECKPOINTING, TRUE):
        return Verdict(FALSE, api.REASON_NO_CHECKPOINT_IN_PROGRESS, "no checkpoint is being taken")
    return None


def suspended(seen: Seen) -> Verdict | None:
    s = seen.situation
    if isinstance(s, SpecInvalid):
        return None
    if isinstance(s, Suspending):
        return Verdict(FALSE, api.REASON_SUSPEND_REQUESTED,
                       f"checkpoint {s.checkpoint} is taken before pod {s.pod} is released")
    if isinstance(s, Suspended):
        return Verdict(TRUE, api.REASON_SUSPEND_REQUESTED,
                       "spec.suspend is true: the sandbox's pod is released")
    if seen.was(api.COND_SUSPENDED, TRUE):
        return Verdict(FALSE, api.REASON_RESUMED, "spec.suspend is false")
    if not seen.was(api.COND_SUSPENDED):
        return Verdict(FALSE, api.REASON_NOT_SUSPENDED, "spec.suspend is false")
    return None


def restoring(seen: Seen) -> Verdict | None:
    s = seen.situation
    if isinstance(s, PodCreating):
        return _restoring_new_pod(seen, s)
    if isinstance(s, RestoreRetrying):
        return Verdict(TRUE, api.REASON_RESTORE_RETRYING, s.message)
    if isinstance(s, ForkBlocked) and s.reason == api.REASON_CHECKPOINT_IN_PROGRESS:
        return Verdict(TRUE, s.reason, s.message)
    if (isinstance(s, ForkBlocked) and s.reason == api.REASON_CHECKPOINT_FAILED
            and seen.was(api.COND_RESTORING)):
        return Verdict(FALSE, s.reason, s.message)
    if isinstance(s, PodObserved) and s.restored:
        return Verdict(FALSE, api.REASON_RESTORE_COMPLETED,
                       f"pod {s.pod} restored checkpoint {s.restored}")
    if isinstance(s, PodObserved) and s.ended and seen.was(api.COND_RESTORING, TRUE):
        return Verdict(FALSE, api.REASON_RESTORE_FAILED,
                       f"pod {s.pod} ended before its restore finished")
    return None


def _restoring_new_pod(seen: Seen, s: PodCreating) -> Verdict | None:
    if s.restore_from is not None:
        return Verdict(TRUE, s.restore_reason, s.restore_message
                       or f"restoring checkpoint {s.restore_from} into pod {s.pod}")
    if s.no_usable is not None:
        return Verdict(FALSE, api.REASON_NO_USABLE_CHECKPOINT, s.no_usable)
    if seen.was(api.COND_RESTORING):
        return Verdict(FALSE, api.REASON_POD_CREATING, "nothing to restore")
    return None


def migrating(seen: Seen) -> Verdict | None:
    s = seen.situation
    if isinstance(s, PodCreating) and s.migration is not None:
        return Verdict(TRUE, api.REASON_CHECKPOINT_COMPLETED, s.migration)
    if not seen.was(api.COND_MIGRATING, TRUE):
        return None
    if isinstance(s, PodCreating) and s.no_usable is not None:
        return Verdict(FALSE, api.REASON_NO_USABLE_CHECKPOINT, s.no_usable)
    if isinstance(s, PodObserved) and s.restored:
        return Verdict(FALSE, api.REASON_RESTORE_COMPLETED,
                       f"the sandbox moved to pod {s.pod} on node {s.node}")
    return None


def ready(seen: Seen) -> Verdict | None:
    s = seen.situation
    if isinstance(s, PodObserved):
        return _ready_pod(s)
    if isinstance(s, PodCreating) and s.on_demand is not None:
        return Verdict(FALSE, api.REASON_ON_DEMAND_FALLBACK, s.on_demand)
    if isinstance(s, PodCreating):
        return Verdict(FALSE, api.REASON_POD_CREATING, f"creating pod {s.pod}")
    if isinstance(s, Suspended):
        return Verdict(FALSE, api.REASON_SUSPEND_REQUESTED, "the sandbox is suspended")
    if isinstance(s, PodTerminating):
        return Verdict(FALSE, api.REASON_POD_TERMINATING, f"pod {s.pod} is terminating")
    if isinstance(s, WaitingForCheckpoint):
        return Verdict(FALSE, api.REASON_CHECKPOINT_IN_PROGRESS, s.message)
    if isinstance(s, ForkBlocked):
        return Verdict(FALSE, s.reason, s.message)
    if isinstance(s, RestoreRetrying):
        return Verdict(FALSE, api.REASON_RESTORE_RETRYING, s.message)
    return None


def _ready_pod(s: PodObserved) -> Verdict:
    if s.state is PodState.SUCCEEDED:
        return Verdict(FALSE, api.REASON_POD_SUCCEEDED, f"pod {s.pod} has completed")
    if s.state is PodState.FAILED:
        return Verdict(FALSE, api.REASON_POD_FAILED, f"pod {s.pod} failed: {s.detail}")
    if s.state is PodState.RUNNING:
        return Verdict(TRUE, api.REASON_POD_RUNNING, f"pod {s.pod} is running on node {s.node}")
    if s.unplaced is not None:
        return _waiting_for_node(s.unplaced)
    reason = api.REASON_POD_PENDING if s.state is PodState.PENDING else api.REASON_POD_NOT_READY
    return Verdict(FALSE, reason, f"pod {s.pod}: {s.detail}")


def _waiting_for_node(u: Unplaced) -> Verdict:
    """No node has taken the pod: for a spot pod, when (or whether) it falls back; for a
    pod restoring a checkpoint of a newer format, which nodes it waits for."""
    verdict = _waiting_for_capacity(u)
    if u.format_level is None:
        return verdict
    # The scheduler's message does not say which requirement no node met: say first
    # what this one asks, which the scheduler's cut message could otherwise lose.
    return Verdict(verdict.status, verdict.reason, protocol.one_line(
        f"waiting for a node whose node-agent reads checkpoint format {u.format_level} "
        f"(pod {u.pod} restores a checkpoint of that format; a node-agent labels its node "
        f"{protocol.LABEL_CHECKPOINT_FORMAT} with the format it reads: is the node-agent "
        f"DaemonSet being rolled out?); {verdict.message}"))


def _waiting_for_capacity(u: Unplaced) -> Verdict:
    if u.capacity != api.CAPACITY_SPOT:
        asks = " (it asks for an on-demand node)" if u.capacity == api.CAPACITY_ON_DEMAND else ""
        return Verdict(FALSE, api.REASON_UNSCHEDULABLE,
                       f"no node can take pod {u.pod}{asks}: {u.message}")
    if u.fallback_at is None:
        then = ("it waits for spot capacity (spec.placement.fallbackToOnDemandAfterSeconds "
                "is not set)")
    else:
        then = (f"it moves to an on-demand node at {protocol.rfc3339(u.fallback_at)} "
                "(spec.placement.fallbackToOnDemandAfterSeconds) unless a spot node takes "
                "it first")
    return Verdict(FALSE, api.REASON_WAITING_FOR_SPOT,
                   f"no spot node can take pod {u.pod}: {u.message}; {then}")


def succeeded(seen: Seen) -> Verdict | None:
    s = seen.situation
    if isinstance(s, PodObserved) and s.state is PodState.SUCCEEDED:
        return Verdict(TRUE, api.REASON_POD_SUCCEEDED,
                       f"the sandbox's command in pod {s.pod} exited 0")
    return _not_finished(seen, api.COND_SUCCEEDED)


def failed(seen: Seen) -> Verdict | None:
    s = seen.situation
    if isinstance(s, PodObserved) and s.state is PodState.FAILED:
        return Verdict(TRUE, api.REASON_POD_FAILED, f"pod {s.pod} failed: {s.detail}")
    return _not_finished(seen, api.COND_FAILED)


def _not_finished(seen: Seen, type_: str) -> Verdict | None:
    """False (Running) while a pod runs or a restore is retried, when not set yet."""
    if isinstance(seen.situation, PodObserved | RestoreRetrying) and not seen.was(type_):
        return Verdict(FALSE, api.REASON_RUNNING, "the sandbox has not finished")
    return None


# -- assembly -------------------------------------------------------------------------------

RULES: Final[dict[str, Callable[[Seen], Verdict | None]]] = {
    api.COND_ACCEPTED: accepted,
    api.COND_CHECKPOINTING: checkpointing,
    api.COND_SUSPENDED: suspended,
    api.COND_RESTORING: restoring,
    api.COND_MIGRATING: migrating,
    api.COND_READY: ready,
    api.COND_SUCCEEDED: succeeded,
    api.COND_FAILED: failed,
}
_FIRST: Final = (api.COND_ACCEPTED, api.COND_CHECKPOINTING, api.COND_SUSPENDED)


def _order(s: Situation) -> tuple[str, ...]:
    """The order the conditions are applied in, which only decides where ones the status
    does not have yet are appended (the list is a map keyed by type): as it always was."""
    rest: tuple[str, ...]
    if isinstance(s, PodCreating):
        rest = (api.COND_MIGRATING, api.COND_READY, api.COND_RESTORING)
    elif isinstance(s, PodObserved) and s.state is PodState.SUCCEEDED:
        rest = (api.COND_RESTORING, api.COND_MIGRATING, api.COND_SUCCEEDED, api.COND_READY)
    elif isinstance(s, PodObserved) and s.state is PodState.FAILED:
        rest = (api.COND_RESTORING, api.COND_MIGRATING, api.COND_FAILED, api.COND_READY)
    else:
        rest = (api.COND_RESTORING, api.COND_MIGRATING, api.COND_READY)
    return _FIRST + rest + tuple(t for t in (api.COND_SUCCEEDED, api.COND_FAILED)
                                 if t not in rest)


def conditions(seen: Seen, generation: int | None, now: datetime) -> list[Condition]:
    """The conditions as read, with every condition's verdict applied."""
    out = list(seen.before)
    for type_ in _order(seen.situation):
        verdict = RULES[type_](seen)
        if verdict is not None:
            out = set_condition(out, type_, *verdict, generation, now)
    return out


def true_after(seen: Seen, type_: str) -> bool:
    """Whether the condition is True once the verdicts are applied."""
    verdict = RULES[type_](seen)
    return seen.was(type_, TRUE) if verdict is None else verdict.status == TRUE
