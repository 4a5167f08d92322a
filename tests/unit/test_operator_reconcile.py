from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from hermit_common import protocol
from hermit_common.settings import OperatorSettings
from hermit_operator.conditions import get_condition
from hermit_operator.reconcile import (
    FORK_RECHECK_SECONDS,
    container_message,
    plan,
    pod_is_lost,
    pod_is_ready,
)
from tests.support.operator_objects import after, cond

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"
SETTINGS = OperatorSettings()
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def sandbox(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((SAMPLES / "agentsandbox-minimal.yaml").read_text())
    obj["metadata"].update(namespace="ns", uid="u-1", generation=4)
    obj["spec"].update(spec)
    if status is not None:
        obj["status"] = status
    return obj


def pod(phase: str, *, ready: bool = False, name: str = "minimal-1", node: str = "spot-1",
        **status: Any) -> dict[str, Any]:
    st: dict[str, Any] = {"phase": phase, **status}
    if phase == "Running":
        st["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": {"nodeName": node},
            "status": st}


def restore_pod(name: str, incarnation: int, source: str, outcome: str | None,
                message: str | None = None, *, phase: str = "Running") -> dict[str, Any]:
    """A restore pod (Ready: its init runs) with the node-agent's outcome annotation."""
    p = pod(phase, ready=True, name=name, node="spot-2")
    annotations = {protocol.ANNOTATION_RESTORE_FROM: source}
    if outcome is not None:
        annotations[protocol.ANNOTATION_RESTORE_PHASE] = outcome
    if message is not None:
        annotations[protocol.ANNOTATION_RESTORE_MESSAGE] = message
    p["metadata"].update(annotations=annotations,
                         labels={protocol.LABEL_SANDBOX: "minimal",
                                 protocol.LABEL_INCARNATION: str(incarnation)})
    return p


def test_no_pod_creates_the_first_incarnation() -> None:
    p = plan(sandbox(), None, NOW, settings=SETTINGS)
    assert p.create_pod is not None and p.delete_pod is None and p.invalid_spec is None
    assert p.create_pod["metadata"]["name"] == "minimal-1"
    s = p.status_patch
    assert (s["phase"], s["incarnation"], s["podName"], s["observedGeneration"]) == (
        "Pending", 1, "minimal-1", 4)
    assert (cond(p, "Ready")["status"], cond(p, "Ready")["reason"]) == ("False", "PodCreating")
    assert cond(p, "Accepted")["status"] == "True"
    assert cond(p, "Ready")["observedGeneration"] == 4
    assert [e.reason for e in p.events] == ["PodCreating"]


def test_create_is_idempotent_until_the_status_lands() -> None:
    sb = sandbox()
    assert plan(sb, None, NOW, settings=SETTINGS).create_pod == plan(
        sb, None, NOW, settings=SETTINGS).create_pod


def test_running_and_ready_pod_is_running() -> None:
    sb = after(plan(sandbox(), None, NOW, settings=SETTINGS), sandbox())
    p = plan(sb, pod("Running", ready=True), NOW, settings=SETTINGS)
    assert p.create_pod is None and p.delete_pod is None
    assert p.status_patch["phase"] == "Running"
    assert (p.status_patch["podName"], p.status_patch["nodeName"]) == ("minimal-1", "spot-1")
    assert (cond(p, "Ready")["status"], cond(p, "Ready")["reason"]) == ("True", "PodRunning")
    assert [e.reason for e in p.events] == ["PodRunning"]
    # Seen again: same conditions, no new Event.
    again = plan(after(p, sb), pod("Running", ready=True), NOW, settings=SETTINGS)
    assert again.events == () and again.status_patch["conditions"] == p.status_patch[
        "conditions"]


@pytest.mark.parametrize(
    ("the_pod", "reason", "message_part"),
    [
        (pod("Pending", containerStatuses=[{"name": "agent", "state": {"waiting": {
            "reason": "ErrImagePull", "message": "not found"}}}]), "PodPending",
         "container agent is waiting (ErrImagePull): not found"),
        (pod("Running", ready=False), "ContainersNotReady", "pod is Running"),
    ],
)
def test_not_ready_pods_say_why(the_pod: dict[str, Any], reason: str, message_part: str) -> None:
    p = plan(sandbox({"incarnation": 1, "podName": "minimal-1"}), the_pod, NOW,
             settings=SETTINGS)
    assert p.status_patch["phase"] == "Pending"
    assert cond(p, "Ready")["reason"] == reason and message_part in cond(p, "Ready")["message"]


def test_succeeded_pod_succeeds_and_is_not_replaced() -> None:
    sb = sandbox({"incarnation": 1, "podName": "minimal-1"})
    p = plan(sb, pod("Succeeded"), NOW, settings=SETTINGS)
    assert p.status_patch["phase"] == "Succeeded" and p.create_pod is None
    assert cond(p, "Succeeded")["status"] == "True"
    gone = plan(after(p, sb), None, NOW, settings=SETTINGS)
    assert gone.create_pod is None and gone.status_patch["phase"] == "Succeeded"


def test_failed_pod_fails_with_the_container_state() -> None:
    failed = pod("Failed", containerStatuses=[{"name": "agent", "state": {"terminated": {
        "exitCode": 3, "reason": "Error", "message": "boom\nat line 2"}}}])
    p = plan(sandbox({"incarnation": 1, "podName": "minimal-1"}), failed, NOW, settings=SETTINGS)
    assert p.status_patch["phase"] == "Failed" and p.create_pod is None and p.delete_pod is None
    assert cond(p, "Failed")["reason"] == "PodFailed"
    assert cond(p, "Failed")["message"] == (
        "pod minimal-1 failed: container agent exited with code 3 (Error): boom at line 2")
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "PodFailed")]


