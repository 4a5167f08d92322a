"""A move's replacement pod created while its checkpoint is taken (overlap.py): the plans
from the notice to the restore, and every way the overlap can end otherwise."""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_common.settings import OperatorSettings
from hermit_operator import overlap, podspec
from hermit_operator.checkpoints import STOPPING_WAIT
from hermit_operator.reconcile import Plan, plan
from tests.support.operator_driver import FakeKube, run
from tests.support.operator_driver import sandbox as sandbox  # the fixture, re-exported
from tests.support.operator_objects import (
    NOW,
    RUNNING,
    SETTINGS,
    after,
    ckpt,
    cond,
    pod,
)
from tests.support.operator_objects import sandbox as make_sandbox

OFF = OperatorSettings(overlap_moves=False)
PREEMPT = "minimal-1-preempt"


def stop(phase: str | None = "Dumping", *, name: str = PREEMPT, reason: str = "Preemption",
         incarnation: int = 1, created: str = "11:59:50", **kw: Any) -> dict[str, Any]:
    """A stopping checkpoint of pod minimal-1 (incarnation 1), taken by the node-agent."""
    c = ckpt(name, reason, phase, created=created, **kw)
    c["metadata"]["labels"][protocol.LABEL_INCARNATION] = str(incarnation)
    return c


def reasons(p: Plan) -> list[str]:
    return [e.reason for e in p.events]


def early(sb: dict[str, Any], checkpoints: list[dict[str, Any]],
          settings: OperatorSettings = SETTINGS) -> tuple[Plan, dict[str, Any]]:
    """The plan at the notice and the replacement it creates, as the API returns it."""
    p = plan(sb, pod(), NOW, settings=settings, checkpoints=checkpoints)
    assert p.create_pod is not None
    made = copy.deepcopy(p.create_pod)
    made["metadata"]["creationTimestamp"] = "2026-01-01T11:59:51Z"
    made["spec"]["nodeName"] = "spot-2"
    made["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    return p, made


def test_the_replacement_is_created_at_the_notice_and_the_old_pod_kept() -> None:
    sb = make_sandbox(dict(RUNNING))
    p, made = early(sb, [stop()])
    assert p.delete_pod is None and p.delete_replacement is None
    assert made["metadata"]["name"] == "minimal-2"
    assert made["metadata"]["labels"][protocol.LABEL_INCARNATION] == "2"
    assert overlap.source_of(made) == PREEMPT
    command = made["spec"]["containers"][0]["command"]
    assert command[command.index("--restore-timeout") + 1] == "600"
    # The status still names the old pod: it is frozen and checkpointed, not gone.
    s = p.status_patch
    assert (s["incarnation"], s["podName"]) == (1, "minimal-1")
    assert "restoredFrom" not in s
    assert cond(p, "Checkpointing")["status"] == "True"
    assert api.REASON_REPLACEMENT_CREATED in reasons(p)
    again = plan(after(p, sb), pod(), NOW, settings=SETTINGS, checkpoints=[stop("Uploading")],
                 replacement=made)
    assert again.create_pod is None and again.delete_replacement is None
    assert again.delete_pod is None and again.events == ()


@pytest.mark.parametrize("reason", ["Preemption", "Eviction"])
def test_completed_checkpoint_deletes_the_old_pod_and_adopts_the_replacement(reason: str
                                                                             ) -> None:
    sb = make_sandbox(dict(RUNNING))
    p, made = early(sb, [stop(reason=reason)])
    sb = after(p, sb)
    done = stop("Completed", reason=reason, done="11:59:55")
    moved = plan(sb, pod(phase="Failed"), NOW, settings=SETTINGS, checkpoints=[done],
                 replacement=made)
    assert moved.delete_pod == "minimal-1"
    assert moved.create_pod is None and moved.delete_replacement is None
    s = moved.status_patch
    assert (s["incarnation"], s["podName"], s["nodeName"]) == (2, "minimal-2", "spot-2")
    assert s["restoredFrom"]["name"] == PREEMPT and s["restoredFrom"]["staleSeconds"] == 0
    assert cond(moved, "Restoring")["status"] == "True"
    assert cond(moved, "Migrating")["status"] == "True"
    assert any("created while checkpoint" in e.message for e in moved.events)
    # The node-agent restores it: one restore, the move's downtime from the notice.
    restored = copy.deepcopy(made)
    restored["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_PHASE] = protocol.RESTORED
    up = plan(after(moved, sb), restored, NOW + timedelta(seconds=5), settings=SETTINGS,
              checkpoints=[done])
    assert up.status_patch["restores"] == 1
    assert up.downtime == (reason.lower(), 15.0)
    assert cond(up, "Restoring")["status"] == "False"
    assert cond(up, "Migrating")["status"] == "False"


def test_overlap_off_creates_the_replacement_only_once_the_checkpoint_is_completed() -> None:
    sb = make_sandbox(dict(RUNNING))
    p = plan(sb, pod(), NOW, settings=OFF, checkpoints=[stop()])
    assert p.create_pod is None and api.REASON_REPLACEMENT_CREATED not in reasons(p)
    moved = plan(after(p, sb), pod(), NOW, settings=OFF,
                 checkpoints=[stop("Completed", done="11:59:55")])
    assert moved.delete_pod == "minimal-1" and moved.create_pod is not None
    command = moved.create_pod["spec"]["containers"][0]["command"]
    assert command[command.index("--restore-timeout") + 1] == "300"


def test_no_replacement_for_a_suspend_or_an_interval_checkpoint() -> None:
    sb = make_sandbox(dict(RUNNING))
    for c in (stop(name="minimal-1-suspend", reason="Suspend"),
              stop(name="minimal-1-i1", reason="Interval")):
        assert plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[c]).create_pod is None


def test_failed_checkpoint_deletes_the_replacement_and_the_old_pod_runs_on() -> None:
    sb = make_sandbox(dict(RUNNING))
    p, made = early(sb, [stop()])
    sb = after(p, sb)
    failed = stop("Failed", message="upload failed: S3 unreachable")
    f = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[failed], replacement=made)
    assert f.delete_replacement == "minimal-2"
    assert f.delete_pod is None and f.create_pod is None
    s = f.status_patch
    assert (s["incarnation"], s["podName"], s["phase"]) == (1, "minimal-1", "Running")
    assert "restoredFrom" not in s
    assert cond(f, "Checkpointing")["reason"] == "CheckpointFailed"
    assert cond(f, "Ready")["status"] == "True"
    assert reasons(f) == ["CheckpointFailed", api.REASON_REPLACEMENT_DELETED]
    assert "checkpoint minimal-1-preempt failed; the sandbox goes on in pod minimal-1" in \
        f.events[-1].message
    # While it terminates nothing more is asked; the retry request then gets its own.
    going = {**made, "metadata": {**made["metadata"], "deletionTimestamp": "2026-01-01T12:00:01Z"}}
    retry = stop(name=f"{PREEMPT}-r2", created="12:00:00")
    waiting = plan(after(f, sb), pod(), NOW, settings=SETTINGS, checkpoints=[failed, retry],
                   replacement=going)
    assert waiting.create_pod is None and waiting.delete_replacement is None
    fresh = plan(after(f, sb), pod(), NOW, settings=SETTINGS, checkpoints=[failed, retry])
    assert fresh.create_pod is not None and overlap.source_of(fresh.create_pod) == retry[
        "metadata"]["name"]


