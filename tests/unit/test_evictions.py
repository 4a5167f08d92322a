"""Evictions allowed, terminations held (docs/protocol.md, "Evictions"): the pure decisions.

The operator builds every sandbox pod with a preStop hook that sleeps for the pod's grace
period (cut short by the operator's own deletes), the cluster autoscaler's safe-to-evict
annotation and a grace period long enough for a checkpoint, and makes no blocking
PodDisruptionBudget (unless asked to, or for a pod made without the hold). The node-agent
saves a held pod that is being deleted with a stopping checkpoint of its incarnation (an
Eviction one when there is none) and does nothing for pods with nothing to save.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_node.control import planner
from hermit_operator import podspec
from hermit_operator.reconcile import plan
from tests.support.node_agent import FakeEngine, FakeKube, make_agent
from tests.support.node_agent import pod as node_pod
from tests.support.operator_objects import NOW, RUNNING, SETTINGS, ckpt, pod
from tests.support.operator_objects import sandbox as make_sandbox

# -- the operator: the pod and the budget ------------------------------------------------


def held_pod(**kwargs: Any) -> dict[str, Any]:
    """A sandbox pod as this operator builds it: under the termination hold."""
    p = pod(**kwargs)
    p["metadata"]["annotations"][protocol.ANNOTATION_HOLD] = "true"
    return p


def test_the_pod_carries_the_hook_the_annotations_and_a_checkpoint_long_grace() -> None:
    pod_ = podspec.build_sandbox_pod(make_sandbox(), SETTINGS, 4, None)
    main = pod_["spec"]["containers"][0]
    # A sleep, no httpGet: the baseline Pod Security Standard refuses a hook's host.
    assert main["lifecycle"]["preStop"] == {"sleep": {"seconds": 120}}
    annotations = pod_["metadata"]["annotations"]
    assert annotations[protocol.ANNOTATION_SAFE_TO_EVICT] == "true"
    assert annotations[protocol.ANNOTATION_HOLD] == "true"
    assert pod_["spec"]["terminationGracePeriodSeconds"] == 120
    assert podspec.holds_termination(pod_)
    longer = dataclasses.replace(SETTINGS, termination_grace_seconds=300)
    pod_ = podspec.build_sandbox_pod(make_sandbox(), longer, 4, None)
    assert pod_["spec"]["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] == 300
    assert pod_["spec"]["terminationGracePeriodSeconds"] == 300


def test_without_the_hold_the_pod_is_as_before() -> None:
    off = dataclasses.replace(SETTINGS, termination_hold=False)
    pod_ = podspec.build_sandbox_pod(make_sandbox(), off, 1, None)
    assert "lifecycle" not in pod_["spec"]["containers"][0]
    assert protocol.ANNOTATION_SAFE_TO_EVICT not in pod_["metadata"]["annotations"]
    assert protocol.ANNOTATION_HOLD not in pod_["metadata"]["annotations"]
    assert pod_["spec"]["terminationGracePeriodSeconds"] == podspec.TERMINATION_GRACE_SECONDS
    assert not podspec.holds_termination(pod_)


def test_the_hold_annotation_is_never_copied_from_the_template() -> None:
    sb = make_sandbox()
    sb["spec"]["podTemplate"]["metadata"] = {"annotations": {protocol.ANNOTATION_HOLD: "true"}}
    sb["spec"]["podTemplate"]["spec"]["containers"][0]["lifecycle"] = {
        "preStop": {"exec": {"command": ["flush"]}}}
    pod_ = podspec.build_sandbox_pod(sb, SETTINGS, 1, None)
    assert protocol.ANNOTATION_HOLD not in pod_["metadata"]["annotations"]


def test_the_templates_own_prestop_hook_and_annotation_and_grace_win() -> None:
    sb = make_sandbox(checkpoint={"onPreemption": True})
    main = sb["spec"]["podTemplate"]["spec"]["containers"][0]
    main["lifecycle"] = {"preStop": {"exec": {"command": ["flush"]}}}
    pod_ = podspec.build_sandbox_pod(sb, SETTINGS, 1, None)
    assert pod_["spec"]["containers"][0]["lifecycle"] == main["lifecycle"]
    assert not podspec.holds_termination(pod_)
    sb = make_sandbox()
    sb["spec"]["podTemplate"]["spec"]["terminationGracePeriodSeconds"] = 45
    sb["spec"]["podTemplate"]["metadata"] = {"annotations": {
        protocol.ANNOTATION_SAFE_TO_EVICT: "false"}}
    pod_ = podspec.build_sandbox_pod(sb, SETTINGS, 1, None)
    assert pod_["spec"]["terminationGracePeriodSeconds"] == 45
    assert pod_["spec"]["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] == 45
    assert pod_["metadata"]["annotations"][protocol.ANNOTATION_SAFE_TO_EVICT] == "false"


def test_a_sandbox_that_saves_nothing_on_a_drain_gets_no_hook() -> None:
    pod_ = podspec.build_sandbox_pod(make_sandbox(checkpoint={"onPreemption": False}),
                                     SETTINGS, 1, None)
    assert "lifecycle" not in pod_["spec"]["containers"][0]


def test_no_blocking_budget_by_default() -> None:
    p = plan(make_sandbox(), None, NOW, settings=SETTINGS)
    assert p.pdb is None and p.delete_pdb == "minimal"
    p = plan(make_sandbox(dict(RUNNING)), held_pod(), NOW, settings=SETTINGS)
    assert p.pdb is None and p.delete_pdb == "minimal"


def test_a_pod_without_the_hook_keeps_its_budget_until_it_is_replaced() -> None:
    # A pod an older operator made (or one with the template's own preStop hook): an
    # eviction would not wait for its checkpoint, so evictions stay refused.
    p = plan(make_sandbox(dict(RUNNING)), pod(), NOW, settings=SETTINGS)
    assert p.pdb is not None and p.pdb["spec"]["maxUnavailable"] == 0
    off = make_sandbox(dict(RUNNING), checkpoint={"onPreemption": False})
    assert plan(off, pod(), NOW, settings=SETTINGS).pdb is None


def test_the_opt_in_budget_is_made_for_every_sandbox() -> None:
    budget = dataclasses.replace(SETTINGS, disruption_budget=True)
    p = plan(make_sandbox(dict(RUNNING)), held_pod(), NOW, settings=budget)
    assert p.pdb is not None and p.delete_pdb is None


# -- the operator: an evicted pod is moved like any other --------------------------------


def evicted(pod_: dict[str, Any]) -> dict[str, Any]:
    pod_["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:50Z"
    pod_["metadata"]["deletionGracePeriodSeconds"] = 120
    return pod_


def eviction(phase: str = "Completed", **kwargs: Any) -> dict[str, Any]:
    c = ckpt("minimal-1-evict", "Eviction", phase, created="11:59:40", done="11:59:55",
             **kwargs)
    c["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    return c


def test_an_evicted_pod_whose_eviction_checkpoint_is_durable_moves_at_once() -> None:
    p = plan(make_sandbox(dict(RUNNING)), evicted(held_pod()), NOW, settings=SETTINGS,
             checkpoints=[eviction()])
    assert p.delete_pod == "minimal-1" and p.release_pod  # removed at once: its tree ended
    assert p.create_pod is not None and p.create_pod["metadata"]["name"] == "minimal-2"
    assert (p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM]
            == "minimal-1-evict")
    assert p.status_patch["restoredFrom"]["staleSeconds"] == 0  # nothing lost
    assert p.work_lost is None
    assert not any(e.type == "Warning" for e in p.events)


def test_an_evicted_pod_whose_checkpoint_failed_is_replaced_from_the_last_one_loudly() -> None:
    older = ckpt("c1", created="11:00:00")
    failed = eviction("Failed", message="upload failed: S3 unreachable")
    sb = make_sandbox(dict(RUNNING, lastCheckpoint={"name": "c1", "reason": "Interval"}))
    p = plan(sb, evicted(held_pod()), NOW, settings=SETTINGS, checkpoints=[older, failed])
    assert p.create_pod is None and p.delete_pod is None  # it ends first
    assert not p.release_pod
    assert ("Warning", api.REASON_CHECKPOINT_FAILED) in [(e.type, e.reason) for e in p.events]
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[older, failed])
    assert p.create_pod is not None
    assert (p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "c1")
    assert p.status_patch["restoredFrom"]["staleSeconds"] == 3600
    assert ("Warning", api.REASON_WORK_LOST) in [(e.type, e.reason) for e in p.events]
    assert p.work_lost == 3600  # hermit_operator_work_lost_seconds


# -- the node-agent: which pods being deleted it saves -----------------------------------

NODE = "spot-1"
SB_UID = "sb-uid"
WHEN = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def agent_pod(name: str = "box-2", *, deleting: bool = True, live: bool = True,
              hold: bool = True, restore_from: str | None = None,
              restore_phase: str | None = None, on_preemption: bool = True,
              uid: str = "pod-uid", grace: int = 90) -> planner.SandboxPod:
    annotations: dict[str, str] = {}
    if hold:
        annotations[protocol.ANNOTATION_HOLD] = "true"
    if restore_from:
        annotations[protocol.ANNOTATION_RESTORE_FROM] = restore_from
    if restore_phase:
        annotations[protocol.ANNOTATION_RESTORE_PHASE] = restore_phase
    if not on_preemption:
        annotations[protocol.ANNOTATION_ON_PREEMPTION] = "false"
    meta: dict[str, Any] = {
        "name": name, "namespace": "ns", "uid": uid, "annotations": annotations,
        "labels": {protocol.LABEL_SANDBOX: "box", protocol.LABEL_INCARNATION: "2"},
        "ownerReferences": [{"kind": api.SANDBOX_KIND, "uid": SB_UID, "name": "box"}]}
    if deleting:
        meta.update(deletionTimestamp="2026-01-01T11:59:59Z", deletionGracePeriodSeconds=grace)
    state = ({"running": {"startedAt": "2026-01-01T11:00:00Z"}} if live
             else {"terminated": {"exitCode": 0}})
    sp = planner.sandbox_pod({
        "metadata": meta, "spec": {"nodeName": NODE, "containers": [{"name": "main"}]},
        "status": {"phase": "Running", "containerStatuses": [
            {"name": "main", "containerID": "containerd://abc", "state": state}]}})
    assert sp is not None
    return sp


def box(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "box", "namespace": "ns", "uid": SB_UID}, "spec": spec}


def request(reason: str = protocol.EVICTION, phase: str | None = None, *,
            incarnation: int = 2, name: str = "box-2-evict") -> dict[str, Any]:
    c = protocol.checkpoint_object("box", name, reason, incarnation, namespace="ns", node=NODE)
    if phase:
        c["status"] = {"phase": phase, "completedAt": "2026-01-01T11:59:00Z"}
    return c


def test_only_a_held_pod_being_deleted_with_its_tree_running_is_held() -> None:
    sp = agent_pod()
    assert sp.terminating and sp.container_live and sp.hold and not sp.running
    assert planner.holds(sp)
    assert not planner.holds(agent_pod(deleting=False))  # not being deleted
    assert not planner.holds(agent_pod(hold=False))  # made without the hook (a budget)
    assert not planner.holds(agent_pod(live=False))  # its tree ended (a move's delete)
    assert not planner.holds(agent_pod(restore_from="box-1-evict"))  # waits for a restore
    assert planner.holds(agent_pod(restore_from="box-1-evict", restore_phase="Restored"))


def test_a_force_deleted_pod_is_not_held_and_gets_no_request() -> None:
    """A delete with a grace period of 0 shows the pod with its deletionTimestamp for an
    instant before the API removes it (no preStop hook runs): a request made then was
    never served, and the sandbox waited 300 s for it (CI, the fault suite)."""
    sp = agent_pod(grace=0)
    assert sp.terminating and sp.forced and sp.container_live and sp.hold
    assert not planner.holds(sp) and not planner.held_tree(sp)
    assert planner.hold_requests([sp], {sp.uid}, []) == []
    assert planner.current_pods([sp], {sp.uid}) == {}
    assert not agent_pod(grace=1).forced and planner.holds(agent_pod(grace=1))


def test_a_held_pod_needs_its_checkpoint_unless_there_is_nothing_to_save() -> None:
    assert planner.hold_verdict(agent_pod(), box()) is None


@pytest.mark.parametrize(("sp", "sandbox", "why"), [
    (agent_pod(), None, "gone"),
    (agent_pod(), {"metadata": {"name": "box", "uid": "other"}}, "gone"),
    (agent_pod(), {"metadata": {"name": "box", "uid": SB_UID,
                                "deletionTimestamp": "2026-01-01T11:00:00Z"}}, "being deleted"),
    (agent_pod(), box(suspend=True), "suspended"),
    (agent_pod(on_preemption=False), box(), "onPreemption false"),
    (agent_pod(live=False), box(), "not running"),
])
def test_nothing_to_save(sp: planner.SandboxPod, sandbox: dict[str, Any] | None,
                         why: str) -> None:
    verdict = planner.hold_verdict(sp, sandbox)
    assert verdict is not None and why in verdict


def test_held_pods_are_served_their_stopping_checkpoint_and_nothing_else() -> None:
    sp = agent_pod()
    assert planner.current_pods([sp]) == {}  # a deleted pod is left alone...
    assert planner.current_pods([sp], {sp.uid}) == {sp.key: sp}  # ...unless held
    stop, routine = request(), request(protocol.MANUAL, name="box-2-manual")
    assert planner.checkpoints_to_serve([stop, routine], [sp]) == []
    served = planner.checkpoints_to_serve([routine, stop], [sp], {sp.uid})
    assert [(protocol.name_of(c), s.pod) for c, s in served] == [("box-2-evict", "box-2")]
    assert planner.checkpoints_to_serve([routine], [sp], {sp.uid}) == []


def test_hold_requests_are_made_once_and_only_for_held_pods() -> None:
    sp = agent_pod()
    assert planner.hold_requests([sp], set(), []) == []
    assert planner.hold_requests([sp], {sp.uid}, []) == [(sp, "")]
    for reason in protocol.STOPPING_REASONS:  # one in flight or done, whatever its reason
        for phase in (None, protocol.DUMPING, protocol.UPLOADING, protocol.COMPLETED):
            assert planner.hold_requests([sp], {sp.uid}, [request(reason, phase)]) == []
    # A routine checkpoint, or another incarnation's stopping one, does not count.
    others = [request(protocol.INTERVAL, protocol.COMPLETED, name="box-2-i1"),
              request(protocol.EVICTION, protocol.COMPLETED, incarnation=1, name="box-1-evict")]
    assert planner.hold_requests([sp], {sp.uid}, others) == [(sp, "")]
    # After a failure it is asked for again, with the drain's backoff and attempts.
    failed = [request(phase=protocol.FAILED)]
    assert planner.hold_requests([sp], {sp.uid}, failed, WHEN) == [(sp, "-r2")]
    every = [request(phase=protocol.FAILED, name="box-2-evict" + (f"-r{i}" if i > 1 else ""))
             for i in range(1, planner.STOP_ATTEMPTS + 1)]
    assert planner.hold_requests([sp], {sp.uid}, every, WHEN) == []


# -- the node-agent itself, with fakes for the API and the engines ------------------------


def test_the_agent_saves_a_held_pod_being_deleted_and_nothing_else(tmp_path: Path) -> None:
    held = node_pod("box-1", terminating=True, annotations={protocol.ANNOTATION_HOLD: "true"})
    # Made without the hold (it has a budget instead), and one with nothing to save.
    unheld = node_pod("other-1", sandbox="other", terminating=True)
    gone = node_pod("gone-1", sandbox="gone", terminating=True,
                    annotations={protocol.ANNOTATION_HOLD: "true"})
    kube = FakeKube([held, unheld, gone], [])
    kube.get_sandbox = lambda namespace, name: (  # type: ignore[method-assign]
        None if name == "gone" else {"metadata": {"name": name, "uid": "sbx-uid"}, "spec": {}})
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.reconcile_once()  # judged once, requested once
    agent.shutdown()
    [(target, stop)] = engine.calls
    assert target.checkpoint == "box-1-evict" and stop is True
    assert kube.checkpoints["box-1-evict"]["spec"]["reason"] == "Eviction"
    assert kube.checkpoints["box-1-evict"]["status"]["phase"] == "Completed"
    assert sorted(kube.checkpoints) == ["box-1-evict"]
