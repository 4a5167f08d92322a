"""The conditions follow from the plan's situation (situations.py), written in one place."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from hermit_common import api
from hermit_common.settings import OperatorSettings
from hermit_operator import driver
from hermit_operator import situations as sit
from hermit_operator.conditions import get_condition
from hermit_operator.podspec import InvalidSpec
from hermit_operator.reconcile import Event
from tests.support.operator_driver import SAMPLE, FakeKube

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "hermit_operator"
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
TYPES = (api.COND_ACCEPTED, api.COND_READY, api.COND_CHECKPOINTING, api.COND_RESTORING,
         api.COND_MIGRATING, api.COND_SUSPENDED, api.COND_SUCCEEDED, api.COND_FAILED)


def test_every_condition_type_has_one_rule_and_set_condition_one_caller() -> None:
    assert sorted(sit.RULES) == sorted(TYPES)
    callers = [path.name for path in sorted(OPERATOR.glob("*.py"))
               for _ in re.finditer(r"\bset_condition\(", path.read_text())
               if path.name != "conditions.py"]
    assert callers == ["situations.py"]


def cond(status: str, reason: str = "x") -> dict[str, Any]:
    return {"type": "T", "status": status, "reason": reason, "message": "m",
            "lastTransitionTime": "2026-01-01T10:00:00Z"}


@pytest.mark.parametrize(
    ("situation", "before", "want"),
    [
        # Waiting for a restore retry or for the end: Ready stays as it was.
        (sit.RestoreWaiting(), [], None),
        (sit.Finished(), [], None),
        (sit.Suspending("minimal-1-suspend", "minimal-1"), [], None),
        (sit.PodTerminating("minimal-1"),
         [], sit.Verdict("False", api.REASON_POD_TERMINATING, "pod minimal-1 is terminating")),
        (sit.PodObserved("minimal-1", "spot-1", sit.PodState.RUNNING), [],
         sit.Verdict("True", api.REASON_POD_RUNNING, "pod minimal-1 is running on node spot-1")),
    ],
)
def test_ready(situation: sit.Situation, before: list[dict[str, Any]],
               want: sit.Verdict | None) -> None:
    assert sit.ready(sit.Seen(situation, before)) == want


def test_suspended_is_set_once_when_running_and_flips_on_resume() -> None:
    running = sit.PodObserved("minimal-1", "spot-1", sit.PodState.RUNNING)
    assert sit.suspended(sit.Seen(running)) == sit.Verdict(
        "False", api.REASON_NOT_SUSPENDED, "spec.suspend is false")
    was_false = [{**cond("False"), "type": api.COND_SUSPENDED}]
    assert sit.suspended(sit.Seen(running, was_false)) is None
    was_true = [{**cond("True"), "type": api.COND_SUSPENDED}]
    assert sit.suspended(sit.Seen(running, was_true)) == sit.Verdict(
        "False", api.REASON_RESUMED, "spec.suspend is false")
    assert sit.suspended(sit.Seen(sit.SpecInvalid("bad"), was_true)) is None


def test_new_conditions_keep_their_order_and_old_ones_their_place() -> None:
    creating = sit.Seen(sit.PodCreating("minimal-1", "c1"))
    assert [c["type"] for c in sit.conditions(creating, 1, NOW)] == [
        api.COND_ACCEPTED, api.COND_SUSPENDED, api.COND_READY, api.COND_RESTORING]
    waiting = sit.Seen(sit.ForkBlocked(api.REASON_CHECKPOINT_IN_PROGRESS, "waiting"))
    assert [c["type"] for c in sit.conditions(waiting, 1, NOW)] == [
        api.COND_ACCEPTED, api.COND_SUSPENDED, api.COND_RESTORING, api.COND_READY]
    before = [{**cond("False"), "type": api.COND_READY}]
    out = sit.conditions(sit.Seen(sit.PodTerminating("minimal-1"), before), 3, NOW)
    assert [c["type"] for c in out] == [api.COND_READY, api.COND_ACCEPTED, api.COND_SUSPENDED]
    assert out[0]["lastTransitionTime"] == "2026-01-01T10:00:00Z"  # no flip
    assert out[0]["observedGeneration"] == 3


class RefusingKube(FakeKube):
    def create_pod(self, manifest: dict[str, Any]) -> dict[str, Any]:
        raise InvalidSpec(f"the API rejected pod {manifest['metadata']['name']}: nope")


def test_a_pod_the_api_refuses_is_recorded_as_an_invalid_spec() -> None:
    sandbox: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    sandbox["metadata"].update(namespace="ns", uid="u-1", generation=2)
    kube, events = RefusingKube(sandbox), list[Event]()
    with pytest.raises(InvalidSpec, match="the API rejected pod minimal-1"):
        driver.reconcile_sandbox(kube, OperatorSettings(), "ns", "minimal",  # type: ignore[arg-type]
                                 lambda _sb, e: events.append(e), now=lambda: NOW)
    status = kube.sandbox["status"]
    accepted = get_condition(status["conditions"], api.COND_ACCEPTED) or {}
    assert (accepted["status"], accepted["reason"], accepted["observedGeneration"]) == (
        "False", api.REASON_INVALID_SPEC, 2)
    assert (status["phase"], status["incarnation"], status.get("podName")) == ("Failed", 0, None)
    assert [(e.type, e.reason) for e in events] == [("Warning", api.REASON_INVALID_SPEC)]