def test_a_replacement_that_ended_while_waiting_is_replaced() -> None:
    sb = make_sandbox(dict(RUNNING))
    p, made = early(sb, [stop()])
    ended = {**made, "status": {"phase": "Failed"}}
    q = plan(after(p, sb), pod(), NOW, settings=SETTINGS, checkpoints=[stop()], replacement=ended)
    assert q.delete_replacement == "minimal-2" and q.create_pod is None
    assert q.status_patch["podName"] == "minimal-1"
    # Once it is gone, the next plan creates it again.
    again = plan(after(p, sb), pod(), NOW, settings=SETTINGS, checkpoints=[stop()])
    assert again.create_pod is not None


def test_old_pod_gone_before_completed_keeps_the_replacement_waiting() -> None:
    sb = make_sandbox(dict(RUNNING))
    p, made = early(sb, [stop()])
    q = plan(after(p, sb), None, NOW, settings=SETTINGS, checkpoints=[stop()], replacement=made)
    assert q.delete_replacement is None and q.create_pod is None
    assert cond(q, "Ready")["reason"] == "CheckpointInProgress"
    # It completes after all: the waiting replacement is adopted, nothing was lost.
    done = stop("Completed", done="11:59:58")
    r = plan(after(q, after(p, sb)), None, NOW, settings=SETTINGS, checkpoints=[done],
             replacement=made)
    assert r.create_pod is None and r.delete_replacement is None
    assert r.status_patch["podName"] == "minimal-2"
    assert r.status_patch["restoredFrom"]["staleSeconds"] == 0


def test_node_lost_before_completed_restores_the_newest_completed_one_reported_stale() -> None:
    sb = make_sandbox(dict(RUNNING, lastCheckpoint={"name": "c1"}))
    interval = stop("Completed", name="c1", reason="Interval", created="11:00:00")
    p, made = early(sb, [interval, stop()])
    sb = after(p, sb)
    late = NOW + STOPPING_WAIT + timedelta(seconds=1)  # the checkpoint never finished
    q = plan(sb, None, late, settings=SETTINGS, checkpoints=[interval, stop()], replacement=made)
    # The replacement waits for the wrong checkpoint: it goes first, nothing is created.
    assert q.delete_replacement == "minimal-2" and q.create_pod is None
    assert cond(q, "Ready")["reason"] == "PodTerminating"
    r = plan(after(q, sb), None, late, settings=SETTINGS, checkpoints=[interval, stop()])
    assert r.create_pod is not None and overlap.source_of(r.create_pod) == "c1"
    assert r.status_patch["restoredFrom"]["staleSeconds"] > 0
    assert api.REASON_WORK_LOST in reasons(r)


