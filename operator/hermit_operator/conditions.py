"""Standard (metav1.Condition) conditions and the phase derived from them: pure functions."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from hermit_common import api
from hermit_common.protocol import rfc3339

Condition = dict[str, Any]

TRUE = "True"
FALSE = "False"
UNKNOWN = "Unknown"
_STATUSES = (TRUE, FALSE, UNKNOWN)


def get_condition(conditions: Sequence[Condition] | None, type_: str) -> Condition | None:
    """The condition of this type, or None."""
    for cond in conditions or ():
        if cond.get("type") == type_:
            return cond
    return None


def is_true(conditions: Sequence[Condition] | None, type_: str) -> bool:
    cond = get_condition(conditions, type_)
    return cond is not None and cond.get("status") == TRUE


def set_condition(
    conditions: Sequence[Condition] | None,
    type_: str,
    status: str,
    reason: str,
    message: str,
    observed_generation: int | None,
    now: datetime,
) -> list[Condition]:
    """A new list with the condition of ``type_`` set; the input is not changed.

    ``lastTransitionTime`` changes only when the status flips (or the condition is new);
    reason, message and observedGeneration always take the new values. Order is kept.
    """
    if status not in _STATUSES:
        raise ValueError(f"condition status {status!r} is not one of {', '.join(_STATUSES)}")
    new: Condition = {"type": type_, "status": status, "reason": reason, "message": message}
    if observed_generation is not None:
        new["observedGeneration"] = observed_generation
    out: list[Condition] = []
    found = False
    for cond in conditions or ():
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        same = cond.get("status") == status and cond.get("lastTransitionTime")
        new["lastTransitionTime"] = cond["lastTransitionTime"] if same else rfc3339(now)
        out.append(new)
    if not found:
        new["lastTransitionTime"] = rfc3339(now)
        out.append(new)
    return out


# Highest priority first; Running needs Ready=True and comes after these.
_PHASE_ORDER = (
    (api.COND_FAILED, api.PHASE_FAILED),
    (api.COND_SUCCEEDED, api.PHASE_SUCCEEDED),
    (api.COND_SUSPENDED, api.PHASE_SUSPENDED),
    (api.COND_MIGRATING, api.PHASE_MIGRATING),
    (api.COND_RESTORING, api.PHASE_RESTORING),
    (api.COND_CHECKPOINTING, api.PHASE_CHECKPOINTING),
)


def derive_phase(conditions: Sequence[Condition] | None, pod_phase: str | None = None) -> str:
    """The sandbox phase: Failed > Succeeded > Suspended > Migrating > Restoring >
    Checkpointing > Running (Ready=True) > Pending.

    An invalid spec (Accepted=False) reads as Failed until it is fixed. ``pod_phase``
    (the current pod's status.phase) counts as Failed/Succeeded before conditions say so.
    """
    if (get_condition(conditions, api.COND_ACCEPTED) or {}).get("status") == FALSE:
        return api.PHASE_FAILED
    for type_, phase in _PHASE_ORDER:
        if is_true(conditions, type_) or (phase == pod_phase and phase in _POD_TERMINAL):
            return phase
    if is_true(conditions, api.COND_READY):
        return api.PHASE_RUNNING
    return api.PHASE_PENDING


_POD_TERMINAL = api.POD_ENDED
