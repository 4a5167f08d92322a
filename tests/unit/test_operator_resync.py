"""Event-driven reconciliation: the resync skips sandboxes whose inputs did not change, a
steady sandbox's status is never re-patched, and timed decisions say when to look again
(wakeups) instead of waiting for a poll."""

from __future__ import annotations

import copy
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from hermit_common import protocol
from hermit_operator import checkpoints as ck
from hermit_operator import driver, resync
from hermit_operator.reconcile import FORK_RECHECK_SECONDS, plan
from hermit_operator.wakeups import Schedule, Wakeups
from tests.support.operator_objects import (
    NOW,
    RUNNING,
    SETTINGS,
    ckpt,
    interval_sandbox,
    pod,
    ready_pod,
)
from tests.support.operator_objects import sandbox as make_sandbox


def with_rv(obj: dict[str, Any], rv: str) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = rv
    return out


# -- fingerprints -----------------------------------------------------------------------------

def test_the_watches_and_the_reconcile_agree_on_a_fingerprint() -> None:
    sb = make_sandbox(dict(RUNNING), restoreFrom="other-1")
    the_pod = with_rv(pod(), "40")
    mine, source = ckpt("c1", rv="41"), ckpt("other-1", sandbox_name="other", rv="42")
    foreign = ckpt("x", sandbox_name="other", rv="43")
    read = resync.fingerprint_of(sb, the_pod, [mine, source, foreign])
    inputs = resync.Inputs()
    assert inputs.current("ns", "minimal") is None  # not seen yet
    inputs.saw_sandbox(sb, deleted=False)
    inputs.saw_pod(the_pod, deleted=False)
    for c in (mine, source, foreign):
        inputs.saw_checkpoint(c, deleted=False)
    assert inputs.current("ns", "minimal") == read  # the foreign checkpoint is no input
    inputs.saw_checkpoint(with_rv(foreign, "50"), deleted=False)
    assert inputs.current("ns", "minimal") == read
    bumped = copy.deepcopy(sb)
    bumped["metadata"]["generation"] = 2
    for changed in (lambda: inputs.saw_checkpoint(with_rv(mine, "51"), deleted=False),
                    lambda: inputs.saw_pod(with_rv(the_pod, "52"), deleted=False),
                    lambda: inputs.saw_checkpoint(mine, deleted=True),
                    lambda: inputs.saw_sandbox(bumped, deleted=False)):  # a spec change
        before = inputs.current("ns", "minimal")
        changed()
        assert inputs.current("ns", "minimal") != before
    inputs.saw_sandbox(sb, deleted=True)
    assert inputs.sandboxes() == [] and inputs.current("ns", "minimal") is None


def test_a_checkpoint_that_changes_sandbox_moves_between_fingerprints() -> None:
    inputs = resync.Inputs()
    a, b = make_sandbox(dict(RUNNING)), make_sandbox(dict(RUNNING))
    b["metadata"]["name"] = "other"
    inputs.saw_sandbox(a, deleted=False)
    inputs.saw_sandbox(b, deleted=False)
    empty_a, empty_b = inputs.current("ns", "minimal"), inputs.current("ns", "other")
    inputs.saw_checkpoint(ckpt("c1"), deleted=False)
    assert inputs.current("ns", "minimal") != empty_a
    inputs.saw_checkpoint(ckpt("c1", sandbox_name="other", rv="8"), deleted=False)
    assert inputs.current("ns", "minimal") == empty_a
    assert inputs.current("ns", "other") != empty_b


def test_the_resync_reconciles_only_changed_or_long_unseen_sandboxes() -> None:
    last = resync.Reconciled("f1", at=100.0)
    assert resync.resync_needed(None, "f1", 100.0, 600.0)  # never reconciled here
    assert resync.resync_needed(last, "f2", 101.0, 600.0)  # inputs changed
    assert not resync.resync_needed(last, "f1", 100.0 + 5 * 600.0, 600.0)
    assert resync.resync_needed(last, "f1", 100.0 + resync.FULL_EVERY * 600.0, 600.0)


# -- status is patched only when it changes ------------------------------------------------------

def test_a_steady_running_sandbox_patches_nothing_and_wants_no_timer() -> None:
    sb = make_sandbox(dict(RUNNING))
    first = plan(sb, pod(), NOW, settings=SETTINGS)
    sb["status"] = driver.merged(sb["status"], first.status_patch)
    for later in (NOW + timedelta(minutes=10), NOW + timedelta(days=3)):
        again = plan(sb, pod(), later, settings=SETTINGS)
        assert not driver.status_changes(sb, again.status_patch)
        assert again.requeue_after is None and again.events == ()


# -- timed decisions -----------------------------------------------------------------------------

def test_an_interval_checkpoint_is_looked_at_when_it_is_due() -> None:
    # Ready since 10:31, the newest checkpoint finished at 11:58, interval 300 s: 12:03.
    p = plan(interval_sandbox(), ready_pod(), NOW, settings=SETTINGS,
             checkpoints=[ckpt("c1", created="11:58:00")])
    assert p.create_checkpoint is None and p.requeue_after == 180.0
    due = plan(interval_sandbox(), ready_pod(), NOW + timedelta(seconds=180), settings=SETTINGS,
               checkpoints=[ckpt("c1", created="11:58:00")])
    assert due.create_checkpoint is not None and due.requeue_after is None


def test_a_request_in_flight_holds_the_interval_back_until_it_ends_or_grows_old() -> None:
    pending = ckpt("c2", phase=None, created="11:59:00")
    p = plan(interval_sandbox(), ready_pod(), NOW, settings=SETTINGS,
             checkpoints=[ckpt("c1", created="11:00:00"), pending])
    assert p.create_checkpoint is None
    assert p.requeue_after == (ck.IN_FLIGHT_LIMIT - timedelta(minutes=1)).total_seconds()


