"""Spot placement with a fallback to on-demand nodes: pure plan() tests.

A sandbox that requires spot nodes gets pods labelled hermit.dev/capacity=spot. While no
node takes its pod, Ready says why (WaitingForSpotCapacity, with the scheduler's message and
when the fallback comes). Once spec.placement.fallbackToOnDemandAfterSeconds has passed
since the pod was created, the pod is replaced by one that asks for an on-demand node and
restores the same checkpoint; status.capacity says on-demand. The next new pod (a resume, a
move, a retry, a loss) asks for spot again.
"""

from __future__ import annotations

import copy
from datetime import datetime, timedelta
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_operator import placement
from hermit_operator import situations as sit
from hermit_operator.reconcile import Plan, plan
from tests.support.operator_objects import NOW, SETTINGS, after, ckpt, cond
from tests.support.operator_objects import sandbox as make_sandbox

Obj = dict[str, Any]

FALLBACK = 60
SCHEDULER = ("0/3 nodes are available: 1 node(s) had untolerated taint "
             "{hermit.dev/interruption: }, 2 node(s) didn't match Pod's node affinity/selector.")


def sandbox(fallback: int | None = FALLBACK, **spec: Any) -> Obj:
    placement_spec: Obj = {"spot": True}
    if fallback is not None:
        placement_spec["fallbackToOnDemandAfterSeconds"] = fallback
    return make_sandbox(None, placement=placement_spec, **spec)


def created(manifest: Obj | None, at: datetime, **status: Any) -> Obj:
    """The pod the API server holds for a manifest the plan created."""
    assert manifest is not None
    pod = copy.deepcopy(manifest)
    pod["metadata"]["creationTimestamp"] = protocol.rfc3339(at)
    pod["status"] = {"phase": "Pending", **status}
    return pod


def unschedulable(manifest: Obj | None, at: datetime) -> Obj:
    return created(manifest, at, conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": SCHEDULER}])


def running(manifest: Obj | None, at: datetime, node: str) -> Obj:
    """Bound, running and ready; a restore pod has restored."""
    pod = created(manifest, at, phase="Running", conditions=[{"type": "Ready", "status": "True"}])
    pod["spec"]["nodeName"] = node
    annotations = pod["metadata"]["annotations"]
    if protocol.ANNOTATION_RESTORE_FROM in annotations:
        annotations[protocol.ANNOTATION_RESTORE_PHASE] = protocol.RESTORED
    return pod


def capacity(p: Plan) -> str | None:
    assert p.create_pod is not None
    return p.create_pod["metadata"]["labels"].get(protocol.LABEL_CAPACITY)


def restore_source(p: Plan) -> str | None:
    assert p.create_pod is not None
    return p.create_pod["metadata"]["annotations"].get(protocol.ANNOTATION_RESTORE_FROM)


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def preempted(fallback: int | None = FALLBACK) -> tuple[Obj, Plan, list[Obj]]:
    """A sandbox that ran on spot-1 until a Preemption checkpoint moved it: the plan that
    creates its restore pod minimal-2, and the checkpoints."""
    sb = sandbox(fallback)
    first = plan(sb, None, NOW, settings=SETTINGS)
    assert capacity(first) == "spot" and first.status_patch["capacity"] == "spot"
    sb = after(first, sb)
    pod1 = running(first.create_pod, NOW, "spot-1")
    sb = after(plan(sb, pod1, at(5), settings=SETTINGS), sb)
    ckpts = [ckpt("minimal-1-preempt", "Preemption", created="12:01:00", node="spot-1")]
    move = plan(sb, pod1, at(70), settings=SETTINGS, checkpoints=ckpts)
    assert move.delete_pod == "minimal-1" and restore_source(move) == "minimal-1-preempt"
    assert capacity(move) == "spot"
    return after(move, sb), move, ckpts


# -- placement.py ---------------------------------------------------------------------------

def test_unschedulable_needs_the_scheduler_to_have_said_so() -> None:
    manifest = plan(sandbox(), None, NOW, settings=SETTINGS).create_pod
    assert placement.unschedulable(unschedulable(manifest, NOW)) == SCHEDULER
    assert placement.unschedulable(created(manifest, NOW)) is None  # not tried yet
    bound = unschedulable(manifest, NOW)
    bound["spec"]["nodeName"] = "spot-3"
    assert placement.unschedulable(bound) is None
    assert placement.unschedulable(running(manifest, NOW, "spot-1")) is None
    gated = created(manifest, NOW, conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}])
    assert placement.unschedulable(gated) is None
    quiet = created(manifest, NOW, conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}])
    assert placement.unschedulable(quiet) == "no node fits the pod"


