"""A node cannot block or pre-empt another node's checkpoints (issue 17, Deliver 4).

Any node-agent may create Checkpoints labelled with its own node for any sandbox: the API
server's policy cannot tell where a sandbox runs. The operator decides what counts
(checkpoints.counts, checkpoints.mislabelled): a Checkpoint labelled with another node than
the one the current incarnation runs on is ignored, and failed as CheckpointUntrusted when
it claims the current incarnation (or a later one, or none). Pure plan() tests."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_operator import checkpoints as ck
from hermit_operator.reconcile import plan
from tests.support.operator_objects import (
    NOW,
    RUNNING,
    SETTINGS,
    ckpt,
    interval_sandbox,
    pod,
    ready_pod,
    sandbox,
)

HERE = "spot-1"  # where the sandbox's pod runs (the fixtures' default)
THERE = "spot-9"  # a compromised node


def by_node(name: str, reason: str, node: str, *, incarnation: int | None = 1,
            phase: str | None = None, created: str = "11:58:00",
            status: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Checkpoint as a node-agent creates it: labels, no owner, no verified mark."""
    out = ckpt(name, reason, phase, created=created, node=node, owned=False)
    labels = {protocol.LABEL_SANDBOX: "minimal", protocol.LABEL_NODE: node}
    if incarnation is not None:
        labels[protocol.LABEL_INCARNATION] = str(incarnation)
    out["metadata"]["labels"] = labels
    if status is not None:
        out["status"] = status
    return out


WHERE = ck.Where(1, HERE)


@pytest.mark.parametrize(("obj", "counts", "failed"), [
    (ckpt("verified", node=THERE), True, False),  # marked by the operator: always counts
    (by_node("here", "Preemption", HERE), True, False),
    (by_node("here-old", "Preemption", HERE, incarnation=0), True, False),
    (by_node("there", "Preemption", THERE), False, True),
    (by_node("there-later", "Preemption", THERE, incarnation=2), False, True),
    (by_node("there-none", "Preemption", THERE, incarnation=None), False, True),
    # an older incarnation's, from the node it ran on before: only ignored
    (by_node("there-old", "Preemption", THERE, incarnation=0), False, False),
])
def test_what_counts_and_what_is_failed(obj: dict[str, Any], counts: bool, failed: bool) -> None:
    assert ck.counts(obj, WHERE) is counts
    assert ck.mislabelled(obj, WHERE) is failed


def test_a_user_request_counts_and_nothing_node_labelled_counts_without_a_node() -> None:
    manual = ckpt("manual", "Manual", phase=None, owned=False)
    manual["metadata"]["labels"] = {protocol.LABEL_SANDBOX: "minimal"}
    assert ck.counts(manual, WHERE) and not ck.mislabelled(manual, WHERE)
    nowhere = ck.Where(1, None)
    assert not ck.counts(by_node("here", "Preemption", HERE), nowhere)
    assert not ck.mislabelled(by_node("here", "Preemption", HERE), nowhere)


@pytest.mark.parametrize("squat", [
    by_node("p", "Preemption", THERE),  # Pending, of the current incarnation
    by_node("p", "Manual", THERE, incarnation=None),  # Pending, of no incarnation
    by_node("p", "Turn", THERE, incarnation=0),  # Pending, of an older incarnation
    # claimed as if taken from the sandbox's node
    by_node("p", "Turn", THERE, incarnation=0, phase="Dumping",
            status={"phase": "Dumping", "nodeName": HERE}),
    # failed "in the future": the newest finished checkpoint would hold the interval back
    by_node("p", "Turn", THERE, incarnation=0,
            status={"phase": "Failed", "completedAt": "2026-01-02T12:00:00Z"}),
])
def test_another_nodes_checkpoint_never_holds_back_an_interval_checkpoint(
        squat: dict[str, Any]) -> None:
    real = ckpt("c1", created="11:50:00")
    p = plan(interval_sandbox(), ready_pod(), NOW, settings=SETTINGS, checkpoints=[real, squat])
    assert p.create_checkpoint is not None, "the interval request is made all the same"
    assert p.create_checkpoint["metadata"]["name"] == ck.interval_checkpoint_name(
        "minimal", 1, NOW)


