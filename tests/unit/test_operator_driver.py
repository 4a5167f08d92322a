"""The driver applies plans through the Kube adapter; here the adapter is an in-memory fake."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_common.settings import OperatorSettings
from hermit_operator import driver, podspec
from hermit_operator.podspec import InvalidSpec
from hermit_operator.reconcile import Event
from tests.support.operator_driver import NOW, FakeKube, run
from tests.support.operator_driver import sandbox as sandbox  # the fixture


@pytest.fixture(autouse=True)
def _fresh_driver() -> None:
    driver._pdb_seen.clear()


# The opt-in blocking budget (HERMIT_DISRUPTION_BUDGET): every sandbox has one.
BUDGET = OperatorSettings(disruption_budget=True)


def pod_calls(kube: FakeKube) -> list[str]:
    """The calls that create or delete pods and Checkpoints (not the budget's)."""
    return [c for c in kube.calls if "pdb" not in c]


def test_lifecycle_create_run_and_pod_loss(sandbox: dict[str, Any]) -> None:
    kube, events = FakeKube(sandbox), list[Event]()
    run(kube, events, BUDGET)
    assert kube.calls == ["ensure pdb minimal", "create minimal-1"]
    assert kube.sandbox["status"]["podName"] == "minimal-1"
    run(kube, events, BUDGET)  # nothing new happened: no second pod (and the budget is known)
    assert kube.calls == ["ensure pdb minimal", "create minimal-1"]
    kube.pods["minimal-1"]["spec"]["nodeName"] = "spot-1"
    kube.pods["minimal-1"]["status"] = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}
    run(kube, events, BUDGET)
    assert (kube.sandbox["status"]["phase"], kube.sandbox["status"]["nodeName"]) == (
        "Running", "spot-1")
    del kube.pods["minimal-1"]  # the node vanished with the pod
    run(kube, events, BUDGET)
    assert kube.calls[-1] == "create minimal-2"
    assert kube.sandbox["status"]["incarnation"] == 2
    assert [e.reason for e in events] == ["PodCreating", "PodRunning", "PodLost", "PodCreating"]


def test_invalid_spec_is_recorded_then_raised(sandbox: dict[str, Any]) -> None:
    del sandbox["spec"]["podTemplate"]["spec"]["containers"][0]["command"]
    kube, events = FakeKube(sandbox), list[Event]()
    with pytest.raises(InvalidSpec, match="command is required"):
        run(kube, events)
    assert kube.calls == [] and kube.sandbox["status"]["phase"] == "Failed"
    assert [(e.type, e.reason) for e in events] == [("Warning", api.REASON_INVALID_SPEC)]


def test_deleted_sandbox_is_a_no_op(sandbox: dict[str, Any]) -> None:
    kube = FakeKube(sandbox)
    kube.get_sandbox = lambda namespace, name: None  # type: ignore[method-assign]
    assert run(kube, []) is None and kube.calls == []


def test_owner_sandbox_reads_the_controller_reference() -> None:
    ref = {"apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND, "name": "s",
           "controller": True}
    assert driver.owner_sandbox({"metadata": {"ownerReferences": [ref]}}) == "s"
    assert driver.owner_sandbox({"metadata": {"ownerReferences": [
        {**ref, "controller": False}]}}) is None
    assert driver.owner_sandbox({"metadata": {}}) is None


def test_handlers_register_with_kopf() -> None:
    import kopf

    import hermit_operator.handlers  # noqa: F401

    registry = kopf.get_default_registry()
    names = {h.id for h in registry._changing.get_all_handlers()}
    assert any("sandbox_changed" in n for n in names)
    assert any("pod_event" in h.id for h in registry._watching.get_all_handlers())
    assert any("checkpoint_event" in h.id for h in registry._watching.get_all_handlers())
    assert any("startup" in h.id for h in registry._activities.get_all_handlers())
    timers = {h.id for h in registry._spawning.get_all_handlers()}
    assert timers == set()  # time is the wakeups'; kopf timers would keep every body
    assert any("sandbox_event" in h.id for h in registry._watching.get_all_handlers())


