"""The checkpoint/restore protocol (docs/protocol.md) from the operator's side: pure functions."""

from __future__ import annotations

from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_operator import checkpoints as ck
from hermit_operator.conditions import get_condition
from hermit_operator.reconcile import plan
from tests.support.operator_objects import (
    NOW,
    RUNNING,
    SETTINGS,
    UID,
    after,
    ckpt,
    cond,
    pod,
    sandbox,
)

# -- checkpoints.py ---------------------------------------------------------------------

@pytest.mark.parametrize(
    ("the_ckpt", "mine"),
    [
        (ckpt("a"), True),
        (ckpt("a", owned=False), True),  # created by the node-agent: no owner yet
        (ckpt("a", sandbox_name="other"), False),
        (ckpt("a", owned=False, created="09:00:00"), False),  # older than the sandbox
        ({**ckpt("a"), "metadata": {**ckpt("a")["metadata"], "ownerReferences": [
            {"kind": api.SANDBOX_KIND, "uid": "old-uid"}]}}, False),  # an earlier namesake
        ({**ckpt("a"), "metadata": {**ckpt("a")["metadata"],
                                    "deletionTimestamp": "2026-01-01T11:00:00Z"}}, False),
    ],
)
def test_of_sandbox_picks_the_sandbox_s_checkpoints(the_ckpt: dict[str, Any], mine: bool) -> None:
    assert bool(ck.of_sandbox(sandbox(), [the_ckpt])) is mine


def test_of_sandbox_orders_by_completion_with_fractional_times() -> None:
    later = ckpt("b", created="11:00:00", done="11:00:00.500")
    earlier = ckpt("a", created="11:00:01", done="11:00:00")
    pending = ckpt("c", phase=None, created="11:30:00")
    got = ck.of_sandbox(sandbox(), [later, pending, earlier])
    assert [ck.name_of(c) for c in got] == ["a", "b", "c"]
    assert ck.name_of(ck.last_completed(got) or {}) == "b"
    assert ck.last_checkpoint_status(later) == {"name": "b", "reason": "Interval",
                                                "time": "2026-01-01T11:00:00.500Z"}


@pytest.mark.parametrize(
    ("the_ckpt", "the_pod", "taken"),
    [
        (ckpt("p"), pod(), True),
        (ckpt("p", node="spot-9"), pod(), False),  # another node's checkpoint
        (ckpt("p", node=None), pod(), True),
        (ckpt("p", created="10:00:00"), pod(), False),  # older than the pod
        (ckpt("p", created="10:30:00"), pod(), True),  # same second
        (ckpt("p", created="11:00:00"), pod(restore_from="p"), False),  # what it restores
    ],
)
def test_taken_from(the_ckpt: dict[str, Any], the_pod: dict[str, Any], taken: bool) -> None:
    assert ck.taken_from(the_ckpt, the_pod) is taken


@pytest.mark.parametrize(
    ("names_phases", "retain", "protect", "deleted"),
    [
        ([("c1", "Completed"), ("c2", "Completed"), ("c3", "Completed"), ("c4", "Completed")],
         3, (), ["c1"]),
        ([("c1", "Completed"), ("c2", "Completed")], 3, (), []),
        ([("c1", "Completed"), ("c2", "Completed"), ("c3", "Completed")], 1, ("c1",), ["c2"]),
        ([("f0", "Failed"), ("c1", "Completed"), ("f2", "Failed"), ("c3", "Completed")],
         1, (), ["f0", "c1", "f2"]),
        ([("f0", "Failed"), ("c1", "Completed"), ("f2", "Failed"), ("c3", "Completed")],
         2, (), ["f0"]),
        ([("c1", "Completed"), ("c2", "Completed"), ("d3", "Dumping"), ("p4", None)],
         1, (), ["c1"]),
        ([("f1", "Failed")], 1, (), []),  # nothing Completed yet: keep the history
    ],
)
def test_retention(names_phases: list[tuple[str, str | None]], retain: int,
                   protect: tuple[str, ...], deleted: list[str]) -> None:
    objs = [ckpt(n, phase=ph, created=f"11:0{i}:00") for i, (n, ph) in enumerate(names_phases)]
    got = ck.to_delete(ck.of_sandbox(sandbox(), objs), retain, protect)
    assert got == deleted


