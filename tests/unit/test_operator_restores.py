"""Restores without dead ends, and losses that say what they cost: pure plan() tests.

A failed restore is retried with the same checkpoint (with a backoff) when the
node-agent says it may pass, falls back to the previous checkpoint when it was refused
(or failed too often), and starts from scratch only when nothing older exists;
status.restoredFrom records what each incarnation restored and how stale it was.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_operator import checkpoints as ck
from hermit_operator.conditions import is_true
from hermit_operator.reconcile import Plan, plan
from tests.support.operator_objects import NOW, RUNNING, SETTINGS, after, ckpt, cond, pod
from tests.support.operator_objects import sandbox as make_sandbox

C1_RECORD = {"name": "c1", "reason": "Interval", "checkpointTime": "2026-01-01T11:00:00Z",
             "staleSeconds": 0, "fallback": False}
RESTORING = {"incarnation": 2, "podName": "minimal-2", "restores": 1,
             "lastCheckpoint": {"name": "c1", "reason": "Interval"},
             "restoredFrom": C1_RECORD, "conditions": [
    {"type": "Restoring", "status": "True", "reason": "RestoreStarted", "message": "m",
     "lastTransitionTime": "2026-01-01T11:00:00Z"},
    {"type": "Migrating", "status": "True", "reason": "CheckpointCompleted", "message": "m",
     "lastTransitionTime": "2026-01-01T11:00:00Z"}]}
CKPTS = [ckpt("c0", created="10:40:00"), ckpt("c1")]


def failed_pod(retryable: str | None = None, *, incarnation: int = 2, source: str = "c1",
               phase: str = "Running") -> dict[str, Any]:
    p = pod(f"minimal-{incarnation}", phase=phase, node="spot-2", incarnation=incarnation,
            restore_from=source, outcome="Failed", message="s3 unreachable\n(timeout)")
    if retryable is not None:
        p["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_RETRYABLE] = retryable
    return p


def restoring(**status: Any) -> dict[str, Any]:
    return make_sandbox({**RESTORING, **status})


def restore_source(p: Plan) -> str | None:
    assert p.create_pod is not None
    return p.create_pod["metadata"]["annotations"].get(protocol.ANNOTATION_RESTORE_FROM)


def event_types(p: Plan) -> list[tuple[str, str]]:
    return [(e.type, e.reason) for e in p.events]


# -- retryable failures -----------------------------------------------------------------

@pytest.mark.parametrize("retryable", [None, "true", "True"])
def test_transient_failure_schedules_a_retry_of_the_same_checkpoint(retryable: str | None
                                                                    ) -> None:
    sb = restoring()
    p = plan(sb, failed_pod(retryable), NOW, settings=SETTINGS, checkpoints=CKPTS)
    assert p.delete_pod == "minimal-2" and p.create_pod is None
    s = p.status_patch
    assert (s["restoreAttempts"], s["nextRestoreAt"]) == (1, "2026-01-01T12:00:05Z")
    assert (s["podName"], s["nodeName"], s["restoredFrom"]) == (None, None, C1_RECORD)
    assert p.requeue_after == 5.0
    for type_ in ("Restoring", "Ready"):
        assert cond(p, type_)["reason"] == "RestoreRetrying"
    assert cond(p, "Restoring")["status"] == "True" and cond(p, "Ready")["status"] == "False"
    message = cond(p, "Restoring")["message"]
    assert "attempt 1 of 10" in message and "s3 unreachable (timeout)" in message
    assert "attempt 2 at 2026-01-01T12:00:05Z" in message
    assert cond(p, "Failed")["status"] == "False"
    assert s["phase"] == "Migrating"  # still moving; nothing failed for good
    assert event_types(p) == [("Warning", "RestoreFailed")]
    assert "c1" not in p.delete_checkpoints


def test_retry_waits_for_next_restore_at_then_restores_the_same_checkpoint() -> None:
    sb = restoring()
    failed = plan(sb, failed_pod(), NOW, settings=SETTINGS, checkpoints=CKPTS)
    waiting = after(failed, sb)
    early = plan(waiting, None, NOW + timedelta(seconds=2), settings=SETTINGS,
                 checkpoints=CKPTS)
    assert early.create_pod is None and early.delete_pod is None and early.events == ()
    assert early.requeue_after == pytest.approx(3.0)
    assert cond(early, "Restoring")["reason"] == "RestoreRetrying"
    due = plan(waiting, None, NOW + timedelta(seconds=5), settings=SETTINGS, checkpoints=CKPTS)
    assert restore_source(due) == "c1" and due.requeue_after is None
    assert due.status_patch["incarnation"] == 3 and due.status_patch["podName"] == "minimal-3"
    assert due.status_patch["nextRestoreAt"] is None
    assert "restoreAttempts" not in due.status_patch  # counted until a restore succeeds
    assert due.status_patch["restoredFrom"] == C1_RECORD
    assert (cond(due, "Restoring")["reason"], due.status_patch["phase"]) == (
        "RestoreRetrying", "Migrating")
    assert "attempt 2 of 10" in cond(due, "Restoring")["message"]
    assert event_types(due) == [("Normal", "RestoreRetrying")]
    # The second pod restores: the attempts are forgotten.
    retried = after(due, waiting)
    done = pod("minimal-3", node="spot-3", incarnation=3, restore_from="c1", outcome="Restored")
    up = plan(retried, done, NOW + timedelta(seconds=9), settings=SETTINGS, checkpoints=CKPTS)
    assert (up.status_patch["restoreAttempts"], up.status_patch["restores"]) == (None, 2)
    assert up.status_patch["phase"] == "Running"


def test_backoff_doubles_up_to_five_minutes() -> None:
    assert [ck.restore_backoff(n) for n in range(1, 10)] == [
        5, 10, 20, 40, 80, 160, 300, 300, 300]
    p = plan(restoring(restoreAttempts=3), failed_pod(), NOW, settings=SETTINGS,
             checkpoints=CKPTS)
    assert p.status_patch["restoreAttempts"] == 4 and p.requeue_after == 40.0


def test_a_pod_that_ends_before_its_restore_finished_is_a_transient_failure() -> None:
    ended = pod("minimal-2", phase="Failed", node="spot-2", incarnation=2, restore_from="c1")
    p = plan(restoring(), ended, NOW, settings=SETTINGS, checkpoints=CKPTS)
    assert p.delete_pod == "minimal-2" and p.status_patch["restoreAttempts"] == 1
    assert "ended before its restore finished" in cond(p, "Restoring")["message"]
    assert cond(p, "Failed")["status"] == "False"


def test_a_retry_whose_checkpoint_is_gone_falls_back() -> None:
    sb = restoring(restoreAttempts=2, nextRestoreAt="2026-01-01T11:59:00Z", podName=None)
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[ckpt("c0", created="10:40:00")])
    assert restore_source(p) == "c0" and p.status_patch["restoredFrom"]["fallback"] is True
    assert (p.status_patch["restoreAttempts"], p.status_patch["nextRestoreAt"]) == (None, None)
    assert "c1 no longer exists" in cond(p, "Restoring")["message"]


def test_the_checkpoint_awaiting_a_retry_is_kept_by_retention() -> None:
    sb = restoring(restoreAttempts=1, nextRestoreAt="2026-01-01T12:00:05Z", podName=None,
                   restoredFrom={**C1_RECORD, "name": "c0"})
    sb["spec"]["checkpoint"] = {"retain": 1}
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=CKPTS)
    assert p.create_pod is None and p.delete_checkpoints == ()


# -- refusals and exhausted retries: fall back ------------------------------------------

def test_refused_checkpoint_falls_back_to_the_previous_one() -> None:
    sb = restoring()
    p = plan(sb, failed_pod("false"), NOW, settings=SETTINGS, checkpoints=CKPTS)
    assert p.delete_pod == "minimal-2" and restore_source(p) == "c0"
    assert p.status_patch["restoredFrom"] == {
        "name": "c0", "reason": "Interval", "checkpointTime": "2026-01-01T10:40:00Z",
        "staleSeconds": 4800, "fallback": True}
    assert p.requeue_after is None and "restoreAttempts" not in p.status_patch
    assert (cond(p, "Restoring")["status"], cond(p, "Restoring")["reason"]) == (
        "True", "RestoreFallback")
    assert event_types(p) == [("Warning", "RestoreFallback")]
    message = p.events[0].message
    assert "checkpoint c1 could not be restored" in message and "refused" in message
    assert "older checkpoint c0, taken 4800s ago, into pod minimal-3" in message
    assert not is_true(p.status_patch["conditions"], "Failed")
    assert "c0" not in p.delete_checkpoints


def test_refused_checkpoint_with_nothing_older_starts_fresh_and_says_so() -> None:
    sb = restoring()
    p = plan(sb, failed_pod("false"), NOW, settings=SETTINGS, checkpoints=[ckpt("c1")])
    assert p.delete_pod == "minimal-2" and p.create_pod is not None
    assert restore_source(p) is None
    assert p.status_patch["restoredFrom"] is None
    for type_ in ("Restoring", "Migrating"):
        assert (cond(p, type_)["status"], cond(p, type_)["reason"]) == (
            "False", "NoUsableCheckpoint")
    assert "from scratch" in cond(p, "Restoring")["message"]
    assert event_types(p) == [("Warning", "NoUsableCheckpoint")]
    assert p.status_patch["phase"] == "Pending"


def test_ten_failed_attempts_fall_back_like_a_refusal() -> None:
    p = plan(restoring(restoreAttempts=9), failed_pod("true"), NOW, settings=SETTINGS,
             checkpoints=CKPTS)
    assert restore_source(p) == "c0" and p.status_patch["restoreAttempts"] is None
    assert "10 attempts failed" in p.events[0].message


def test_a_refused_fallback_falls_back_further() -> None:
    objs = [ckpt("cx", created="10:20:00"), *CKPTS]
    sb = restoring(restoredFrom={**C1_RECORD, "name": "c0", "fallback": True,
                                 "checkpointTime": "2026-01-01T10:40:00Z"})
    p = plan(sb, failed_pod("false", source="c0"), NOW, settings=SETTINGS, checkpoints=objs)
    assert restore_source(p) == "cx"


def test_a_refused_fork_starts_fresh() -> None:
    other = ckpt("o1", "Manual", sandbox_name="other", owned=False, created="09:00:00")
    sb = make_sandbox({"incarnation": 1, "podName": "minimal-1", "conditions":
                       RESTORING["conditions"]}, restoreFrom="o1")
    refused = failed_pod("false", incarnation=1, source="o1")
    p = plan(sb, refused, NOW, settings=SETTINGS, checkpoints=[other])
    assert p.create_pod is not None and restore_source(p) is None
    assert event_types(p) == [("Warning", "NoUsableCheckpoint")]


# -- losses: status.restoredFrom and how much work was lost -----------------------------

def test_loss_restores_the_last_checkpoint_and_warns_how_old_it_is() -> None:
    sb = make_sandbox(dict(RUNNING, lastCheckpoint={"name": "c1", "reason": "Interval"}))
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=CKPTS)
    assert restore_source(p) == "c1"
    assert p.status_patch["restoredFrom"] == {**C1_RECORD, "staleSeconds": 3600}
    assert event_types(p) == [("Warning", "PodLost"), ("Warning", "WorkLost")]
    assert p.work_lost == 3600  # hermit_operator_work_lost_seconds, once the pod exists
    assert p.events[1].message == (
        "pod minimal-1 was lost without a checkpoint of its final state: restoring "
        "checkpoint c1 taken 3600s ago into pod minimal-2; work since then is lost")


def test_loss_after_a_durable_stopping_checkpoint_loses_nothing() -> None:
    pre = ckpt("minimal-1-preempt", "Preemption", created="11:59:00")
    pre["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    p = plan(make_sandbox(dict(RUNNING)), None, NOW, settings=SETTINGS,
             checkpoints=[*CKPTS, pre])
    assert restore_source(p) == "minimal-1-preempt"
    assert p.status_patch["restoredFrom"]["staleSeconds"] == 0
    assert event_types(p) == [("Normal", "CheckpointCompleted"), ("Warning", "PodLost"),
                              ("Normal", "RestoreStarted")]
    assert p.work_lost is None


def test_migration_records_a_fresh_restore() -> None:
    pre = ckpt("minimal-1-preempt", "Eviction", created="11:00:00", done="11:00:05")
    p = plan(make_sandbox(dict(RUNNING)), pod(), NOW, settings=SETTINGS, checkpoints=[pre])
    assert p.status_patch["restoredFrom"] == {
        "name": "minimal-1-preempt", "reason": "Eviction",
        "checkpointTime": "2026-01-01T11:00:05Z", "staleSeconds": 0, "fallback": False}
    assert ("Normal", "RestoreStarted") in event_types(p)


def test_a_pod_lost_before_its_restore_finished_restores_the_same_checkpoint() -> None:
    fallback = {**C1_RECORD, "name": "c0", "fallback": True, "staleSeconds": 4800}
    sb = restoring(restoredFrom=fallback)
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=CKPTS)
    assert restore_source(p) == "c0"  # not c1, which was refused
    assert p.status_patch["restoredFrom"] == fallback
    assert ("Normal", "RestoreStarted") in event_types(p)


def test_suspend_forgets_a_scheduled_retry() -> None:
    sb = restoring(restoreAttempts=2, nextRestoreAt="2026-01-01T12:00:05Z", podName=None)
    sb["spec"]["suspend"] = True
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=CKPTS)
    assert (p.status_patch["restoreAttempts"], p.status_patch["nextRestoreAt"]) == (None, None)
    assert p.status_patch["phase"] == "Suspended"


def test_no_restore_failure_fails_the_sandbox() -> None:
    sb = restoring()
    for retryable in ("true", "false"):
        p = plan(sb, failed_pod(retryable), NOW, settings=SETTINGS, checkpoints=CKPTS)
        assert not is_true(p.status_patch["conditions"], "Failed")
        assert p.status_patch["phase"] != "Failed"
        # Either a retry is scheduled or a new pod is on its way: never a dead end.
        assert p.create_pod is not None or p.status_patch.get("nextRestoreAt") is not None


def test_the_new_status_fields_fit_the_crd_schema() -> None:
    from tests.support.crds import schema_errors

    sb = restoring()
    sb.update(apiVersion=api.API_VERSION, kind=api.SANDBOX_KIND)
    retry = plan(sb, failed_pod(), NOW, settings=SETTINGS, checkpoints=CKPTS)
    fallback = plan(sb, failed_pod("false"), NOW, settings=SETTINGS, checkpoints=CKPTS)
    for p in (retry, fallback):
        assert schema_errors(after(p, sb)) == []
        assert p.status_patch.get("restoredFrom") or p.status_patch.get("nextRestoreAt")