def test_evicted_pod_is_replaced_from_the_last_checkpoint() -> None:
    sb = sandbox({"incarnation": 1, "podName": "minimal-1", "restores": 0,
                  "lastCheckpoint": {"name": "minimal-int-5", "reason": "Interval"}})
    evicted = pod("Failed", reason="Evicted", message="The node was low on resource: memory.")
    assert pod_is_lost(evicted)
    p = plan(sb, evicted, NOW, settings=SETTINGS)
    assert p.delete_pod == "minimal-1"
    assert p.create_pod is not None and p.create_pod["metadata"]["name"] == "minimal-2"
    annotations = p.create_pod["metadata"]["annotations"]
    assert annotations[protocol.ANNOTATION_RESTORE_FROM] == "minimal-int-5"
    assert p.status_patch["phase"] == "Restoring"
    assert cond(p, "Restoring")["status"] == "True"
    # The restore pod is Ready before the node-agent has restored anything: still Restoring.
    new = restore_pod("minimal-2", 2, "minimal-int-5", None)
    waiting = plan(after(p, sb), new, NOW, settings=SETTINGS)
    assert waiting.status_patch["phase"] == "Restoring" and waiting.status_patch["restores"] == 0
    # The node-agent reports Restored: Running, restores + 1, Restoring=False.
    done = restore_pod("minimal-2", 2, "minimal-int-5", "Restored")
    up = plan(after(waiting, after(p, sb)), done, NOW, settings=SETTINGS)
    assert up.status_patch["phase"] == "Running" and up.status_patch["restores"] == 1
    assert cond(up, "Restoring")["reason"] == "RestoreCompleted"


def test_vanished_pod_without_checkpoint_restarts_from_scratch_and_warns() -> None:
    p = plan(sandbox({"incarnation": 2, "podName": "minimal-2"}), None, NOW, settings=SETTINGS)
    assert p.create_pod is not None and p.create_pod["metadata"]["name"] == "minimal-3"
    assert protocol.ANNOTATION_RESTORE_FROM not in p.create_pod["metadata"]["annotations"]
    assert {e.type for e in p.events} == {"Warning"}