def test_a_terminal_or_suspended_sandbox_deletes_a_leftover_replacement() -> None:
    sb = make_sandbox(dict(RUNNING))
    _, made = early(sb, [stop()])
    suspended = make_sandbox(dict(RUNNING), suspend=True)
    q = plan(suspended, pod(), NOW, settings=SETTINGS, checkpoints=[stop("Failed")],
             replacement=made)
    assert q.delete_replacement == "minimal-2"


def test_a_replacement_of_another_checkpoint_is_not_adopted() -> None:
    sb = make_sandbox(dict(RUNNING))
    _, made = early(sb, [stop()])
    done = stop("Completed", name=f"{PREEMPT}-r2", done="11:59:59")
    q = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[stop("Failed"), done],
             replacement=made)
    assert q.delete_replacement == "minimal-2" and q.create_pod is None
    assert q.delete_pod is None  # the old pod goes with the move, once the way is clear
    assert q.status_patch["incarnation"] == 1  # podName is left as it is (a merge patch)
    assert q.status_patch.get("podName", "minimal-1") == "minimal-1"


# -- overlap.py ---------------------------------------------------------------------------

def test_replacement_name_only_while_a_migrating_checkpoint_of_the_incarnation_exists() -> None:
    sb = make_sandbox(dict(RUNNING))
    assert overlap.replacement_name(sb, [stop()]) == "minimal-2"
    assert overlap.replacement_name(sb, [stop("Failed")]) == "minimal-2"
    assert overlap.replacement_name(sb, [stop(incarnation=0)]) is None
    assert overlap.replacement_name(sb, [stop(reason="Suspend")]) is None
    assert overlap.replacement_name(make_sandbox(), [stop()]) is None


def test_replacement_of_checks_the_owner_and_the_incarnation() -> None:
    sb = make_sandbox(dict(RUNNING))
    _, made = early(sb, [stop()])
    assert overlap.replacement_of(sb, made) == made
    foreign = copy.deepcopy(made)
    foreign["metadata"]["ownerReferences"][0]["uid"] = "other"
    assert overlap.replacement_of(sb, foreign) is None
    assert overlap.replacement_of(make_sandbox(dict(RUNNING, incarnation=2)), made) is None
    assert overlap.replacement_of(sb, None) is None


def test_adoptable_needs_the_same_checkpoint_and_capacity() -> None:
    sb = make_sandbox(dict(RUNNING))
    _, made = early(sb, [stop()])
    wanted = podspec.build_sandbox_pod(sb, SETTINGS, 2, PREEMPT)
    assert overlap.adoptable(made, wanted)
    assert not overlap.adoptable(made, podspec.build_sandbox_pod(sb, SETTINGS, 2, "c1"))
    assert not overlap.adoptable(made, podspec.build_sandbox_pod(sb, SETTINGS, 2, None))
    spot = make_sandbox(dict(RUNNING), placement={"spot": True})
    assert not overlap.adoptable(
        podspec.build_sandbox_pod(spot, SETTINGS, 2, PREEMPT),
        podspec.build_sandbox_pod(spot, SETTINGS, 2, PREEMPT, on_demand=True))


# -- the driver: the replacement is found again by its name (an operator restart) ---------------

def test_driver_finds_the_replacement_by_name_and_adopts_it(sandbox: dict[str, Any]) -> None:
    kube, events = FakeKube(sandbox), []
    run(kube, events)  # creates minimal-1
    kube.pods["minimal-1"]["status"] = {"phase": "Running"}
    c = stop(created="11:59:00")
    c["metadata"]["ownerReferences"][0]["uid"] = sandbox["metadata"]["uid"]
    kube.checkpoints[PREEMPT] = c
    kube.calls.clear()
    run(kube, events)
    assert [x for x in kube.calls if "pdb" not in x] == ["create minimal-2"]
    assert kube.sandbox["status"]["podName"] == "minimal-1"
    kube.calls.clear()
    run(kube, events)  # a restarted operator: the same pods, nothing new
    assert [x for x in kube.calls if "pdb" not in x] == []
    kube.checkpoints[PREEMPT] = stop("Completed", created="11:59:00", done="11:59:30")
    kube.checkpoints[PREEMPT]["metadata"]["ownerReferences"][0]["uid"] = \
        sandbox["metadata"]["uid"]
    kube.calls.clear()
    run(kube, events)
    assert [x for x in kube.calls if "pdb" not in x] == ["delete minimal-1"]
    assert kube.sandbox["status"]["podName"] == "minimal-2"
    assert kube.sandbox["status"]["incarnation"] == 2