def test_adoption_adds_an_owner_reference_and_the_label_once() -> None:
    sb = sandbox()
    foreign = {"apiVersion": "x/v1", "kind": "Thing", "name": "t", "uid": "t-1",
               "controller": True}
    bare = ckpt("n", owned=False)
    bare["metadata"]["ownerReferences"] = [foreign]
    patches = dict(ck.adoption_patches(sb, [bare, ckpt("o")]))
    assert list(patches) == ["n"]
    meta = patches["n"]["metadata"]
    assert meta["resourceVersion"] == "7"
    assert meta["labels"] == {protocol.LABEL_SANDBOX: "minimal"}
    assert meta["ownerReferences"][0] == foreign
    assert meta["ownerReferences"][1] == {
        "apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND, "name": "minimal", "uid": UID,
        "controller": False, "blockOwnerDeletion": True}  # only one controller is allowed


@pytest.mark.parametrize(("retain", "want"), [(None, 3), (5, 5), (0, 1), ("x", 3)])
def test_retain_count(retain: Any, want: int) -> None:
    spec = {} if retain is None else {"checkpoint": {"retain": retain}}
    assert ck.retain_count({"spec": spec}) == want


# -- plan(): lastCheckpoint and Checkpointing -------------------------------------------

@pytest.mark.parametrize(
    ("objs", "status", "reason", "events"),
    [
        ([ckpt("c1", phase="Dumping")], "True", "CheckpointInProgress", []),
        ([ckpt("c1"), ckpt("c2", phase="Uploading", created="11:05:00")], "True",
         "CheckpointInProgress", ["CheckpointCompleted"]),
        ([ckpt("c1")], "False", "CheckpointCompleted", ["CheckpointCompleted"]),
        ([ckpt("c1"), ckpt("f2", phase="Failed", created="11:05:00", message="disk\nfull")],
         "False", "CheckpointFailed", ["CheckpointCompleted", "CheckpointFailed"]),
        ([ckpt("f1", phase="Failed", created="11:00:00"), ckpt("c2", created="11:05:00")],
         "False", "CheckpointCompleted", ["CheckpointCompleted"]),
    ],
)
def test_checkpointing_condition(objs: list[dict[str, Any]], status: str, reason: str,
                                 events: list[str]) -> None:
    sb = sandbox(dict(RUNNING))
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=objs)
    c = cond(p, "Checkpointing")
    assert (c["status"], c["reason"]) == (status, reason)
    assert [e.reason for e in p.events if e.reason != "PodRunning"] == events
    if reason == "CheckpointFailed":
        assert c["message"] == "checkpoint f2 failed: disk full"
        assert [e.type for e in p.events if e.reason == "CheckpointFailed"] == ["Warning"]
    # Seen again: no new checkpoint Events.
    again = plan(after(p, sb), pod(), NOW, settings=SETTINGS, checkpoints=objs)
    assert [e.reason for e in again.events if e.reason.startswith("Checkpoint")] == []
    if status == "True":
        assert p.status_patch["phase"] == "Checkpointing"


def test_last_checkpoint_is_recorded_and_the_pod_keeps_running() -> None:
    p = plan(sandbox(dict(RUNNING)), pod(), NOW, settings=SETTINGS,
             checkpoints=[ckpt("c1", "Turn", done="11:00:02")])
    assert p.status_patch["lastCheckpoint"] == {"name": "c1", "reason": "Turn",
                                                "time": "2026-01-01T11:00:02Z"}
    assert p.create_pod is None and p.delete_pod is None
    assert p.status_patch["phase"] == "Running"


def test_no_checkpoints_no_checkpointing_condition() -> None:
    p = plan(sandbox(dict(RUNNING)), pod(), NOW, settings=SETTINGS)
    assert get_condition(p.status_patch["conditions"], "Checkpointing") is None
    assert "lastCheckpoint" not in p.status_patch