def test_a_request_another_node_made_for_this_incarnation_is_failed_and_stops_nothing() -> None:
    sb = sandbox({**RUNNING, "nodeName": HERE})
    squat = by_node("minimal-1-preempt", "Preemption", THERE)
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[squat])
    [(name, status)] = p.fail_checkpoints
    assert name == "minimal-1-preempt" and status["phase"] == "Failed"
    assert "ignored and never restored" in status["message"]
    assert [e.reason for e in p.events if e.type == "Warning"] == [
        api.REASON_CHECKPOINT_UNTRUSTED]
    # no replacement pod is made for it (overlap), the running pod is left alone
    assert p.create_pod is None and p.delete_pod is None
    assert p.status_patch["phase"] == "Running"
    # Completed "by" the other node (it may write the status of what it labelled): still no move
    done = by_node("minimal-1-preempt", "Preemption", THERE, status={
        "phase": "Completed", "nodeName": HERE, "completedAt": "2026-01-01T11:59:00Z"})
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[done])
    assert p.create_pod is None and p.delete_pod is None
    assert [n for n, _ in p.fail_checkpoints] == ["minimal-1-preempt"]


def test_the_real_stopping_checkpoint_under_its_tagged_name_moves_the_sandbox() -> None:
    """The squatter holds minimal-1-preempt; the node that runs the sandbox made its request
    as minimal-1-preempt-<tag> (hermit_node/control/requests.py): that one counts and completes."""
    sb = sandbox({**RUNNING, "nodeName": HERE})
    squat = by_node("minimal-1-preempt", "Preemption", THERE)
    real = by_node("minimal-1-preempt-0a1b2c3d", "Preemption", HERE, status={
        "phase": "Completed", "nodeName": HERE, "completedAt": "2026-01-01T11:59:00Z",
        "manifestDigest": "sha256:" + "ab" * 32})
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[squat, real])
    assert p.delete_pod == "minimal-1"
    assert p.create_pod is not None
    assert p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == \
        "minimal-1-preempt-0a1b2c3d"
    assert [n for n, _ in p.fail_checkpoints] == ["minimal-1-preempt"]
    marks = {n: patch["metadata"].get("annotations") for n, patch in p.adopt_checkpoints}
    assert marks["minimal-1-preempt-0a1b2c3d"] == {protocol.ANNOTATION_NODE_VERIFIED: "true"}
    assert "minimal-1-preempt" not in marks, "the squatter's is neither owned nor verified"


def test_another_nodes_in_flight_stop_makes_no_replacement_pod_while_nothing_is_placed() -> None:
    """The pod is not scheduled yet (no node): no node-agent can have taken a checkpoint of
    it, so a node-labelled one counts for nothing (no overlap pod waits for it)."""
    sb = sandbox({"incarnation": 1, "podName": "minimal-1", "restores": 0})
    pending = pod(phase="Pending")
    pending["spec"] = {}
    squat = by_node("minimal-1-preempt", "Preemption", THERE)
    p = plan(sb, pending, NOW, settings=SETTINGS, checkpoints=[squat])
    assert p.create_pod is None and p.delete_pod is None and p.fail_checkpoints == ()


def test_refused_checkpoints_are_kept_as_evidence_up_to_retain_then_deleted() -> None:
    sb = sandbox({**RUNNING, "nodeName": HERE}, checkpoint={"retain": 2})
    refused = [by_node(f"junk-{i}", "Turn", THERE, status={
        "phase": "Failed", "completedAt": f"2026-01-01T11:{10 + i}:00Z"}) for i in range(5)]
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=refused)
    assert sorted(p.delete_checkpoints) == ["junk-0", "junk-1", "junk-2"]
    assert p.fail_checkpoints == ()  # failed already: no second Warning


def test_a_verified_checkpoint_from_the_old_node_still_restores_after_a_move() -> None:
    """What the operator verified while incarnation 1 ran on spot-1 stays restorable once
    incarnation 2 runs elsewhere."""
    sb = sandbox({**RUNNING, "incarnation": 2, "podName": "minimal-2", "nodeName": "spot-2"})
    lost = pod("minimal-2", phase="Failed", node="spot-2", incarnation=2)
    lost["status"]["reason"] = "NodeLost"
    p = plan(sb, lost, NOW + timedelta(seconds=1), settings=SETTINGS,
             checkpoints=[ckpt("old", created="11:00:00", node=HERE)])
    assert p.create_pod is not None
    assert p.create_pod["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_FROM] == "old"


def test_a_stopping_checkpoint_of_another_incarnation_on_the_same_node_ends_nothing() -> None:
    """A look-alike pod of the sandbox on its node (made by someone else, another
    incarnation label) checkpointed there does not end, nor replace, the current pod."""
    sb = sandbox({**RUNNING, "nodeName": HERE})
    other = by_node("minimal-7-preempt", "Preemption", HERE, incarnation=7, status={
        "phase": "Completed", "nodeName": HERE, "completedAt": "2026-01-01T11:59:00Z"})
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[other])
    assert p.delete_pod is None and p.create_pod is None
    mine = by_node("minimal-1-preempt", "Preemption", HERE, status={
        "phase": "Completed", "nodeName": HERE, "completedAt": "2026-01-01T11:59:00Z"})
    assert plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[mine]).delete_pod == "minimal-1"