def test_disruption_target_marks_a_pod_lost() -> None:
    disrupted = pod("Failed", conditions=[{"type": "DisruptionTarget", "status": "True"}])
    assert pod_is_lost(disrupted) and not pod_is_lost(pod("Failed"))


def test_a_pod_the_kubelet_rejected_is_replaced_not_failed() -> None:
    """The scheduler bound the pod on a label the kubelet had not seen yet: the kubelet
    refuses it (Failed, NodeAffinity); nothing ran, so a new pod takes its place."""
    rejected = pod("Failed", reason="NodeAffinity",
                   message="Pod was rejected: Predicate NodeAffinity failed: node(s) didn't "
                           "match Pod's node affinity/selector")
    assert pod_is_lost(rejected)
    p = plan(sandbox({"incarnation": 1, "podName": "minimal-1", "restores": 0}), rejected,
             NOW, settings=SETTINGS)
    assert p.delete_pod == "minimal-1"
    assert p.create_pod is not None and p.create_pod["metadata"]["name"] == "minimal-2"
    assert p.status_patch.get("phase") != "Failed"
    # Nothing ran, so nothing was lost: Normal Events only, no PodLost Warning.
    assert [(e.type, e.reason) for e in p.events] == [
        ("Normal", "PodRejected"), ("Normal", "PodCreating")]
    assert "NodeAffinity" in p.events[0].message and "minimal-2" in p.events[0].message
    # Its container ran: the sandbox's own failure, not a rejection.
    ran = pod("Failed", reason="NodeAffinity", message="Pod was rejected: ...")
    ran["status"]["containerStatuses"] = [
        {"name": "agent", "state": {"terminated": {"exitCode": 1}}}]
    assert not pod_is_lost(ran)
    assert not pod_is_lost(pod("Failed", reason="NodeAffinity", message="something else"))


def test_a_rejected_restore_pod_is_replaced_by_one_restoring_the_same_checkpoint() -> None:
    """A restore pod refused by the kubelet (NodeAffinity) before its init ran: the next pod
    restores the same checkpoint, with the same record (staleness unchanged), and no
    Warning: the loss, if any, was reported when the refused pod was made."""
    rejected = restore_pod("minimal-3", 3, "minimal-stop-2", None, phase="Failed")
    rejected["status"].update(reason="NodeAffinity",
                              message="Pod was rejected: Predicate NodeAffinity failed")
    record = {"name": "minimal-stop-2", "staleSeconds": 40, "at": "2026-01-01T11:59:00Z"}
    p = plan(sandbox({"incarnation": 3, "podName": "minimal-3", "restores": 2,
                      "restoredFrom": record}), rejected, NOW, settings=SETTINGS)
    assert p.delete_pod == "minimal-3"
    assert p.create_pod is not None and p.create_pod["metadata"]["name"] == "minimal-4"
    assert (p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM]
            == "minimal-stop-2")
    assert p.status_patch["restoredFrom"] == record
    assert {e.type for e in p.events} == {"Normal"}
    assert [e.reason for e in p.events] == ["PodRejected", "RestoreStarted"]


def _other_checkpoint(phase: str | None = "Completed", message: str | None = None, *,
                      verified: bool = True) -> dict[str, Any]:
    """A Checkpoint of another sandbox, the source of a fork (verified by the operator, as
    its own sandbox's reconcile marks it, unless ``verified`` is False)."""
    status: dict[str, Any] = {}
    if phase is not None:
        status = {"phase": phase, "completedAt": "2026-01-01T11:00:00Z"}
    if message:
        status["message"] = message
    meta: dict[str, Any] = {"name": "other-manual-1", "namespace": "ns",
                            "creationTimestamp": "2026-01-01T10:59:00Z",
                            "labels": {protocol.LABEL_NODE: "spot-2"}}
    if verified:
        meta["annotations"] = {protocol.ANNOTATION_NODE_VERIFIED: "true"}
    return {"metadata": meta, "spec": {"sandboxRef": {"name": "other"}, "reason": "Manual"},
            "status": status}


