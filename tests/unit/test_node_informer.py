"""The node-agent's watches: the local copy, 410 Gone, backoff, relists, and the bounded
set of jobs it has taken."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hermit_common import protocol
from hermit_common.kubeapi import KubeApiError, KubeTransient
from hermit_node.control import informer, planner
from hermit_node.control.informer import Informer, Store, apply_event, backoff_seconds, relist_due
from tests.support.node_agent import FakeEngine, FakeKube, ckpt, make_agent, pod, sps
from tests.support.wait import wait_until


def obj(name: str, rv: str, namespace: str | None = "ns") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "resourceVersion": rv}
    if namespace is not None:
        meta["namespace"] = namespace
    return {"metadata": meta}


def test_events_update_the_copy_and_the_resource_version() -> None:
    store = Store()
    store.replace([obj("a", "1"), obj("b", "2")], "5")
    assert sorted(store.objects) == ["ns/a", "ns/b"] and store.resource_version == "5"
    assert apply_event(store, "ADDED", obj("c", "6"))
    assert apply_event(store, "MODIFIED", obj("a", "7"))
    assert store.objects["ns/a"]["metadata"]["resourceVersion"] == "7"
    assert apply_event(store, "DELETED", obj("b", "8"))
    assert not apply_event(store, "DELETED", obj("zz", "9"))  # never seen: no change
    assert not apply_event(store, "BOOKMARK", {"metadata": {"resourceVersion": "12"}})
    assert sorted(store.objects) == ["ns/a", "ns/c"] and store.resource_version == "12"
    assert informer.key_of(obj("node-1", "1", namespace=None)) == "/node-1"


def test_backoff_doubles_to_a_cap_and_relists_are_rare() -> None:
    assert [backoff_seconds(n) for n in (1, 2, 3, 7, 8, 50)] == [0.5, 1.0, 2.0, 30.0, 30.0,
                                                                   30.0]
    assert backoff_seconds(3, jitter=0.5) == 1.0
    assert relist_due(None, 5.0)
    assert not relist_due(100.0, 100.0 + informer.RELIST_SECONDS - 1)
    assert relist_due(100.0, 100.0 + informer.RELIST_SECONDS)


class Script:
    """A ListWatch that answers from a script: lists in order, then one watch per entry
    (a list of events, or an exception to raise after them)."""

    what = "things"

    def __init__(self, lists: list[tuple[list[dict[str, Any]], str]],
                 watches: list[list[tuple[str, dict[str, Any]] | Exception]]) -> None:
        self.lists, self.watches = lists, watches
        self.listed = 0
        self.watched_from: list[str] = []

    def list(self) -> tuple[list[dict[str, Any]], str]:
        self.listed += 1
        if not self.lists:
            raise KubeTransient("listing things failed: HTTP 503", status=503)
        return self.lists.pop(0)

    def watch(self, resource_version: str, timeout_seconds: int
              ) -> Iterator[tuple[str, dict[str, Any]]]:
        self.watched_from.append(resource_version)
        assert 1 <= timeout_seconds <= informer.WATCH_SECONDS * 1.25 + 1
        steps = self.watches.pop(0) if self.watches else [
            KubeApiError("watching things failed: gone", status=informer.GONE)]
        for step in steps:
            if isinstance(step, Exception):
                raise step
            yield step


def test_list_then_watch_from_its_resource_version() -> None:
    source = Script([([obj("a", "1")], "10")], [[("ADDED", obj("b", "11")),
                                                ("MODIFIED", obj("a", "12"))], []])
    changes: list[int] = []
    inf = Informer(source, lambda: changes.append(1), threading.Event())
    with pytest.raises(KubeTransient, match="not listed yet"):
        inf.snapshot()
    inf.step()
    assert source.watched_from == ["10"] and len(changes) == 3  # the list, then 2 events
    assert sorted(protocol.name_of(o) for o in inf.snapshot()) == ["a", "b"]
    assert inf.healthy
    inf.step()  # the watch ended (server timeout): reopened from the last version
    assert source.listed == 1 and source.watched_from == ["10", "12"]


def test_gone_relists_and_other_failures_back_off_then_relist() -> None:
    stop = threading.Event()
    source = Script(
        [([obj("a", "1")], "10"), ([obj("b", "2")], "20"), ([obj("c", "3")], "30")],
        [[KubeApiError("watching things failed: too old", status=informer.GONE)],
         [("ADDED", obj("d", "21")), KubeTransient("watching things failed: reset")]])
    inf = Informer(source, lambda: None, stop)
    inf._thread.start()
    try:
        # 410 relists at once (b); a reset backs off (0.5 s at most) and relists too (c).
        wait_until("three lists", 10.0, lambda: source.listed >= 3, 0.01)
        wait_until("the third list's snapshot", 10.0,
                   lambda: [protocol.name_of(o) for o in inf.snapshot()] == ["c"], 0.01)
    finally:
        stop.set()
    assert source.watched_from[:2] == ["10", "20"]


def test_a_failing_list_is_not_healthy_and_keeps_the_last_copy() -> None:
    source = Script([([obj("a", "1")], "10")], [[KubeTransient("watch failed", status=503)]])
    stop = threading.Event()
    inf = Informer(source, lambda: None, stop)
    inf._thread.start()
    try:
        # The relist after the failure fails too.
        wait_until("two lists", 10.0, lambda: source.listed >= 2, 0.01)
        wait_until("the informer unhealthy", 10.0, lambda: not inf.healthy, 0.01)
        assert [protocol.name_of(o) for o in inf.snapshot()] == ["a"]
    finally:
        stop.set()


def test_awaiting_is_what_still_waits_for_the_agent() -> None:
    done = ckpt("done", status={"phase": "Completed"})
    pods = sps(pod("box-1"), pod("box-2", annotations={
        protocol.ANNOTATION_RESTORE_FROM: "c1"}), pod("box-3", annotations={
            protocol.ANNOTATION_RESTORE_FROM: "c1", protocol.ANNOTATION_RESTORE_PHASE: "Restored"}))
    assert planner.awaiting([ckpt("manual"), done], pods) == {"uid-manual", "uid-box-2"}


class LaggingView:
    """The agent's local copy, frozen until ``catch_up()``: as a watch that has not yet
    delivered the statuses the agent just wrote."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.catch_up()

    def catch_up(self) -> None:
        self.ckpts = copy.deepcopy(list(self.kube.checkpoints.values()))

    def pods_now(self) -> list[dict[str, Any]]:
        return self.kube.pods

    def checkpoints_now(self) -> list[dict[str, Any]]:
        return copy.deepcopy(self.ckpts)

    def node_now(self) -> dict[str, Any]:
        return self.kube.node

    def healthy(self) -> bool:
        return True


def test_jobs_taken_are_forgotten_once_seen_finished_and_never_run_twice(
        tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [ckpt("manual")])
    engine = FakeEngine()
    view = LaggingView(kube)
    agent = make_agent(tmp_path, kube, engine, view=view)
    agent.reconcile_once()
    wait_until("the agent stopped", 10.0, lambda: not agent._taken.running, 0.01)
    assert kube.checkpoints["manual"]["status"]["phase"] == "Completed"
    agent.reconcile_once()  # the copy still says Pending: remembered, not taken again
    assert agent._taken.taken == {"uid-manual"}
    view.catch_up()
    agent.reconcile_once()
    agent.shutdown()
    assert agent._taken.taken == set() and len(engine.calls) == 1