def _checkpoint(name: str, reason: str, phase: str, node: str = "spot-1") -> dict[str, Any]:
    """As a node-agent creates one: labelled with its sandbox, incarnation and node."""
    return {"metadata": {"name": name, "namespace": "ns", "resourceVersion": "1",
                         "creationTimestamp": "2026-01-01T11:00:00Z",
                         "labels": {protocol.LABEL_SANDBOX: "minimal",
                                    protocol.LABEL_INCARNATION: "1", protocol.LABEL_NODE: node}},
            "spec": {"sandboxRef": {"name": "minimal"}, "reason": reason},
            "status": {"phase": phase, "nodeName": node, "completedAt": "2026-01-01T11:00:01Z"}}


def test_preemption_requeue_restore_and_retention(sandbox: dict[str, Any]) -> None:
    sandbox["spec"]["checkpoint"] = {"retain": 1}
    kube, events = FakeKube(sandbox), list[Event]()
    run(kube, events)
    kube.pods["minimal-1"]["spec"]["nodeName"] = "spot-1"
    kube.pods["minimal-1"]["metadata"]["creationTimestamp"] = "2026-01-01T10:00:00Z"
    kube.pods["minimal-1"]["status"] = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}
    kube.checkpoints["minimal-int"] = _checkpoint("minimal-int", "Interval", "Completed")
    kube.checkpoints["minimal-1-preempt"] = _checkpoint("minimal-1-preempt", "Preemption",
                                                        "Dumping")
    run(kube, events)
    assert kube.sandbox["status"]["phase"] == "Checkpointing"
    owners = kube.checkpoints["minimal-1-preempt"]["metadata"]["ownerReferences"]
    assert [o["uid"] for o in owners] == ["u-1"]  # adopted
    kube.checkpoints["minimal-1-preempt"]["status"]["phase"] = "Completed"
    kube.checkpoints["minimal-1-preempt"]["status"]["completedAt"] = "2026-01-01T11:00:05Z"
    run(kube, events)
    assert pod_calls(kube)[-3:] == ["delete minimal-1", "create minimal-2",
                                    "delete checkpoint minimal-int"]
    new = kube.pods["minimal-2"]
    assert new["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "minimal-1-preempt"
    status = kube.sandbox["status"]
    assert (status["phase"], status["lastCheckpoint"]["name"]) == ("Migrating",
                                                                   "minimal-1-preempt")
    new["spec"]["nodeName"] = "spot-2"
    new["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    new["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_PHASE] = "Restored"
    run(kube, events)
    run(kube, events)
    status = kube.sandbox["status"]
    assert (status["phase"], status["restores"], status["nodeName"]) == ("Running", 1, "spot-2")
    assert set(kube.pods) == {"minimal-2"} and set(kube.checkpoints) == {"minimal-1-preempt"}


def _running(kube: FakeKube, name: str = "minimal-1") -> None:
    kube.pods[name]["spec"]["nodeName"] = "spot-1"
    kube.pods[name]["metadata"]["creationTimestamp"] = "2026-01-01T10:00:00Z"
    kube.pods[name]["status"] = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T10:00:05Z"}]}


def test_interval_checkpoint_is_requested_once(sandbox: dict[str, Any]) -> None:
    sandbox["spec"]["checkpoint"] = {"intervalSeconds": 60}
    kube, events = FakeKube(sandbox), list[Event]()
    run(kube, events)
    _running(kube)
    run(kube, events)
    run(kube, events)  # the request is Pending now: not a second one
    requests = [c for c in kube.calls if c.startswith("create checkpoint")]
    assert requests == [f"create checkpoint minimal-1-i{int(NOW.timestamp())}"]


def test_scheduled_restore_retry_is_applied_then_requeued(sandbox: dict[str, Any]) -> None:
    kube, events = FakeKube(sandbox), list[Event]()
    kube.checkpoints["c1"] = _checkpoint("c1", "Interval", "Completed")
    kube.sandbox["status"] = {"incarnation": 1, "podName": "minimal-1",
                              "lastCheckpoint": {"name": "c1"}}
    run(kube, events)  # the pod is gone: incarnation 2 restores c1
    restore = kube.pods["minimal-2"]
    restore["metadata"]["annotations"].update({protocol.ANNOTATION_RESTORE_PHASE: "Failed",
                                               protocol.ANNOTATION_RESTORE_MESSAGE: "S3 timed out"})
    with pytest.raises(driver.Requeue) as raised:
        run(kube, events)
    assert raised.value.delay == 5.0
    assert "minimal-2" not in kube.pods  # applied before the requeue
    status = kube.sandbox["status"]
    assert (status["restoreAttempts"], status["nextRestoreAt"]) == (1, "2026-01-01T12:00:05Z")
    later = datetime(2026, 1, 1, 12, 0, 5, tzinfo=UTC)
    driver.reconcile_sandbox(kube, OperatorSettings(), "ns", "minimal",  # type: ignore[arg-type]
                             lambda _sb, e: events.append(e), now=lambda: later)
    annotations = kube.pods["minimal-3"]["metadata"]["annotations"]
    assert annotations[protocol.ANNOTATION_RESTORE_FROM] == "c1"


def test_disruption_budget_is_checked_at_most_every_minute(sandbox: dict[str, Any],
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    kube, events = FakeKube(sandbox), list[Event]()
    clock = [1000.0]
    monkeypatch.setattr(driver.time, "monotonic", lambda: clock[0])
    run(kube, events, BUDGET)
    run(kube, events, BUDGET)
    assert [c for c in kube.calls if "pdb" in c] == ["ensure pdb minimal"]
    clock[0] += driver.PDB_RECHECK_SECONDS
    run(kube, events, BUDGET)
    assert [c for c in kube.calls if "pdb" in c] == ["ensure pdb minimal"] * 2
    kube.sandbox["spec"]["checkpoint"] = {"onPreemption": False}
    run(kube, events, BUDGET)  # the wish changed: acted on at once
    assert kube.calls[-1] == "delete pdb minimal" and kube.pdbs == {}


def test_by_default_no_budget_is_made_and_an_old_one_is_deleted(sandbox: dict[str, Any]
                                                               ) -> None:
    kube, events = FakeKube(sandbox), list[Event]()
    run(kube, events, BUDGET)
    assert kube.pdbs  # made by an operator with the opt-in (or before the hold existed)
    driver._pdb_seen.clear()  # a restarted operator, now without the opt-in
    run(kube, events)
    assert kube.calls[-1] == "delete pdb minimal" and kube.pdbs == {}


def test_checkpoint_of_a_missing_sandbox_is_failed_once(sandbox: dict[str, Any]) -> None:
    kube, events = FakeKube(sandbox), list[tuple[str, Event]]()
    kube.get_sandbox = lambda namespace, name: None  # type: ignore[method-assign]
    orphan = {"apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
              "metadata": {"name": "ghost-manual", "namespace": "ns"},
              "spec": {"sandboxRef": {"name": "ghost"}, "reason": "Manual"}}

    def post(obj: dict[str, Any], event: Event) -> None:
        events.append((obj["metadata"]["name"], event))

    assert driver.reconcile_checkpoint(kube, OperatorSettings(), orphan, post,  # type: ignore[arg-type]
                                       now=lambda: NOW) is None
    status = kube.checkpoints["ghost-manual"]["status"]
    assert status == {"phase": "Failed", "completedAt": "2026-01-01T12:00:00Z",
                      "message": "AgentSandbox ghost does not exist in namespace ns"}
    assert [(n, e.type, e.reason) for n, e in events] == [
        ("ghost-manual", "Warning", api.REASON_SANDBOX_NOT_FOUND)]
    done = {**orphan, "status": status}
    driver.reconcile_checkpoint(kube, OperatorSettings(), done, post,  # type: ignore[arg-type]
                                now=lambda: NOW)
    driver.reconcile_checkpoint(kube, OperatorSettings(), orphan, post,  # type: ignore[arg-type]
                                deleted=True, now=lambda: NOW)
    assert kube.calls == ["patch checkpoint status ghost-manual"] and len(events) == 1


def test_checkpoint_of_an_existing_sandbox_is_left_to_the_node_agent(
        sandbox: dict[str, Any]) -> None:
    kube = FakeKube(sandbox)
    request = _checkpoint("minimal-manual", "Manual", "Pending")
    del request["status"]
    assert driver.reconcile_checkpoint(kube, OperatorSettings(), request,  # type: ignore[arg-type]
                                       lambda _o, _e: None, now=lambda: NOW) is not None
    assert not any("status" in c for c in kube.calls)


def test_the_operator_deletes_pods_with_a_short_grace_period(sandbox: dict[str, Any]) -> None:
    # It deletes a pod only when its tree has nothing left to save (docs/protocol.md
    # "Evictions").
    kube, events = FakeKube(sandbox), list[Event]()
    run(kube, events)
    kube.sandbox["spec"]["suspend"] = True
    run(kube, events)
    assert pod_calls(kube)[-1] == "delete minimal-1"
    assert kube.graces == [podspec.TERMINATION_GRACE_SECONDS]