def test_unplaced_falls_back_at_creation_plus_the_setting_for_spot_pods_only() -> None:
    sb = sandbox()
    spot = unschedulable(plan(sb, None, NOW, settings=SETTINGS).create_pod, at(3))
    u = placement.unplaced(sb, spot)
    assert u == placement.Unplaced("minimal-1", SCHEDULER, "spot", at(3 + FALLBACK))
    assert not u.due(at(3 + FALLBACK - 1)) and u.due(at(3 + FALLBACK))
    never = placement.unplaced(sandbox(None), spot)
    assert never is not None and never.fallback_at is None and not never.due(at(10**6))
    on_demand = copy.deepcopy(spot)
    on_demand["metadata"]["labels"][protocol.LABEL_CAPACITY] = "on-demand"
    assert placement.unplaced(sb, on_demand) == placement.Unplaced(
        "minimal-1", SCHEDULER, "on-demand", None)


# -- waiting for spot capacity --------------------------------------------------------------

def test_a_spot_pod_no_node_takes_says_why_and_when_it_falls_back() -> None:
    sb = sandbox()
    first = plan(sb, None, NOW, settings=SETTINGS)
    sb = after(first, sb)
    p = plan(sb, unschedulable(first.create_pod, NOW), at(30), settings=SETTINGS)
    assert p.create_pod is None and p.delete_pod is None and p.events == ()
    ready = cond(p, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "WaitingForSpotCapacity")
    assert SCHEDULER in ready["message"]
    assert "moves to an on-demand node at 2026-01-01T12:01:00Z" in ready["message"]
    assert (p.status_patch["phase"], p.status_patch["capacity"]) == ("Pending", "spot")
    assert p.requeue_after == 30.0  # looked at again when the fallback is due: 12:01:00


def test_without_the_setting_a_spot_pod_waits_for_spot_for_ever() -> None:
    sb = sandbox(None)
    first = plan(sb, None, NOW, settings=SETTINGS)
    sb = after(first, sb)
    p = plan(sb, unschedulable(first.create_pod, NOW), at(86400), settings=SETTINGS)
    assert p.create_pod is None and p.delete_pod is None
    assert cond(p, "Ready")["reason"] == "WaitingForSpotCapacity"
    assert "fallbackToOnDemandAfterSeconds is not set" in cond(p, "Ready")["message"]
    assert p.requeue_after is None  # nothing timed: the scheduler's events bring it back


def test_a_node_that_appears_takes_the_waiting_pod_and_nothing_moves() -> None:
    sb = sandbox()
    first = plan(sb, None, NOW, settings=SETTINGS)
    sb = after(first, sb)
    sb = after(plan(sb, unschedulable(first.create_pod, NOW), at(30), settings=SETTINGS), sb)
    p = plan(sb, running(first.create_pod, NOW, "spot-9"), at(40), settings=SETTINGS)
    assert p.create_pod is None and p.delete_pod is None
    assert (cond(p, "Ready")["reason"], p.status_patch["nodeName"]) == ("PodRunning", "spot-9")
    assert p.status_patch["capacity"] == "spot"
    assert p.requeue_after is None


# -- the fallback ---------------------------------------------------------------------------