def test_a_replacement_waits_for_a_stopping_checkpoint_at_most_stopping_wait() -> None:
    flight = ckpt("minimal-1-preempt", "Preemption", "Uploading", created="11:59:00")
    sb = make_sandbox(dict(RUNNING, podName="minimal-1"))
    p = plan(sb, None, NOW, settings=SETTINGS, checkpoints=[flight])
    assert p.create_pod is None
    assert p.requeue_after == (ck.STOPPING_WAIT - timedelta(minutes=1)).total_seconds()
    late = plan(sb, None, NOW + ck.STOPPING_WAIT, settings=SETTINGS, checkpoints=[flight])
    assert late.create_pod is not None


@pytest.mark.parametrize(("objs", "again"), [
    ([], FORK_RECHECK_SECONDS),  # CheckpointNotFound
    ([ckpt("other-1", phase="Dumping", sandbox_name="other")], FORK_RECHECK_SECONDS),
    ([ckpt("other-1", phase="Failed", sandbox_name="other")], None),  # final
])
def test_a_fork_waiting_for_its_checkpoint_is_looked_at_again(objs: list[dict[str, Any]],
                                                              again: float | None) -> None:
    p = plan(make_sandbox(None, restoreFrom="other-1"), None, NOW, settings=SETTINGS,
             checkpoints=objs)
    assert p.create_pod is None and p.requeue_after == again


# -- the wakeups --------------------------------------------------------------------------------

def test_the_schedule_keeps_the_earliest_moment_per_sandbox() -> None:
    s = Schedule()
    assert s.add(("ns", "a"), 10.0) and s.add(("ns", "b"), 5.0)
    assert not s.add(("ns", "a"), 20.0)  # later: the earlier one stands
    assert s.add(("ns", "a"), 3.0)
    assert s.next_at() == 3.0 and len(s) == 2
    s.cancel(("ns", "a"))
    assert s.next_at() == 5.0 and s.pop_due(4.0) == []
    assert s.pop_due(5.0) == [("ns", "b")] and s.next_at() is None and len(s) == 0


def test_wakeups_reconcile_each_sandbox_when_due() -> None:
    fired: list[tuple[str, str, float]] = []
    done = threading.Event()

    def fire(namespace: str, name: str) -> None:
        fired.append((namespace, name, time.monotonic()))
        if len(fired) == 2:
            done.set()

    wakeups = Wakeups(fire)
    wakeups.start()
    try:
        began = time.monotonic()
        wakeups.after("ns", "late", 0.3)
        wakeups.after("ns", "soon", 0.05)
        wakeups.after("ns", "gone", 0.1)
        wakeups.cancel("ns", "gone")
        assert done.wait(10.0)
    finally:
        wakeups.stop()
    assert [(ns, n) for ns, n, _ in fired] == [("ns", "soon"), ("ns", "late")]
    assert fired[1][2] - began >= 0.3 and wakeups.pending() == 0


def test_a_reconcile_records_what_it_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.operator_driver import FakeKube

    sb = make_sandbox(dict(RUNNING))
    kube = FakeKube(sb)
    kube.pods["minimal-1"] = with_rv(pod(), "9")
    inputs = resync.Inputs()
    driver.reconcile_sandbox(kube, SETTINGS, "ns", "minimal",  # type: ignore[arg-type]
                             lambda _sb, _e: None, now=lambda: NOW, inputs=inputs)
    last = inputs.last("ns", "minimal")
    inputs.saw_pod(kube.pods["minimal-1"], deleted=False)
    inputs.saw_sandbox(kube.sandbox, deleted=False)
    assert last is not None and last.fingerprint == inputs.current("ns", "minimal")
    assert inputs.due(last.at + 1.0, 600.0) == []  # unchanged: the resync skips it
    inputs.saw_pod(with_rv(kube.pods["minimal-1"], "10"), deleted=False)
    assert inputs.due(last.at + 1.0, 600.0) == [("ns", "minimal")]
    assert protocol.name_of(kube.sandbox) == "minimal"


def test_a_burst_of_events_is_coalesced_into_one_more_reconcile() -> None:
    entered, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def run() -> None:
        runs.append(1)
        if len(runs) == 1:
            entered.set()
            assert release.wait(10.0)

    first = threading.Thread(target=driver.coalesced, args=(("ns", "burst"), run))
    first.start()
    assert entered.wait(10.0)
    assert not driver.coalesced(("ns", "burst"), run)  # left to the running one
    assert not driver.coalesced(("ns", "burst"), run)
    release.set()
    first.join(10.0)
    assert len(runs) == 2  # once more for the whole burst
    assert driver.coalesced(("ns", "burst"), run) and len(runs) == 3  # idle again


def test_queued_reconciles_post_events_from_kopfs_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf's Event queue is a context variable of its object processing: the wakeups'
    threads run in a copy of that context, else their Events would be lost."""
    import contextvars

    import kopf

    from hermit_operator import handlers

    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker")
    seen: list[str] = []
    monkeypatch.setattr(handlers, "_reconcile_coalesced",
                        lambda *_args: seen.append(marker.get("unset")))
    memo = kopf.Memo(kopf_context={})
    handlers._in_kopf_context(memo, "ns", "a")  # before any event: plain
    token = marker.set("kopf")
    handlers._remember_kopf_context(copy.copy(memo))  # a handler's memo is a shallow copy
    marker.reset(token)
    worker = threading.Thread(target=handlers._in_kopf_context, args=(memo, "ns", "a"))
    worker.start()
    worker.join(10.0)
    assert seen == ["unset", "kopf"]
