"""Evictions allowed, terminations held (docs/protocol.md, "Evictions"): the pure decisions.

The operator builds every sandbox pod with a preStop hook to the node-agent's hold endpoint,
the cluster autoscaler's safe-to-evict annotation and a grace period long enough for a
checkpoint, and makes no blocking PodDisruptionBudget (unless asked to, or for a pod made
without the hook). The node-agent's hold endpoint waits for a stopping checkpoint of a pod
that is being deleted, asks for one when there is none, and does nothing else for anyone.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_node import holdserver, planner
from hermit_node.planner import HoldDecision
from hermit_operator import podspec
from hermit_operator.reconcile import plan
from tests.support.operator_objects import NOW, RUNNING, SETTINGS, ckpt, pod
from tests.support.operator_objects import sandbox as make_sandbox

# -- the operator: the pod and the budget ------------------------------------------------


def held_pod(**kwargs: Any) -> dict[str, Any]:
    """A sandbox pod as this operator builds it: with the hold's preStop hook."""
    p = pod(**kwargs)
    name = p["metadata"]["name"]
    p["spec"]["containers"] = [{"name": "main", "lifecycle": {"preStop": {"httpGet": {
        "host": "127.0.0.1", "port": 9104, "path": protocol.hold_path("ns", name)}}}}]
    return p


def test_the_pod_carries_the_hook_the_annotation_and_a_checkpoint_long_grace() -> None:
    pod_ = podspec.build_sandbox_pod(make_sandbox(), SETTINGS, 4, None)
    main = pod_["spec"]["containers"][0]
    assert main["lifecycle"]["preStop"] == {"httpGet": {
        "host": "127.0.0.1", "port": SETTINGS.hold_port, "path": "/v1/hold/ns/minimal-4",
        "scheme": "HTTP"}}
    assert pod_["metadata"]["annotations"][protocol.ANNOTATION_SAFE_TO_EVICT] == "true"
    assert pod_["spec"]["terminationGracePeriodSeconds"] == 120
    assert podspec.holds_termination(pod_)
    custom = dataclasses.replace(SETTINGS, hold_port=9999, termination_grace_seconds=300)
    pod_ = podspec.build_sandbox_pod(make_sandbox(), custom, 4, None)
    assert pod_["spec"]["containers"][0]["lifecycle"]["preStop"]["httpGet"]["port"] == 9999
    assert pod_["spec"]["terminationGracePeriodSeconds"] == 300


def test_without_the_hold_the_pod_is_as_before() -> None:
    off = dataclasses.replace(SETTINGS, hold_port=0)
    pod_ = podspec.build_sandbox_pod(make_sandbox(), off, 1, None)
    assert "lifecycle" not in pod_["spec"]["containers"][0]
    assert protocol.ANNOTATION_SAFE_TO_EVICT not in pod_["metadata"]["annotations"]
    assert pod_["spec"]["terminationGracePeriodSeconds"] == podspec.TERMINATION_GRACE_SECONDS
    assert not podspec.holds_termination(pod_)


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
    assert p.delete_pod == "minimal-1"  # it is being deleted already: harmless
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
    assert ("Warning", api.REASON_CHECKPOINT_FAILED) in [(e.type, e.reason) for e in p.events]
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[older, failed])
    assert p.create_pod is not None
    assert (p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "c1")
    assert p.status_patch["restoredFrom"]["staleSeconds"] == 3600
    assert ("Warning", api.REASON_WORK_LOST) in [(e.type, e.reason) for e in p.events]
    assert p.work_lost == 3600  # hermit_operator_work_lost_seconds


# -- the node-agent: what a hold request may do ------------------------------------------

NODE = "spot-1"
SB_UID = "sb-uid"
WHEN = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def agent_pod(name: str = "box-2", *, deleting: bool = True, live: bool = True,
              node: str = NODE, restore_from: str | None = None,
              restore_phase: str | None = None, on_preemption: bool = True,
              uid: str = "pod-uid") -> dict[str, Any]:
    annotations: dict[str, str] = {}
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
        meta.update(deletionTimestamp="2026-01-01T11:59:59Z", deletionGracePeriodSeconds=90)
    state = ({"running": {"startedAt": "2026-01-01T11:00:00Z"}} if live
             else {"terminated": {"exitCode": 0}})
    return {"metadata": meta, "spec": {"nodeName": node, "containers": [{"name": "main"}]},
            "status": {"phase": "Running", "containerStatuses": [
                {"name": "main", "containerID": "containerd://abc", "state": state}]}}