# -- plan(): requeue after a stopping checkpoint ----------------------------------------

@pytest.mark.parametrize("reason", ["Preemption", "Eviction"])
def test_preemption_checkpoint_moves_the_sandbox_then_restore_completes(reason: str) -> None:
    sb = sandbox(dict(RUNNING))
    pre = ckpt("minimal-1-preempt", reason, created="11:00:00")
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[pre])
    assert p.delete_pod == "minimal-1"
    assert p.create_pod is not None and p.create_pod["metadata"]["name"] == "minimal-2"
    annotations = p.create_pod["metadata"]["annotations"]
    assert annotations[protocol.ANNOTATION_RESTORE_FROM] == "minimal-1-preempt"
    assert annotations[protocol.ANNOTATION_WORKSPACE_PATH] == "/workspace"
    assert (cond(p, "Migrating")["status"], cond(p, "Migrating")["reason"]) == (
        "True", "CheckpointCompleted")
    assert (cond(p, "Restoring")["status"], cond(p, "Restoring")["reason"]) == (
        "True", "RestoreStarted")
    assert p.status_patch["phase"] == "Migrating"
    assert p.status_patch["lastCheckpoint"]["name"] == "minimal-1-preempt"
    assert (p.status_patch["incarnation"], p.status_patch["podName"]) == (2, "minimal-2")
    moved = after(p, sb)

    # The new pod exists, restore not reported yet: nothing new happens (no second move).
    new = pod("minimal-2", node="spot-2", created="11:00:00", incarnation=2,
              restore_from="minimal-1-preempt")
    wait = plan(moved, new, NOW, settings=SETTINGS, checkpoints=[pre])
    assert wait.create_pod is None and wait.delete_pod is None
    assert wait.status_patch["phase"] == "Migrating" and wait.status_patch["restores"] == 0

    # Restored: Restoring=False, Migrating=False, restores + 1 exactly once.
    done = pod("minimal-2", node="spot-2", created="11:00:00", incarnation=2,
               restore_from="minimal-1-preempt", outcome="Restored")
    up = plan(after(wait, moved), done, NOW, settings=SETTINGS, checkpoints=[pre])
    assert up.status_patch["restores"] == 1 and up.status_patch["phase"] == "Running"
    assert (cond(up, "Restoring")["status"], cond(up, "Restoring")["reason"]) == (
        "False", "RestoreCompleted")
    assert cond(up, "Migrating")["status"] == "False"
    assert "RestoreCompleted" in [e.reason for e in up.events]
    again = plan(after(up, after(wait, moved)), done, NOW, settings=SETTINGS,
                 checkpoints=[pre])
    assert again.status_patch["restores"] == 1 and again.events == ()
    assert again.create_pod is None and again.delete_pod is None


@pytest.mark.parametrize(
    ("objs", "moves"),
    [
        ([ckpt("x", "Preemption", phase="Dumping")], False),
        ([ckpt("x", "Preemption", phase="Failed")], False),
        ([ckpt("x", "Interval")], False),
        ([ckpt("x", "Manual")], False),
        ([ckpt("x", "Preemption", node="spot-7")], False),  # taken on another node
        ([ckpt("x", "Preemption", created="10:00:00")], False),  # before this pod
        ([ckpt("x", "Eviction")], True),
        ([ckpt("x", "Suspend")], True),  # suspend was turned off again: carry on elsewhere
    ],
)
def test_which_checkpoints_end_the_current_pod(objs: list[dict[str, Any]], moves: bool) -> None:
    p = plan(sandbox(dict(RUNNING)), pod(), NOW, settings=SETTINGS, checkpoints=objs)
    assert (p.delete_pod == "minimal-1") is moves
    assert (p.create_pod is not None) is moves