def test_fork_restores_spec_restore_from_on_the_first_incarnation() -> None:
    p = plan(sandbox(restoreFrom="other-manual-1"), None, NOW, settings=SETTINGS,
             checkpoints=[_other_checkpoint()])
    assert p.create_pod is not None
    assert p.create_pod["metadata"]["annotations"] == {
        protocol.ANNOTATION_RESTORE_FROM: "other-manual-1",
        protocol.ANNOTATION_WORKSPACE_PATH: "/workspace",
        protocol.ANNOTATION_SAFE_TO_EVICT: "true", protocol.ANNOTATION_HOLD: "true"}
    assert p.status_patch["phase"] == "Restoring"
    assert p.status_patch["restoredFrom"] == {
        "name": "other-manual-1", "reason": "Manual", "checkpointTime": "2026-01-01T11:00:00Z",
        "staleSeconds": 3600, "fallback": False}
    assert [(e.type, e.reason) for e in p.events] == [("Normal", "RestoreStarted")]


def test_fork_of_a_missing_checkpoint_waits_and_says_so_once() -> None:
    sb = sandbox(restoreFrom="other-manual-1")
    p = plan(sb, None, NOW, settings=SETTINGS)
    assert p.create_pod is None and p.status_patch["phase"] == "Pending"
    ready = cond(p, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "CheckpointNotFound")
    assert "other-manual-1" in ready["message"] and "namespace ns" in ready["message"]
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "CheckpointNotFound")]
    again = plan(after(p, sb), None, NOW, settings=SETTINGS)
    assert again.events == () and again.create_pod is None
    # It appears (and completes): the fork starts.
    found = plan(after(again, sb), None, NOW, settings=SETTINGS,
                 checkpoints=[_other_checkpoint()])
    assert found.create_pod is not None and found.status_patch["incarnation"] == 1


def test_fork_waits_for_a_checkpoint_in_flight_and_refuses_a_failed_one() -> None:
    sb = sandbox(restoreFrom="other-manual-1")
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[_other_checkpoint("Uploading")])
    assert p.create_pod is None and p.events == ()
    assert cond(p, "Ready")["reason"] == "CheckpointInProgress"
    assert (cond(p, "Restoring")["status"], p.status_patch["phase"]) == ("True", "Restoring")
    failed = plan(after(p, sb), None, NOW, settings=SETTINGS,
                  checkpoints=[_other_checkpoint("Failed", "criu: dump failed")])
    assert failed.create_pod is None
    assert cond(failed, "Ready")["reason"] == "CheckpointFailed"
    assert cond(failed, "Restoring")["status"] == "False"
    assert "criu: dump failed" in cond(failed, "Ready")["message"]
    assert [(e.type, e.reason) for e in failed.events] == [("Warning", "CheckpointFailed")]
    assert failed.status_patch["phase"] == "Pending"


def test_fork_refuses_a_checkpoint_the_operator_did_not_verify() -> None:
    """A node-agent can complete a Checkpoint labelled with its own node for a sandbox it
    never ran: a fork restores only what the operator verified (hermit.dev/node-verified)."""
    sb = sandbox(restoreFrom="other-manual-1")
    forged = _other_checkpoint(verified=False)
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[forged])
    assert p.create_pod is None and p.status_patch["phase"] == "Pending"
    ready = cond(p, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "CheckpointUntrusted")
    assert ready["message"] == (
        "spec.restoreFrom names Checkpoint other-manual-1, which the operator has not "
        "verified: its hermit.dev/node label (spot-2) was never seen to match the node its "
        "sandbox other ran on, so a node-agent may have forged it; no pod is created (it is "
        "restored once it carries hermit.dev/node-verified)")
    assert (get_condition(p.status_patch["conditions"], "Restoring") or {}).get("status") \
        != "True"
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "CheckpointUntrusted")]
    again = plan(after(p, sb), None, NOW, settings=SETTINGS, checkpoints=[forged])
    assert again.events == () and again.create_pod is None  # one Warning, not one per tick
    assert again.requeue_after == FORK_RECHECK_SECONDS  # looked at again
    # Its own sandbox's reconcile verifies it: the fork starts.
    verified = plan(after(again, sb), None, NOW, settings=SETTINGS,
                    checkpoints=[_other_checkpoint()])
    assert verified.create_pod is not None and verified.status_patch["incarnation"] == 1