def test_a_preemption_replacement_no_spot_node_takes_restores_on_demand() -> None:
    sb, move, ckpts = preempted()
    record = move.status_patch["restoredFrom"]
    waiting = unschedulable(move.create_pod, at(70))
    early = plan(sb, waiting, at(70 + FALLBACK - 1), settings=SETTINGS, checkpoints=ckpts)
    assert early.create_pod is None and early.delete_pod is None
    assert cond(early, "Ready")["reason"] == "WaitingForSpotCapacity"
    assert early.status_patch["phase"] == "Migrating"  # still moving: Ready says why it waits
    due = plan(sb, waiting, at(70 + FALLBACK), settings=SETTINGS, checkpoints=ckpts)
    assert due.delete_pod == "minimal-2"
    assert due.create_pod is not None and due.create_pod["metadata"]["name"] == "minimal-3"
    assert restore_source(due) == "minimal-1-preempt"  # the same checkpoint, never older
    assert capacity(due) == "on-demand"
    s = due.status_patch
    assert (s["incarnation"], s["podName"], s["capacity"]) == (3, "minimal-3", "on-demand")
    assert s["restoredFrom"] == record  # staleSeconds 0: nothing was lost
    assert s["restores"] == 0 and s["phase"] == "Migrating"
    assert (cond(due, "Ready")["reason"], cond(due, "Restoring")["status"],
            cond(due, "Migrating")["status"]) == ("OnDemandFallback", "True", "True")
    assert "no spot node took pod minimal-2 within 60s" in cond(due, "Ready")["message"]
    assert "on an on-demand node" in cond(due, "Restoring")["message"]
    assert [(e.type, e.reason) for e in due.events] == [("Warning", "OnDemandFallback")]
    assert "restores checkpoint minimal-1-preempt" in due.events[0].message
    assert "minimal-1-preempt" not in due.delete_checkpoints
    # Applied twice before the status lands: the same pod.
    assert plan(sb, waiting, at(70 + FALLBACK), settings=SETTINGS,
                checkpoints=ckpts).create_pod == due.create_pod
    # It restores on the on-demand node: Running, one restore, capacity on-demand.
    sb = after(due, sb)
    up = plan(sb, running(due.create_pod, at(131), "ondemand-1"), at(140), settings=SETTINGS,
              checkpoints=ckpts)
    assert (up.status_patch["phase"], up.status_patch["restores"],
            up.status_patch["capacity"]) == ("Running", 1, "on-demand")
    assert cond(up, "Migrating")["status"] == "False"


def test_a_fresh_pod_falls_back_fresh_and_zero_means_at_once() -> None:
    sb = sandbox(0)
    first = plan(sb, None, NOW, settings=SETTINGS)
    sb = after(first, sb)
    assert plan(sb, created(first.create_pod, NOW), at(30), settings=SETTINGS).create_pod is None
    p = plan(sb, unschedulable(first.create_pod, NOW), NOW, settings=SETTINGS)
    assert p.delete_pod == "minimal-1" and capacity(p) == "on-demand"
    assert restore_source(p) is None and "restoredFrom" not in p.status_patch
    assert cond(p, "Ready")["reason"] == "OnDemandFallback"
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "OnDemandFallback")]


def test_an_on_demand_pod_no_node_takes_waits_and_says_so() -> None:
    sb, move, ckpts = preempted()
    due = plan(sb, unschedulable(move.create_pod, at(70)), at(200), settings=SETTINGS,
               checkpoints=ckpts)
    sb = after(due, sb)
    p = plan(sb, unschedulable(due.create_pod, at(200)), at(10_000), settings=SETTINGS,
             checkpoints=ckpts)
    assert p.create_pod is None and p.delete_pod is None
    ready = cond(p, "Ready")
    assert ready["reason"] == "Unschedulable" and "asks for an on-demand node" in ready["message"]
    assert SCHEDULER in ready["message"] and p.status_patch["capacity"] == "on-demand"
    assert p.requeue_after is None


def test_no_fallback_for_a_sandbox_that_does_not_require_spot() -> None:
    sb = make_sandbox(None, placement={"spot": False})
    first = plan(sb, None, NOW, settings=SETTINGS)
    assert "capacity" not in first.status_patch
    sb = after(first, sb)
    p = plan(sb, unschedulable(first.create_pod, NOW), at(10_000), settings=SETTINGS)
    assert p.create_pod is None and cond(p, "Ready")["reason"] == "Unschedulable"
    assert "capacity" not in p.status_patch