def box(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "box", "namespace": "ns", "uid": SB_UID}, "spec": spec}


def request(reason: str = protocol.EVICTION, phase: str | None = None, *,
            incarnation: int = 2, name: str = "box-2-evict") -> dict[str, Any]:
    c = protocol.checkpoint_object("box", name, reason, incarnation, namespace="ns", node=NODE)
    if phase:
        c["status"] = {"phase": phase, "completedAt": "2026-01-01T11:59:00Z"}
    return c


def decide(pod_: dict[str, Any] | None, sandbox: dict[str, Any] | None = None,
           checkpoints: tuple[dict[str, Any], ...] = ()) -> HoldDecision:
    return planner.hold_decision(pod_, box() if sandbox is None else sandbox, checkpoints,
                                 NODE, "ns/box-2")


@pytest.mark.parametrize(("pod_", "status"), [
    (None, 404),  # no such pod here
    (agent_pod(node="spot-9"), 404),  # another node's
    (agent_pod(name="box-2-lookalike"), 403),  # not named as the operator names pods
    (agent_pod(deleting=False), 409),  # not being deleted: asking changes nothing
])
def test_requests_for_anything_but_a_sandbox_pod_being_deleted_here_are_refused(
        pod_: dict[str, Any] | None, status: int) -> None:
    d = decide(pod_)
    assert (d.verdict, d.status) == (planner.HOLD_REFUSE, status)
    assert decide(pod_, checkpoints=(request(),)).verdict == planner.HOLD_REFUSE


def test_a_pod_whose_stopping_checkpoint_is_durable_is_released_at_once() -> None:
    # The operator's own delete after a move, or an eviction whose checkpoint finished.
    for reason in protocol.STOPPING_REASONS:
        d = decide(agent_pod(live=False), checkpoints=(request(reason, protocol.COMPLETED),))
        assert (d.verdict, d.status, d.checkpoint) == (planner.HOLD_RELEASE, 200,
                                                       "box-2-evict")


def test_a_stopping_checkpoint_in_flight_is_waited_for_whoever_asked_for_it() -> None:
    for reason in protocol.STOPPING_REASONS:
        for phase in (None, protocol.DUMPING, protocol.UPLOADING):
            d = decide(agent_pod(), checkpoints=(request(reason, phase),))
            assert (d.verdict, d.checkpoint) == (planner.HOLD_WAIT, "box-2-evict")


def test_an_evicted_pod_without_one_gets_an_eviction_checkpoint() -> None:
    assert decide(agent_pod()).verdict == planner.HOLD_TAKE
    # A routine checkpoint, or another incarnation's stopping one, does not count.
    others = (request(protocol.INTERVAL, protocol.COMPLETED, name="box-2-i1"),
              request(protocol.EVICTION, protocol.COMPLETED, incarnation=1, name="box-1-evict"))
    assert decide(agent_pod(), checkpoints=others).verdict == planner.HOLD_TAKE
    # After a failure it is asked for again, up to the attempts of a drain.
    failed = tuple(request(phase=protocol.FAILED, name=f"box-2-evict-r{i}")
                   for i in range(1, planner.STOP_ATTEMPTS))
    assert decide(agent_pod(), checkpoints=failed).verdict == planner.HOLD_TAKE
    last = (*failed, request(phase=protocol.FAILED, name="box-2-evict-r99"))
    d = decide(agent_pod(), checkpoints=last)
    assert d.verdict == planner.HOLD_RELEASE and "failed" in d.message


@pytest.mark.parametrize(("pod_", "sandbox", "why"), [
    (agent_pod(), {"metadata": {"name": "box", "uid": "other"}}, "gone"),
    (agent_pod(), {"metadata": {"name": "box", "uid": SB_UID,
                                "deletionTimestamp": "2026-01-01T11:00:00Z"}}, "being deleted"),
    (agent_pod(), box(suspend=True), "suspended"),
    (agent_pod(on_preemption=False), box(), "onPreemption false"),
    (agent_pod(live=False), box(), "not running"),
    (agent_pod(restore_from="box-1-evict"), box(), "not running"),  # still waiting
])
def test_nothing_to_save_is_released_at_once(pod_: dict[str, Any], sandbox: dict[str, Any],
                                             why: str) -> None:
    d = decide(pod_, sandbox)
    assert d.verdict == planner.HOLD_RELEASE and why in d.message