def test_suspend_deletes_the_pod_and_resume_creates_a_new_one() -> None:
    sb = sandbox({"incarnation": 1, "podName": "minimal-1"}, suspend=True)
    p = plan(sb, pod("Pending"), NOW, settings=SETTINGS)  # nothing to checkpoint yet
    assert p.delete_pod == "minimal-1" and p.create_pod is None
    assert p.status_patch["phase"] == "Suspended"
    assert p.status_patch["podName"] is None and p.status_patch["nodeName"] is None
    suspended = after(p, sb)
    assert plan(suspended, None, NOW, settings=SETTINGS).delete_pod is None
    suspended["spec"]["suspend"] = False
    r = plan(suspended, None, NOW, settings=SETTINGS)
    assert r.create_pod is not None and r.create_pod["metadata"]["name"] == "minimal-2"
    assert (cond(r, "Suspended")["status"], cond(r, "Suspended")["reason"]) == (
        "False", "Resumed")
    assert r.status_patch["phase"] == "Pending"


def test_terminating_pod_is_waited_for() -> None:
    terminating = pod("Running", ready=True)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:00Z"
    p = plan(sandbox({"incarnation": 1, "podName": "minimal-1"}), terminating, NOW,
             settings=SETTINGS)
    assert p.create_pod is None and p.delete_pod is None
    assert cond(p, "Ready")["reason"] == "PodTerminating"


def test_invalid_spec_is_reported_once_and_touches_no_pod() -> None:
    sb = sandbox()
    del sb["spec"]["podTemplate"]["spec"]["containers"][0]["command"]
    p = plan(sb, None, NOW, settings=SETTINGS)
    assert p.invalid_spec is not None and "command is required" in p.invalid_spec
    assert p.create_pod is None and p.delete_pod is None
    assert (cond(p, "Accepted")["status"], cond(p, "Accepted")["reason"]) == (
        "False", "InvalidSpec")
    assert p.status_patch["phase"] == "Failed"
    assert [(e.type, e.reason) for e in p.events] == [("Warning", "InvalidSpec")]
    assert plan(after(p, sb), None, NOW, settings=SETTINGS).events == ()


def test_pod_readiness_falls_back_to_container_statuses() -> None:
    p = {"status": {"phase": "Running", "containerStatuses": [{"ready": True}]}}
    assert pod_is_ready(p) and not pod_is_ready({"status": {"phase": "Running"}})
    assert container_message({"status": {"phase": "Pending"}}) == "pod is Pending"


def test_every_plan_keeps_the_disruption_budget_unless_preemption_is_off() -> None:
    # With the opt-in (HERMIT_DISRUPTION_BUDGET): evictions are refused, as before the hold.
    budget = dataclasses.replace(SETTINGS, disruption_budget=True)
    p = plan(sandbox(), None, NOW, settings=budget)
    assert p.pdb is not None and p.pdb["metadata"]["name"] == "minimal" and p.delete_pdb is None
    off = sandbox(checkpoint={"onPreemption": False})
    q = plan(off, None, NOW, settings=budget)
    assert q.pdb is None and q.delete_pdb == "minimal"
    assert q.create_pod is not None
    assert q.create_pod["metadata"]["annotations"][protocol.ANNOTATION_ON_PREEMPTION] == "false"
    invalid = sandbox()
    del invalid["spec"]["podTemplate"]["spec"]["containers"][0]["command"]
    r = plan(invalid, None, NOW, settings=budget)
    assert r.pdb is None and r.delete_pdb is None  # nothing is touched for an invalid spec