def test_pod_ended_by_its_in_flight_checkpoint_is_not_a_failure() -> None:
    sb = sandbox(dict(RUNNING))
    flight = [ckpt("x", "Preemption", phase="Uploading", created="11:59:00")]
    p = plan(sb, pod(phase="Failed"), NOW, settings=SETTINGS, checkpoints=flight)
    assert p.create_pod is None and p.delete_pod is None
    assert get_condition(p.status_patch["conditions"], "Failed") is None
    assert cond(p, "Ready")["reason"] == "CheckpointInProgress"
    assert p.status_patch["phase"] == "Checkpointing"
    # Once it is durable the sandbox moves on.
    flight[0] = ckpt("x", "Preemption", created="11:59:00")
    moved = plan(after(p, sb), pod(phase="Failed"), NOW, settings=SETTINGS, checkpoints=flight)
    assert moved.delete_pod == "minimal-1" and moved.create_pod is not None
    assert moved.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "x"


def test_vanished_pod_waits_for_an_in_flight_stopping_checkpoint_but_not_forever() -> None:
    sb = sandbox(dict(RUNNING, lastCheckpoint={"name": "old", "reason": "Interval"}))
    fresh = [ckpt("old"), ckpt("x", "Preemption", phase="Dumping", created="11:58:00")]
    assert plan(sb, None, NOW, settings=SETTINGS, checkpoints=fresh).create_pod is None
    stale = [ckpt("old"), ckpt("x", "Preemption", phase="Dumping", created="11:50:00")]
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=stale)
    assert p.create_pod is not None
    assert p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "old"


def test_vanished_pod_restores_the_newest_completed_checkpoint() -> None:
    sb = sandbox(dict(RUNNING, lastCheckpoint={"name": "c1", "reason": "Interval"}))
    objs = [ckpt("c1"), ckpt("c2", "Turn", created="11:30:00")]
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=objs)
    assert p.create_pod is not None
    assert p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "c2"
    assert "c2" not in p.delete_checkpoints


# -- plan(): restore outcome ------------------------------------------------------------

RESTORING = {"incarnation": 2, "podName": "minimal-2", "restores": 1,
             "lastCheckpoint": {"name": "c1", "reason": "Interval"}, "conditions": [
    {"type": "Restoring", "status": "True", "reason": "RestoreStarted", "message": "m",
     "lastTransitionTime": "2026-01-01T11:00:00Z"},
    {"type": "Migrating", "status": "True", "reason": "CheckpointCompleted", "message": "m",
     "lastTransitionTime": "2026-01-01T11:00:00Z"}]}


@pytest.mark.parametrize(
    ("outcome", "incarnation", "phase", "restores", "restoring_reason"),
    [
        (None, 2, "Migrating", 1, "RestoreStarted"),
        ("Restoring", 2, "Migrating", 1, "RestoreStarted"),
        ("Restored", 2, "Running", 2, "RestoreCompleted"),
        ("Restored", 1, "Migrating", 1, "RestoreStarted"),  # an older incarnation's pod
    ],
)
def test_restore_outcome(outcome: str | None, incarnation: int, phase: str, restores: int,
                         restoring_reason: str) -> None:
    sb = sandbox(dict(RESTORING))
    the_pod = pod("minimal-2", node="spot-2", incarnation=incarnation, restore_from="c1",
                  outcome=outcome, message="digest mismatch\nfor chunk 3")
    p = plan(sb, the_pod, NOW, settings=SETTINGS, checkpoints=[ckpt("c1")])
    assert p.status_patch["phase"] == phase
    assert p.status_patch["restores"] == restores
    assert cond(p, "Restoring")["reason"] == restoring_reason
    assert p.create_pod is None and p.delete_pod is None


def test_restore_source_is_protected_from_retention() -> None:
    sb = sandbox(dict(RESTORING), checkpoint={"retain": 1})
    objs = [ckpt("c1"), ckpt("c2", created="11:10:00")]
    restoring = pod("minimal-2", node="spot-2", incarnation=2, restore_from="c1")
    assert plan(sb, restoring, NOW, settings=SETTINGS, checkpoints=objs).delete_checkpoints == ()
    restored = pod("minimal-2", node="spot-2", incarnation=2, restore_from="c1",
                   outcome="Restored")
    p = plan(sb, restored, NOW, settings=SETTINGS, checkpoints=objs)
    assert p.delete_checkpoints == ()  # still protected while this plan ends the restore
    later = plan(after(p, sb), restored, NOW, settings=SETTINGS, checkpoints=objs)
    assert later.delete_checkpoints == ("c1",)


