"""Upgrades that cannot lose work (issue 21): a checkpoint records the format level it is
written in (protocol.CHECKPOINT_FORMAT_LEVEL, status.formatLevel), a ready node-agent labels
its node with the level it reads (protocol.LABEL_CHECKPOINT_FORMAT), and a pod that restores
a checkpoint of level L > 1 requires a node labelled with more than L - 1, so an older
node-agent (no label) never gets it, refuses it and makes the operator fall back to an older
checkpoint. Pure pieces and plan() tests."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_operator import checkpoints as ck
from hermit_operator import overlap, placement, podspec
from hermit_operator import situations as sit
from hermit_operator.reconcile import Plan, plan
from tests.support.operator_objects import NOW, RUNNING, SETTINGS, after, ckpt, cond, pod
from tests.support.operator_objects import sandbox as make_sandbox

Obj = dict[str, Any]
LEVEL = protocol.CHECKPOINT_FORMAT_LEVEL
GT_1 = {"key": "hermit.dev/checkpoint-format", "operator": "Gt", "values": ["1"]}
READY = {protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY}
PREEMPT = "minimal-1-preempt"


def leveled(c: Obj, level: int | None = LEVEL) -> Obj:
    """``c`` as a node-agent of ``level`` records it (None: a release from before levels)."""
    if level is not None:
        c["status"]["formatLevel"] = level
    return c


def terms(p: Obj) -> list[Obj]:
    return list(p["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"])


def matches(expr: Obj, labels: dict[str, str]) -> bool:
    """One node selector requirement as Kubernetes evaluates it (Gt: the label exists and
    its value, parsed as an integer, is greater)."""
    value = labels.get(expr["key"])
    if expr["operator"] == "In":
        return value in expr["values"]
    if expr["operator"] == "NotIn":
        return value not in expr["values"]
    if expr["operator"] == "Gt":
        try:
            return value is not None and int(value) > int(expr["values"][0])
        except ValueError:
            return False
    raise AssertionError(expr)


def schedules_on(p: Obj, labels: dict[str, str]) -> bool:
    return any(t.get("matchExpressions") and all(matches(e, labels)
                                                 for e in t["matchExpressions"])
               for t in terms(p))


def created_pod(p: Plan) -> Obj:
    assert p.create_pod is not None
    return p.create_pod


# -- the constants the lead's upgrade e2e test asserts on ----------------------------------

def test_the_names_and_the_level() -> None:
    assert protocol.CHECKPOINT_FORMAT_LEVEL == 2
    assert protocol.LABEL_CHECKPOINT_FORMAT == "hermit.dev/checkpoint-format"
    assert str(protocol.MAX_FORMAT_LEVEL - 1).isdigit()


@pytest.mark.parametrize(("value", "level"), [
    (None, None), (1, 1), (2, 2), (7, 7), (0, None), (-2, None), (True, None), ("2", None),
    (2.0, None), (protocol.MAX_FORMAT_LEVEL, protocol.MAX_FORMAT_LEVEL),
    (protocol.MAX_FORMAT_LEVEL + 1, None)])
def test_the_level_of_a_checkpoint(value: object, level: int | None) -> None:
    status = {} if value is None else {"formatLevel": value}
    assert protocol.format_level_of({"status": status}) == level
    assert protocol.format_level_of({}) is None


# -- level -> node affinity ------------------------------------------------------------------

def test_only_a_level_above_one_requires_anything() -> None:
    assert podspec.format_requirement(None) is None
    assert podspec.format_requirement(1) is None
    assert podspec.format_requirement(2) == GT_1
    assert podspec.format_requirement(5) == {**GT_1, "values": ["4"]}


def build(level: int | None, restore_from: str | None = "c1", **kwargs: Any) -> Obj:
    return podspec.build_sandbox_pod(make_sandbox(None), SETTINGS, 2, restore_from,
                                     format_level=level, **kwargs)


@pytest.mark.parametrize("on_demand", [False, True])
def test_every_term_of_a_restore_of_level_two_requires_a_node_that_reads_it(
        on_demand: bool) -> None:
    sb = make_sandbox(None, placement={"spot": True, "fallbackToOnDemandAfterSeconds": 60})
    plain = podspec.build_sandbox_pod(copy.deepcopy(sb), SETTINGS, 2, "c1", on_demand=on_demand)
    p = podspec.build_sandbox_pod(sb, SETTINGS, 2, "c1", on_demand=on_demand, format_level=2)
    assert [t["matchExpressions"] for t in terms(p)] == [
        [*t["matchExpressions"], GT_1] for t in terms(plain)]
    assert podspec.required_format_level(p) == 2
    assert podspec.required_format_level(plain) is None
    node = {"karpenter.sh/capacity-type": "on-demand" if on_demand else "spot", **READY}
    assert schedules_on(plain, node)
    assert not schedules_on(p, node)  # an old node-agent: no label
    for readable in ("2", "3", "10"):
        assert schedules_on(p, {**node, protocol.LABEL_CHECKPOINT_FORMAT: readable})
    for unreadable in ("1", "0", "x"):
        assert not schedules_on(p, {**node, protocol.LABEL_CHECKPOINT_FORMAT: unreadable})


def test_the_requirement_is_the_only_term_when_nothing_else_places_the_pod() -> None:
    sb = make_sandbox(None, placement={"spot": False})
    loose = podspec.build_sandbox_pod(
        sb, SETTINGS.__class__(require_ready_node_agent=False), 2, "c1", format_level=3)
    assert terms(loose) == [{"matchExpressions": [{**GT_1, "values": ["2"]}]}]
    assert podspec.required_format_level(loose) == 3


def test_no_requirement_for_level_one_an_unknown_level_or_a_fresh_pod() -> None:
    for p in (build(None), build(1), build(2, restore_from=None)):
        assert protocol.LABEL_CHECKPOINT_FORMAT not in repr(p["spec"].get("affinity"))
        assert podspec.required_format_level(p) is None


# -- the status records keep the level ------------------------------------------------------

def test_the_records_keep_the_level_and_a_stand_in_carries_it() -> None:
    c = leveled(ckpt("c1"))
    record = ck.restore_record(c, NOW, clean=False)
    assert record["formatLevel"] == LEVEL
    assert ck.last_checkpoint_status(c)["formatLevel"] == LEVEL
    stand_in = ck.as_checkpoint(record)
    assert protocol.format_level_of(stand_in) == LEVEL
    assert ck.restore_level(None, record) == LEVEL
    assert ck.restore_level(c, {}) == LEVEL
    # A checkpoint of an older release: no level anywhere, no requirement.
    old = ckpt("c0")
    assert "formatLevel" not in ck.restore_record(old, NOW, clean=False)
    assert "formatLevel" not in ck.last_checkpoint_status(old)
    assert ck.restore_level(old, {"formatLevel": 2}) is None  # the object decides
    assert ck.restore_level(None, {"name": "c0"}) is None


# -- plans ----------------------------------------------------------------------------------

def test_a_move_restores_a_new_checkpoint_only_where_it_can_be_read() -> None:
    sb = make_sandbox(dict(RUNNING))
    stop = leveled(ckpt(PREEMPT, "Preemption", created="11:59:50", done="11:59:55"))
    stop["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    move = plan(sb, pod(phase="Failed"), NOW, settings=SETTINGS.__class__(overlap_moves=False),
                checkpoints=[stop])
    made = created_pod(move)
    assert overlap.source_of(made) == PREEMPT
    assert all(GT_1 in t["matchExpressions"] for t in terms(made))
    assert move.status_patch["restoredFrom"]["formatLevel"] == LEVEL
    # An older release's checkpoint: placed as before.
    old = ckpt(PREEMPT, "Preemption", created="11:59:50", done="11:59:55")
    old["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    before = plan(sb, pod(phase="Failed"), NOW,
                  settings=SETTINGS.__class__(overlap_moves=False), checkpoints=[old])
    assert podspec.required_format_level(created_pod(before)) is None
    assert "formatLevel" not in before.status_patch["restoredFrom"]


def test_a_lost_pod_whose_checkpoint_object_is_gone_still_asks_for_its_level() -> None:
    last = {"name": "c9", "reason": "Interval", "time": "2026-01-01T11:00:00Z",
            "formatLevel": LEVEL}
    sb = make_sandbox(dict(RUNNING, lastCheckpoint=last))
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[])
    made = created_pod(p)
    assert overlap.source_of(made) == "c9"
    assert podspec.required_format_level(made) == LEVEL
    assert p.status_patch["restoredFrom"]["formatLevel"] == LEVEL


def stop(phase: str, level: int | None = LEVEL, **kw: Any) -> Obj:
    c = ckpt(PREEMPT, "Preemption", phase, created="11:59:50", **kw)
    c["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    return leveled(c, level) if phase != "Pending" else c


def test_a_replacement_waits_for_the_node_agent_to_say_the_format_then_requires_it() -> None:
    sb = make_sandbox(dict(RUNNING))
    pending = ckpt(PREEMPT, "Preemption", None, created="11:59:50")
    pending["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    early = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[pending])
    assert early.create_pod is None  # unclaimed: the level is not known yet
    claimed = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[stop("Dumping")])
    made = copy.deepcopy(created_pod(claimed))
    assert podspec.required_format_level(made) == LEVEL
    # Completed: the replacement asks for what the plan would, and is adopted.
    made["spec"]["nodeName"] = "spot-2"
    made["status"] = {"phase": "Running"}
    done = stop("Completed", done="11:59:55")
    moved = plan(after(claimed, sb), pod(phase="Failed"), NOW, settings=SETTINGS,
                 checkpoints=[done], replacement=made)
    assert moved.create_pod is None and moved.delete_replacement is None
    assert moved.status_patch["podName"] == "minimal-2"
    assert moved.status_patch["restoredFrom"]["formatLevel"] == LEVEL
    # A node-agent of an older release took it: no level, no requirement, adopted too.
    old = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[stop("Dumping", None)])
    assert podspec.required_format_level(created_pod(old)) is None


def test_a_replacement_without_the_requirement_is_not_adopted_for_a_new_checkpoint() -> None:
    """Made by an older operator (no requirement): it may sit on a node an old node-agent
    serves, so it goes, and the next plan creates the pod that asks for the level."""
    sb = make_sandbox(dict(RUNNING))
    claimed = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[stop("Dumping", None)])
    unconstrained = copy.deepcopy(created_pod(claimed))
    wanted = copy.deepcopy(created_pod(plan(sb, pod(), NOW, settings=SETTINGS,
                                            checkpoints=[stop("Dumping")])))
    assert overlap.adoptable(wanted, wanted)
    assert not overlap.adoptable(unconstrained, wanted)
    assert not overlap.adoptable(wanted, unconstrained)
    done = stop("Completed", done="11:59:55")
    moved = plan(after(claimed, sb), pod(phase="Failed"), NOW, settings=SETTINGS,
                 checkpoints=[done], replacement=unconstrained)
    assert moved.delete_replacement == "minimal-2" and moved.create_pod is None


def test_a_pod_waiting_for_an_upgraded_node_says_so() -> None:
    p = build(LEVEL)
    p["metadata"]["creationTimestamp"] = "2026-01-01T11:59:00Z"
    p["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity"}]}
    u = placement.unplaced(make_sandbox(None), p)
    assert u is not None and u.format_level == LEVEL
    verdict = sit.ready(sit.Seen(sit.PodObserved(u.pod, None, sit.PodState.PENDING, "x",
                                                 unplaced=u)))
    assert verdict is not None and verdict.reason == api.REASON_WAITING_FOR_SPOT
    assert verdict.message.startswith(
        "waiting for a node whose node-agent reads checkpoint format 2 (pod minimal-2 "
        "restores a checkpoint of that format; a node-agent labels its node "
        "hermit.dev/checkpoint-format with the format it reads: is the node-agent DaemonSet "
        "being rolled out?); no spot node can take pod minimal-2: 0/3 nodes")
    # Without a level: as before.
    fresh = copy.deepcopy(p)
    fresh["spec"]["affinity"] = build(None)["spec"]["affinity"]
    plain = placement.unplaced(make_sandbox(None), fresh)
    assert plain is not None and plain.format_level is None


def test_a_plan_reports_the_wait_in_the_ready_condition() -> None:
    last = {"name": "c9", "reason": "Interval", "time": "2026-01-01T11:00:00Z",
            "formatLevel": LEVEL}
    sb = make_sandbox(dict(RUNNING, lastCheckpoint=last))
    first = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[])
    waiting = copy.deepcopy(created_pod(first))
    waiting["metadata"]["creationTimestamp"] = "2026-01-01T12:00:00Z"
    waiting["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/2 nodes are available"}]}
    p = plan(after(first, sb), waiting, NOW, settings=SETTINGS, checkpoints=[])
    assert p.create_pod is None and p.delete_pod is None
    assert "reads checkpoint format 2" in cond(p, "Ready")["message"]


def test_the_records_fit_the_crd_schema() -> None:
    from tests.support.crds import schema_errors

    last = {"name": "c9", "reason": "Interval", "time": "2026-01-01T11:00:00Z",
            "formatLevel": LEVEL}
    sb = make_sandbox(dict(RUNNING, lastCheckpoint=last))
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[leveled(ckpt("c9"))])
    doc = after(p, sb)
    doc.update(apiVersion=api.API_VERSION, kind=api.SANDBOX_KIND)
    assert doc["status"]["lastCheckpoint"]["formatLevel"] == LEVEL
    assert doc["status"]["restoredFrom"]["formatLevel"] == LEVEL
    assert schema_errors(doc) == []
    doc["status"]["restoredFrom"]["formatLevel"] = 0
    assert schema_errors(doc) != []
