"""A move's downtime: from the stopping Checkpoint's creation (the notice or the drain) to
the operator seeing the restore complete; observed once per move, only for moves."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY

from hermit_common import metrics, protocol
from hermit_operator import checkpoints as ck
from hermit_operator import driver
from hermit_operator.reconcile import Event, Plan, plan
from tests.support.operator_driver import FakeKube, run
from tests.support.operator_driver import sandbox as sandbox  # the fixture, re-exported
from tests.support.operator_objects import NOW, RUNNING, SETTINGS, after, ckpt, pod
from tests.support.operator_objects import sandbox as make_sandbox


def stopping(name: str = "minimal-1-preempt", reason: str = "Preemption",
             created: str = "11:59:50", done: str = "11:59:55") -> dict[str, Any]:
    c = ckpt(name, reason, created=created, done=done)
    c["metadata"]["labels"][protocol.LABEL_INCARNATION] = "1"
    return c


def moved(stop: dict[str, Any]) -> tuple[dict[str, Any], Plan]:
    """The sandbox after its pod 1 was replaced by pod 2 restoring ``stop``."""
    sb = make_sandbox(dict(RUNNING))
    p = plan(sb, pod(), NOW, settings=SETTINGS, checkpoints=[stop])
    assert p.create_pod is not None and p.downtime is None
    return after(p, sb), p


def restored(incarnation: int = 2, source: str = "minimal-1-preempt") -> dict[str, Any]:
    return pod(f"minimal-{incarnation}", node="spot-2", incarnation=incarnation,
               restore_from=source, outcome=protocol.RESTORED)


@pytest.mark.parametrize(("reason", "label"), [("Preemption", "preemption"),
                                               ("Eviction", "eviction")])
def test_a_move_reports_its_downtime_once(reason: str, label: str) -> None:
    stop = stopping(reason=reason)
    sb, _ = moved(stop)
    done = plan(sb, restored(), NOW + timedelta(seconds=12.5), settings=SETTINGS,
                checkpoints=[stop])
    # From the checkpoint's creation (11:59:50) to now (12:00:12.5).
    assert done.downtime == (label, 22.5)
    assert done.status_patch["lastDowntime"] == "22.5s"
    assert done.status_patch["restores"] == 1
    again = plan(after(done, sb), restored(), NOW + timedelta(seconds=20), settings=SETTINGS,
                 checkpoints=[stop])
    assert again.downtime is None  # Restoring is False now: the move was counted
    assert "lastDowntime" not in again.status_patch  # kept as written (a merge patch)


def test_retries_of_the_same_checkpoint_count_in_the_move() -> None:
    stop = stopping()
    sb, _ = moved(stop)
    failed = pod("minimal-2", node="spot-2", incarnation=2, restore_from="minimal-1-preempt",
                 outcome="Failed", message="s3 unreachable")
    retry = plan(sb, failed, NOW + timedelta(seconds=10), settings=SETTINGS, checkpoints=[stop])
    waiting = after(retry, sb)
    due = plan(waiting, None, NOW + timedelta(seconds=20), settings=SETTINGS, checkpoints=[stop])
    assert due.create_pod is not None
    up = plan(after(due, waiting), restored(3), NOW + timedelta(seconds=70), settings=SETTINGS,
              checkpoints=[stop])
    assert up.downtime == ("preemption", 80.0)
    assert up.status_patch["lastDowntime"] == "1m20s"


def test_a_pod_lost_after_its_stopping_checkpoint_is_a_move_too() -> None:
    stop = stopping()
    sb = make_sandbox(dict(RUNNING))
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[stop])  # the pod is gone
    done = plan(after(p, sb), restored(), NOW + timedelta(seconds=5), settings=SETTINGS,
                checkpoints=[stop])
    assert done.downtime == ("preemption", 15.0)


def test_a_loss_without_notice_is_not_a_move() -> None:
    interval = ckpt("c1", created="11:00:00")
    sb = make_sandbox(dict(RUNNING, lastCheckpoint={"name": "c1", "reason": "Interval"}))
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[interval])
    done = plan(after(p, sb), restored(source="c1"), NOW + timedelta(seconds=5),
                settings=SETTINGS, checkpoints=[interval])
    assert done.status_patch["restores"] == 1 and done.downtime is None
    assert "lastDowntime" not in done.status_patch


def test_a_stale_stopping_checkpoint_restored_after_a_loss_is_not_a_move() -> None:
    old = stopping(created="10:00:00", done="10:00:05")
    record = ck.restore_record(old, NOW, clean=False)  # incarnation 2 ran after it
    assert ck.move_downtime(record, [old], NOW) is None
    assert ck.move_downtime({**record, "staleSeconds": 0}, [old], NOW) == (
        "preemption", 7200.0)
    assert ck.move_downtime({**record, "staleSeconds": 0, "fallback": True}, [old], NOW) is None


def test_resume_and_fork_are_not_moves() -> None:
    suspend = stopping("minimal-1-suspend", "Suspend")
    record = ck.restore_record(suspend, NOW, clean=True)
    assert ck.move_downtime(record, [suspend], NOW) is None
    # A fork restores another sandbox's checkpoint: not among this sandbox's own.
    other = stopping()
    assert ck.move_downtime(ck.restore_record(other, NOW, clean=True), [], NOW) is None


def _count(label: str) -> float:
    value = REGISTRY.get_sample_value(f"{metrics.OPERATOR_DOWNTIME}_count", {"reason": label})
    return value or 0.0


def test_the_driver_observes_once_after_the_status_is_written(
        sandbox: dict[str, Any]) -> None:
    kube, events = FakeKube(sandbox), list[Event]()
    run(kube, events)
    kube.pods["minimal-1"]["spec"]["nodeName"] = "spot-1"
    kube.pods["minimal-1"]["metadata"]["creationTimestamp"] = "2026-01-01T10:00:00Z"
    kube.pods["minimal-1"]["status"] = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}
    stop = stopping(created="11:59:40")
    stop["metadata"].pop("ownerReferences")
    kube.checkpoints[ck.name_of(stop)] = stop
    run(kube, events)
    new = kube.pods["minimal-2"]
    new["spec"]["nodeName"] = "spot-2"
    new["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    new["metadata"]["annotations"][protocol.ANNOTATION_RESTORE_PHASE] = protocol.RESTORED
    before = _count("eviction"), _count("preemption")
    real = kube.patch_sandbox_status
    kube.patch_sandbox_status = _failing  # type: ignore[method-assign]
    with pytest.raises(driver.KubeTransient):
        run(kube, events)
    assert _count("preemption") == before[1]  # not written: not observed
    kube.patch_sandbox_status = real  # type: ignore[method-assign]
    run(kube, events)
    run(kube, events)  # a resync after the flip
    assert (_count("eviction"), _count("preemption")) == (before[0], before[1] + 1)
    assert kube.sandbox["status"]["lastDowntime"] == "20.0s"
    assert kube.sandbox["status"]["restores"] == 1


def _failing(namespace: str, name: str, status: dict[str, Any]) -> None:
    raise driver.KubeTransient("HTTP 503")