def test_a_sandbox_that_is_gone_is_released() -> None:
    d = planner.hold_decision(agent_pod(), None, (), NODE, "ns/box-2")
    assert d.verdict == planner.HOLD_RELEASE and "gone" in d.message


def test_a_restored_pod_is_saved_like_any_other() -> None:
    pod_ = agent_pod(restore_from="box-1-evict", restore_phase=protocol.RESTORED)
    assert decide(pod_).verdict == planner.HOLD_TAKE


def test_held_pods_are_served_their_stopping_checkpoint_and_nothing_else() -> None:
    sp = planner.sandbox_pod(agent_pod())
    assert sp is not None and sp.terminating and sp.container_live and not sp.running
    assert planner.current_pods([sp]) == {}  # a deleted pod is left alone...
    assert planner.current_pods([sp], {sp.uid}) == {sp.key: sp}  # ...unless held
    stop, routine = request(), request(protocol.MANUAL, name="box-2-manual")
    assert planner.checkpoints_to_serve([stop, routine], [sp]) == []
    served = planner.checkpoints_to_serve([routine, stop], [sp], {sp.uid})
    assert [(protocol.name_of(c), s.pod) for c, s in served] == [("box-2-evict", "box-2")]
    assert planner.checkpoints_to_serve([routine], [sp], {sp.uid}) == []


def test_hold_requests_are_made_once_and_only_for_held_pods() -> None:
    sp = planner.sandbox_pod(agent_pod())
    assert sp is not None
    assert planner.hold_requests([sp], set(), []) == []
    assert planner.hold_requests([sp], {sp.uid}, []) == [(sp, "")]
    for reason in protocol.STOPPING_REASONS:  # one in flight or done, whatever its reason
        assert planner.hold_requests([sp], {sp.uid}, [request(reason)]) == []
    failed = [request(phase=protocol.FAILED)]
    assert planner.hold_requests([sp], {sp.uid}, failed, WHEN) == [(sp, "-r2")]


def test_a_hold_lasts_at_most_the_deletions_grace_period() -> None:
    sp = planner.sandbox_pod(agent_pod())
    assert planner.hold_seconds(sp) == 90
    assert planner.hold_seconds(None) == planner.MAX_HOLD_SECONDS


# -- the endpoint: bounded paths, nothing else parsed ------------------------------------


@pytest.mark.parametrize("path", [
    "/v1/hold/ns/box-2", "/v1/hold/team-a/box.example-12"])
def test_hold_paths_name_a_namespace_and_a_pod(path: str) -> None:
    parsed = protocol.parse_hold_path(path)
    assert parsed is not None and protocol.hold_path(*parsed) == path


@pytest.mark.parametrize("path", [
    "/", "/v1/hold/", "/v1/hold/ns", "/v1/hold/ns/box/x", "/v1/hold/ns/box?x=1",
    "/v1/hold/NS/box", "/v1/hold/../box", "/v1/hold/ns/" + "a" * 300, "/v1/hold/ns/-x",
    "/v1/turns/ns/box"])
def test_anything_else_is_not_a_hold_path(path: str) -> None:
    assert protocol.parse_hold_path(path) is None


def test_the_endpoint_answers_what_the_agent_decided() -> None:
    asked: list[tuple[str, str]] = []

    def hold(namespace: str, pod_: str) -> HoldDecision:
        asked.append((namespace, pod_))
        return HoldDecision(planner.HOLD_RELEASE, "durable", checkpoint="box-2-evict")

    reply = holdserver.reply_for("/v1/hold/ns/box-2", hold)
    assert (reply.status, reply.body) == (200, {"verdict": "release", "message": "durable",
                                                "checkpoint": "box-2-evict"})
    assert holdserver.reply_for("/metrics", hold).status == 404
    assert asked == [("ns", "box-2")]