def test_retention_and_adoption_come_with_every_plan() -> None:
    sb = sandbox(dict(RUNNING), checkpoint={"retain": 2})
    objs = [ckpt(f"c{i}", created=f"11:0{i}:00", owned=i != 3) for i in range(4)]
    # c3: as a node-agent creates one (no owner), of the current incarnation on its node
    objs[3]["metadata"]["labels"] = {protocol.LABEL_SANDBOX: "minimal",
                                     protocol.LABEL_INCARNATION: "1",
                                     protocol.LABEL_NODE: "spot-1"}
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=objs)
    assert p.delete_checkpoints == ("c0", "c1")
    assert [name for name, _ in p.adopt_checkpoints] == ["c3"]
    patch = dict(p.adopt_checkpoints)["c3"]["metadata"]
    assert patch["annotations"] == {protocol.ANNOTATION_NODE_VERIFIED: "true"}


# -- plan(): suspend --------------------------------------------------------------------

def test_suspend_checkpoints_the_live_pod_before_releasing_it() -> None:
    sb = sandbox(dict(RUNNING), suspend=True)
    p = plan(sb, pod(), NOW, settings=SETTINGS)
    assert p.delete_pod is None and p.create_pod is None
    assert p.create_checkpoint is not None
    assert p.create_checkpoint["metadata"]["name"] == "minimal-1-suspend"
    assert p.create_checkpoint["spec"] == {"sandboxRef": {"name": "minimal"},
                                           "reason": "Suspend"}
    assert p.create_checkpoint["metadata"]["ownerReferences"][0]["uid"] == UID
    assert (cond(p, "Suspended")["status"], cond(p, "Suspended")["reason"]) == (
        "False", "SuspendRequested")
    sb = after(p, sb)
    asked = [ckpt("minimal-1-suspend", "Suspend", phase=None, created="11:59:00")]
    wait = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=asked)
    assert wait.create_checkpoint is None and wait.delete_pod is None
    dumping = [ckpt("minimal-1-suspend", "Suspend", phase="Dumping", created="11:59:00")]
    wait = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=dumping)
    assert wait.delete_pod is None and wait.status_patch["phase"] == "Checkpointing"
    durable = [ckpt("minimal-1-suspend", "Suspend", created="11:59:00")]
    done = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=durable)
    assert done.delete_pod == "minimal-1" and done.create_pod is None
    assert done.status_patch["phase"] == "Suspended"
    assert done.status_patch["lastCheckpoint"]["name"] == "minimal-1-suspend"
    # Resume restores the suspend checkpoint into incarnation 2.
    resumed = after(done, sb)
    resumed["spec"]["suspend"] = False
    r = plan(resumed, None, NOW, settings=SETTINGS, checkpoints=durable)
    assert r.create_pod is not None and r.create_pod["metadata"]["name"] == "minimal-2"
    assert r.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == (
        "minimal-1-suspend")


def test_failed_suspend_checkpoint_releases_the_pod_with_a_warning() -> None:
    sb = sandbox(dict(RUNNING, lastCheckpoint={"name": "c0", "reason": "Interval"}),
                 suspend=True)
    objs = [ckpt("c0", created="10:40:00"),
            ckpt("minimal-1-suspend", "Suspend", phase="Failed", created="11:59:00",
                 message="criu: dump failed")]
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=objs)
    assert p.delete_pod == "minimal-1" and p.status_patch["phase"] == "Suspended"
    warnings = [e.message for e in p.events if e.type == "Warning"]
    assert any("resuming restores c0" in m for m in warnings)


def test_suspend_of_a_pod_that_is_not_running_releases_it_at_once() -> None:
    p = plan(sandbox(dict(RUNNING), suspend=True), pod(phase="Pending"), NOW, settings=SETTINGS)
    assert p.delete_pod == "minimal-1" and p.create_checkpoint is None


# -- node trust: a node-agent can only vouch for sandboxes that ran on its node ----------