# -- the next pod asks for spot again --------------------------------------------------------

def on_demand_and_running() -> tuple[Obj, Obj, list[Obj]]:
    """After a fallback: restored and running on ondemand-1 (incarnation 3)."""
    sb, move, ckpts = preempted()
    due = plan(sb, unschedulable(move.create_pod, at(70)), at(200), settings=SETTINGS,
               checkpoints=ckpts)
    sb = after(due, sb)
    pod = running(due.create_pod, at(200), "ondemand-1")
    return after(plan(sb, pod, at(210), settings=SETTINGS, checkpoints=ckpts), sb), pod, ckpts


def test_a_resume_after_a_fallback_asks_for_spot_again() -> None:
    sb, pod, ckpts = on_demand_and_running()
    assert sb["status"]["capacity"] == "on-demand"
    sb["spec"]["suspend"] = True
    ckpts = [*ckpts, ckpt("minimal-3-suspend", "Suspend", created="12:05:00", node="ondemand-1")]
    released = plan(sb, pod, at(320), settings=SETTINGS, checkpoints=ckpts)
    assert released.delete_pod == "minimal-3" and released.status_patch["capacity"] is None
    sb = after(released, sb)
    assert "capacity" not in sb["status"]
    sb["spec"]["suspend"] = False
    resumed = plan(sb, None, at(400), settings=SETTINGS, checkpoints=ckpts)
    assert restore_source(resumed) == "minimal-3-suspend"
    assert capacity(resumed) == "spot" and resumed.status_patch["capacity"] == "spot"


@pytest.mark.parametrize("reason", ["Eviction", "Preemption"])
def test_a_move_of_an_on_demand_pod_asks_for_spot_again(reason: str) -> None:
    sb, pod, ckpts = on_demand_and_running()
    ckpts = [*ckpts, ckpt("minimal-3-evict", reason, created="12:05:00", node="ondemand-1")]
    moved = plan(sb, pod, at(320), settings=SETTINGS, checkpoints=ckpts)
    assert moved.delete_pod == "minimal-3" and restore_source(moved) == "minimal-3-evict"
    assert capacity(moved) == "spot"


def test_a_lost_on_demand_pod_is_replaced_on_spot() -> None:
    sb, _pod, ckpts = on_demand_and_running()
    p = plan(sb, None, at(320), settings=SETTINGS, checkpoints=ckpts)
    assert restore_source(p) == "minimal-1-preempt" and capacity(p) == "spot"


# -- the conditions, the schema ----------------------------------------------------

def test_ready_verdicts_for_a_pod_no_node_takes() -> None:
    def ready(u: placement.Unplaced) -> sit.Verdict | None:
        return sit.ready(sit.Seen(sit.PodObserved("p-2", None, sit.PodState.PENDING, "x",
                                                  unplaced=u)))

    assert ready(placement.Unplaced("p-2", "0/1 nodes", "spot", NOW)) == sit.Verdict(
        "False", api.REASON_WAITING_FOR_SPOT,
        "no spot node can take pod p-2: 0/1 nodes; it moves to an on-demand node at "
        "2026-01-01T12:00:00Z (spec.placement.fallbackToOnDemandAfterSeconds) unless a spot "
        "node takes it first")
    assert ready(placement.Unplaced("p-2", "0/1 nodes", None)) == sit.Verdict(
        "False", api.REASON_UNSCHEDULABLE, "no node can take pod p-2: 0/1 nodes")
    creating = sit.Seen(sit.PodCreating("p-3", on_demand="why"))
    assert sit.ready(creating) == sit.Verdict("False", api.REASON_ON_DEMAND_FALLBACK, "why")


def test_the_status_fits_the_crd_schema() -> None:
    from tests.support.crds import schema_errors

    sb, move, ckpts = preempted()
    due = plan(sb, unschedulable(move.create_pod, at(70)), at(200), settings=SETTINGS,
               checkpoints=ckpts)
    for p in (move, due):
        doc = after(p, sb)
        doc.update(apiVersion=api.API_VERSION, kind=api.SANDBOX_KIND)
        assert schema_errors(doc) == []
