"""spec.checkpoint.intervalSeconds: routine checkpoints of a running sandbox, and the
retention that keeps their number (and their failures) bounded. Pure plan() tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from hermit_common import protocol
from hermit_operator import checkpoints as ck
from hermit_operator.reconcile import plan
from tests.support.operator_objects import (
    NOW,
    RUNNING,
    SETTINGS,
    UID,
    ckpt,
    interval_sandbox,
    pod,
    ready_pod,
)
from tests.support.operator_objects import sandbox as make_sandbox


def requested(objs: list[dict[str, Any]], *, sb: dict[str, Any] | None = None,
              the_pod: dict[str, Any] | None = None, now: datetime = NOW) -> bool:
    p = plan(sb or interval_sandbox(), the_pod or ready_pod(), now, settings=SETTINGS,
             checkpoints=objs)
    return p.create_checkpoint is not None


def test_a_due_interval_checkpoint_is_requested() -> None:
    p = plan(interval_sandbox(), ready_pod(), NOW, settings=SETTINGS,
             checkpoints=[ckpt("c1", created="11:50:00")])
    req = p.create_checkpoint
    assert req is not None
    stamp = int(NOW.timestamp())
    assert req["metadata"]["name"] == f"minimal-1-i{stamp}"
    assert req["metadata"]["namespace"] == "ns"
    assert req["metadata"]["labels"] == {protocol.LABEL_SANDBOX: "minimal",
                                         protocol.LABEL_INCARNATION: "1",
                                         protocol.LABEL_NODE: "spot-1"}
    assert req["metadata"]["ownerReferences"][0]["uid"] == UID
    assert req["spec"] == {"sandboxRef": {"name": "minimal"}, "reason": "Interval"}
    assert p.create_pod is None and p.delete_pod is None  # the sandbox keeps running
    assert p.status_patch["phase"] == "Running"


@pytest.mark.parametrize(
    ("objs", "due"),
    [
        ([ckpt("c1", created="11:50:00")], True),  # 600 s old, interval 300 s
        ([ckpt("c1", created="11:56:00")], False),
        ([ckpt("c1", "Manual", created="11:56:00")], False),  # any reason counts
        ([ckpt("c1", created="11:50:00"), ckpt("f2", phase="Failed", created="11:58:00")],
         False),  # a failure waits a whole interval too
        ([ckpt("c1", created="11:50:00"), ckpt("f2", phase="Failed", created="11:54:00")],
         True),
        ([ckpt("c1", created="11:50:00"), ckpt("p2", phase=None, created="11:58:00")], False),
        ([ckpt("c1", created="11:50:00"), ckpt("d2", phase="Dumping", created="11:58:00")],
         False),
        # Dumping on another node: a lost node-agent's; it does not hold anything back.
        ([ckpt("c1", created="11:50:00"),
          ckpt("d2", phase="Dumping", created="11:58:00", node="spot-9")], True),
        # Pending for more than an hour: nobody serves it.
        ([ckpt("c1", created="10:40:00"), ckpt("p2", phase=None, created="10:45:00")], True),
    ],
)
def test_when_an_interval_checkpoint_is_due(objs: list[dict[str, Any]], due: bool) -> None:
    assert requested(objs) is due


def test_without_checkpoints_the_pod_must_be_ready_for_an_interval() -> None:
    assert requested([], the_pod=ready_pod("2026-01-01T11:54:00Z"))
    assert not requested([], the_pod=ready_pod("2026-01-01T11:58:00Z"))
    started = pod()
    started["status"] = {"phase": "Running", "startTime": "2026-01-01T11:58:00Z",
                         "conditions": [{"type": "Ready", "status": "True"}]}
    assert not requested([], the_pod=started)
    started["status"]["startTime"] = "2026-01-01T11:00:00Z"
    assert requested([], the_pod=started)


def test_a_newly_ready_pod_waits_an_interval_even_after_an_old_checkpoint() -> None:
    # A replacement restored from an hour-old checkpoint has nothing new to save yet.
    assert not requested([ckpt("c1", created="11:00:00")],
                         the_pod=ready_pod("2026-01-01T11:59:00Z"))


@pytest.mark.parametrize(
    ("sb", "the_pod"),
    [
        (make_sandbox(dict(RUNNING)), ready_pod()),  # no interval
        (interval_sandbox(), pod(phase="Pending")),
        (interval_sandbox(suspend=True), ready_pod()),
        (interval_sandbox(status=dict(RUNNING, conditions=[
            {"type": "Restoring", "status": "True", "reason": "RestoreStarted", "message": "",
             "lastTransitionTime": "2026-01-01T11:00:00Z"}])), ready_pod()),
        (interval_sandbox(status=dict(RUNNING, conditions=[
            {"type": "Failed", "status": "True", "reason": "PodFailed", "message": "",
             "lastTransitionTime": "2026-01-01T11:00:00Z"}])), ready_pod()),
    ],
)
def test_no_interval_checkpoint_unless_running_ready_and_live(sb: dict[str, Any],
                                                              the_pod: dict[str, Any]) -> None:
    p = plan(sb, the_pod, NOW, settings=SETTINGS, checkpoints=[ckpt("c1", created="10:00:00")])
    assert p.create_checkpoint is None or p.create_checkpoint["spec"]["reason"] == "Suspend"


def test_interval_names_are_unique_per_second_and_never_too_long() -> None:
    later = NOW + timedelta(seconds=1)
    assert ck.interval_checkpoint_name("s", 3, NOW) != ck.interval_checkpoint_name("s", 3, later)
    long = ck.interval_checkpoint_name("a" * 300, 12, NOW)
    assert len(long) == 253 and long.endswith(f"-i{int(NOW.timestamp())}")
    assert ck.suspend_checkpoint_name("a" * 300, 1).endswith("-suspend")


@pytest.mark.parametrize(("value", "want"), [(None, None), (30, 30), (5, 30), ("x", None),
                                             (True, None), (3600, 3600)])
def test_interval_seconds(value: Any, want: int | None) -> None:
    spec = {} if value is None else {"checkpoint": {"intervalSeconds": value}}
    assert ck.interval_seconds({"spec": spec}) == want


# -- retention under a stream of interval checkpoints -----------------------------------

def _stream(n: int, phase: str = "Completed") -> list[dict[str, Any]]:
    start = datetime(2026, 1, 1, 11, 0, 0, tzinfo=UTC)
    return [ckpt(f"i{k:02d}", phase=phase,
                 created=(start + timedelta(seconds=30 * k)).strftime("%H:%M:%S"))
            for k in range(n)]


def test_retention_keeps_the_protected_checkpoints_among_many_interval_ones() -> None:
    objs = _stream(10)
    dropped = ck.to_delete(ck.of_sandbox(make_sandbox(), objs), 2, ("i01", "i03"))
    assert dropped == ["i00", "i02", "i04", "i05", "i06", "i07"]


def test_failing_interval_checkpoints_do_not_pile_up() -> None:
    objs = [*_stream(2), *[{**c, "metadata": {**c["metadata"], "name": f"f{k}"}}
                           for k, c in enumerate(_stream(12, "Failed")[2:])]]
    dropped = ck.to_delete(ck.of_sandbox(make_sandbox(), objs), 3, ())
    kept = {ck.name_of(c) for c in objs} - set(dropped)
    assert kept == {"i00", "i01", "f7", "f8", "f9"}
    only_failures = ck.to_delete(ck.of_sandbox(make_sandbox(), _stream(5, "Failed")), 2, ())
    assert only_failures == ["i00", "i01", "i02"]


def test_a_plan_restoring_an_old_checkpoint_keeps_it_from_retention() -> None:
    sb = interval_sandbox(status=dict(RUNNING, lastCheckpoint={"name": "i09"}),
                          suspend=False)
    sb["spec"]["checkpoint"]["retain"] = 1
    objs = _stream(10)
    restoring = dict(sb, status=dict(sb["status"], restoredFrom={"name": "i02"}, conditions=[
        {"type": "Restoring", "status": "True", "reason": "RestoreFallback", "message": "",
         "lastTransitionTime": "2026-01-01T11:00:00Z"}]))
    p = plan(restoring, None, NOW, settings=SETTINGS, checkpoints=objs)
    assert "i02" not in p.delete_checkpoints and "i09" not in p.delete_checkpoints