def _as_node_agent(name: str, reason: str, node: str, incarnation: int = 1,
                   phase: str | None = "Completed", created: str = "11:30:00") -> dict[str, Any]:
    """A Checkpoint as a node-agent creates it (labels, no owner, no verified mark)."""
    out = ckpt(name, reason, phase, created=created, node=node, owned=False)
    out["metadata"]["labels"] = {protocol.LABEL_SANDBOX: "minimal",
                                 protocol.LABEL_INCARNATION: str(incarnation),
                                 protocol.LABEL_NODE: node}
    return out


def test_a_checkpoint_labelled_for_another_node_is_failed_and_never_restored() -> None:
    sb = sandbox({**RUNNING, "nodeName": "spot-1"})
    good = ckpt("good", created="11:00:00")
    forged = _as_node_agent("minimal-1-preempt", "Preemption", node="spot-9")
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[good, forged])
    [(name, status)] = p.fail_checkpoints
    assert name == "minimal-1-preempt" and status["phase"] == "Failed"
    assert "labelled for node spot-9, but incarnation 1 runs on node spot-1" in status["message"]
    assert "CheckpointUntrusted" in [e.reason for e in p.events]
    assert p.delete_pod is None and p.create_pod is None, "the forged stop ends nothing"
    # the pod is lost: the restore takes the verified checkpoint, not the forged one
    lost = pod(phase="Failed")
    lost["status"]["reason"] = "NodeLost"
    p = plan(sb, lost, NOW, settings=SETTINGS, checkpoints=[good, forged])
    assert p.create_pod is not None
    assert p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "good"


def test_the_stopping_checkpoint_of_the_current_node_is_trusted_at_once() -> None:
    sb = sandbox({**RUNNING, "nodeName": "spot-1"})
    stop = _as_node_agent("minimal-1-preempt", "Preemption", node="spot-1")
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[stop])
    assert p.fail_checkpoints == ()
    assert p.delete_pod == "minimal-1"
    [(_, patch)] = p.adopt_checkpoints
    assert patch["metadata"]["annotations"] == {protocol.ANNOTATION_NODE_VERIFIED: "true"}


def test_an_unverified_checkpoint_of_an_earlier_incarnation_is_not_restored() -> None:
    """Once incarnation 1 ended, nobody can tell where a checkpoint of it claiming to be
    made later ran: only the ones verified while it ran are restore sources."""
    sb = sandbox({**RUNNING, "incarnation": 2, "podName": "minimal-2", "nodeName": "spot-2"})
    old = ckpt("verified", created="11:00:00")
    late = _as_node_agent("late", "Interval", node="spot-1", incarnation=1, created="11:40:00")
    lost = pod("minimal-2", phase="Failed", node="spot-2", incarnation=2)
    lost["status"]["reason"] = "NodeLost"
    p = plan(sb, lost, NOW, settings=SETTINGS, checkpoints=[old, late])
    assert p.create_pod is not None
    assert p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "verified"


def test_a_manual_request_is_bound_to_the_current_pod_node() -> None:
    sb = sandbox({**RUNNING, "nodeName": "spot-1"})
    manual = ckpt("manual", "Manual", phase=None, owned=False)
    manual["metadata"]["labels"] = {protocol.LABEL_SANDBOX: "minimal"}
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[manual])
    [(_, patch)] = p.adopt_checkpoints
    assert patch["metadata"]["labels"] == {protocol.LABEL_NODE: "spot-1",
                                           protocol.LABEL_INCARNATION: "1"}
    assert patch["metadata"]["annotations"] == {protocol.ANNOTATION_NODE_VERIFIED: "true"}


def test_requests_the_operator_makes_name_the_pod_node() -> None:
    sb = sandbox(dict(RUNNING), suspend=True)
    p = plan(sb, pod(), NOW, settings=SETTINGS)
    assert p.create_checkpoint is not None
    meta = p.create_checkpoint["metadata"]
    assert meta["labels"][protocol.LABEL_NODE] == "spot-1"
    assert meta["annotations"] == {protocol.ANNOTATION_NODE_VERIFIED: "true"}
