from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from hermit_common import api
from hermit_operator.conditions import derive_phase, get_condition, set_condition

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)


def test_new_condition_has_the_standard_shape() -> None:
    conds = set_condition([], "Ready", "False", "PodCreating", "creating pod x-1", 3, T0)
    assert conds == [{"type": "Ready", "status": "False", "reason": "PodCreating",
                      "message": "creating pod x-1", "observedGeneration": 3,
                      "lastTransitionTime": "2026-01-01T12:00:00Z"}]


def test_same_status_keeps_transition_time_but_updates_the_rest() -> None:
    first = set_condition([], "Ready", "False", "PodCreating", "a", 1, T0)
    second = set_condition(first, "Ready", "False", "PodPending", "b", 2, T1)
    assert second[0]["lastTransitionTime"] == "2026-01-01T12:00:00Z"
    assert (second[0]["reason"], second[0]["message"], second[0]["observedGeneration"]) == (
        "PodPending", "b", 2)


def test_flip_changes_transition_time_and_input_is_untouched() -> None:
    first = set_condition([], "Ready", "False", "PodCreating", "a", 1, T0)
    flipped = set_condition(first, "Ready", "True", "PodRunning", "b", 1, T1)
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T12:05:00Z"
    assert first[0]["status"] == "False"


def test_order_is_kept_and_get_condition_finds_by_type() -> None:
    conds = set_condition([], "Accepted", "True", "SpecValid", "", 1, T0)
    conds = set_condition(conds, "Ready", "False", "PodCreating", "", 1, T0)
    conds = set_condition(conds, "Accepted", "False", "InvalidSpec", "x", 2, T1)
    assert [c["type"] for c in conds] == ["Accepted", "Ready"]
    assert get_condition(conds, "Accepted") == conds[0]
    assert get_condition(conds, "Missing") is None
    assert get_condition(None, "Ready") is None


def test_rejects_a_bad_status() -> None:
    with pytest.raises(ValueError, match="not one of"):
        set_condition([], "Ready", "yes", "R", "", 1, T0)


def _conds(*true: str, false: tuple[str, ...] = ()) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for t in true:
        out = set_condition(out, t, "True", "R", "", 1, T0)
    for t in false:
        out = set_condition(out, t, "False", "R", "", 1, T0)
    return out


@pytest.mark.parametrize(
    ("true", "false", "pod_phase", "phase"),
    [
        ((), (), None, "Pending"),
        ((), (api.COND_READY,), "Pending", "Pending"),
        ((api.COND_READY,), (), "Running", "Running"),
        ((api.COND_READY, api.COND_CHECKPOINTING), (), "Running", "Checkpointing"),
        ((api.COND_CHECKPOINTING, api.COND_RESTORING), (), None, "Restoring"),
        ((api.COND_RESTORING, api.COND_MIGRATING), (), None, "Migrating"),
        ((api.COND_MIGRATING, api.COND_SUSPENDED), (), None, "Suspended"),
        ((api.COND_SUSPENDED, api.COND_SUCCEEDED), (), None, "Succeeded"),
        ((api.COND_SUCCEEDED, api.COND_FAILED), (), None, "Failed"),
        ((api.COND_READY,), (), "Failed", "Failed"),
        ((api.COND_READY,), (), "Succeeded", "Succeeded"),
        ((api.COND_READY,), (api.COND_ACCEPTED,), "Running", "Failed"),
        ((api.COND_ACCEPTED,), (api.COND_READY, api.COND_FAILED), "Running", "Pending"),
    ],
)
def test_phase_table(true: tuple[str, ...], false: tuple[str, ...], pod_phase: str | None,
                     phase: str) -> None:
    got = derive_phase(_conds(*true, false=false), pod_phase)
    assert got == phase and got in api.SANDBOX_PHASES
