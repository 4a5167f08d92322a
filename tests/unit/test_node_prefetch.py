"""A move's new node prefetches the sandbox's earlier checkpoint into its chunk cache while
the stopping checkpoint is still taken (planner decisions, the agent applying them)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from hermit_common import protocol
from hermit_common.pin import Pin
from hermit_node.control import agent as agent_module
from hermit_node.control import jobs as jobs_module
from hermit_node.control import planner
from hermit_node.control.agent import NodeAgent
from hermit_node.engine.restore import RestoreResult
from tests.support.node_agent import (
    DIGEST,
    NOW,
    FakeEngine,
    FakeKube,
    FakeStores,
    ckpt,
    fake_proc,
    pod,
    sps,
)

WAITS = {protocol.ANNOTATION_RESTORE_FROM: "box-1-preempt"}
OLD_NODE = "node-old"


def _done(name: str, completed: str, **kw: Any) -> dict[str, Any]:
    return ckpt(name, node=OLD_NODE, status={"phase": "Completed", "manifestDigest": DIGEST,
                                             "completedAt": completed, **kw})


def _preempt(phase: str) -> dict[str, Any]:
    return ckpt("box-1-preempt", reason="Preemption", node=OLD_NODE, status={"phase": phase})


# -- planner -----------------------------------------------------------------------------

def test_the_sources_to_read_are_those_the_node_does_not_hold() -> None:
    pods = sps(pod("box-2", annotations=WAITS),
               pod("other-2", sandbox="other", annotations={
                   protocol.ANNOTATION_RESTORE_FROM: "other-1-i5",
                   protocol.ANNOTATION_RESTORE_PHASE: protocol.RESTORED}),
               pod("fresh-1", sandbox="fresh"))
    assert planner.restore_sources_to_read(pods, []) == [("agents", "box-1-preempt")]
    assert planner.restore_sources_to_read(pods, [_preempt("Dumping")]) == []
    assert planner.restore_sources_to_read(pods, None) == []


def test_pods_to_prefetch_wait_for_a_checkpoint_in_flight() -> None:
    running, scheduled = pod("box-2", annotations=WAITS), pod(
        "box-3", sandbox="box", annotations=WAITS, running=False, phase="Pending")
    restoring = pod("box-4", annotations={**WAITS, protocol.ANNOTATION_RESTORE_PHASE:
                                          protocol.RESTORING})
    pods = sps(running, scheduled, restoring)
    for phase in (None, "Dumping", "Uploading"):
        c = ckpt("box-1-preempt", reason="Preemption", status=None if phase is None
                 else {"phase": phase})
        assert [sp.pod for sp in planner.pods_to_prefetch(pods, [c])] == ["box-2", "box-3"]
        assert planner.pods_to_restore(pods, [c]) == []
    for phase in ("Completed", "Failed"):
        assert planner.pods_to_prefetch(pods, [_preempt(phase)]) == []
    assert planner.pods_to_prefetch(pods, []) == []  # unknown: nothing to wait for
    assert planner.pods_to_prefetch(pods, None) == []


def test_the_prefetch_source_is_the_newest_other_completed_checkpoint() -> None:
    [sp] = sps(pod("box-2", annotations=WAITS))
    older = _done("box-1-i100", "2026-01-02T03:00:00Z")
    newer = _done("box-1-rebalance", "2026-01-02T03:05:00Z", parent="box-0-preempt",
                  lineage=["u0"])
    others = [
        _preempt("Uploading"),
        ckpt("box-1-i200", status={"phase": "Failed", "completedAt": "2026-01-02T03:09:00Z"}),
        _done("other-1-i1", "2026-01-02T03:09:00Z") | {"spec": {"sandboxRef": {
            "name": "other"}, "reason": "Interval"}},
        ckpt("box-1-i300", namespace="elsewhere", status={
            "phase": "Completed", "manifestDigest": DIGEST,
            "completedAt": "2026-01-02T03:09:00Z"}),
        ckpt("box-1-i400", status={"phase": "Completed", "completedAt":
                                   "2026-01-02T03:09:00Z"}),  # no digest: unusable
    ]
    source = planner.prefetch_source([older, newer, *others], sp)
    assert source is not None
    assert source.checkpoint == "box-1-rebalance" and source.ckpt is newer
    assert source.pin == Pin("agents", "box", "box-1-rebalance", parent="box-0-preempt",
                             lineage=("u0",), digest=DIGEST)
    assert planner.prefetch_source(others, sp) is None
    # The checkpoint the pod waits for is never its own prefetch source.
    assert planner.prefetch_source([_done("box-1-preempt", "2026-01-02T03:09:00Z")],
                                   sp) is None


def test_the_restore_message_says_how_many_chunks_came_from_the_cache() -> None:
    result = RestoreResult(download_ms=1, apply_ms=1, restore_ms=1, total_ms=345,
                           restored_pid=2, downloaded_bytes=1000, chunks_fetched=12,
                           chunks_cached=9)
    assert planner.restored_message("box-1-preempt", result) == (
        "restored from box-1-preempt in 345 ms (1000 bytes; 9 of 12 chunks from the local "
        "cache)")


# -- jobs --------------------------------------------------------------------------------

def test_one_prefetch_at_a_time_and_other_work_passes_it() -> None:
    jobs = jobs_module.Jobs(workers=3, freezing=2)
    release = threading.Event()
    order: list[str] = []
    first_running = threading.Event()

    def prefetch(tag: str) -> None:
        order.append(tag)
        first_running.set()
        release.wait(5)

    jobs.submit(("ns", "p1"), lambda: prefetch("p1"), priority=jobs_module.PRIORITY_PREFETCH)
    assert first_running.wait(5)
    jobs.submit(("ns", "p2"), lambda: prefetch("p2"), priority=jobs_module.PRIORITY_PREFETCH)
    restored = threading.Event()

    def restore() -> None:
        order.append("r")
        restored.set()

    jobs.submit(("ns", "r"), restore, priority=jobs_module.PRIORITY_RESTORE)
    assert restored.wait(5), "a restore waited behind a prefetch"
    time.sleep(0.1)
    assert order == ["p1", "r"], "a second prefetch ran beside the first"
    release.set()
    jobs.shutdown()
    assert order == ["p1", "r", "p2"]


# -- the agent ---------------------------------------------------------------------------

class RemoteKube(FakeKube):
    """This node's copy holds its own Checkpoints only; the old node's are read by name."""

    def __init__(self, pods: list[dict[str, Any]], remote: list[dict[str, Any]]) -> None:
        super().__init__(pods, [])
        self.remote = {c["metadata"]["name"]: c for c in remote}
        self.gets: list[str] = []

    def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets.append(name)
        return self.remote.get(name) or self.checkpoints.get(name)

    def list_sandbox_checkpoints(self, namespace: str, sandbox: str) -> list[dict[str, Any]]:
        return list(self.remote.values())


class PrefetchStore:
    def __init__(self) -> None:
        self.calls: list[tuple[Pin, dict[str, Any]]] = []
        self.started = threading.Event()
        self.stopped = threading.Event()

    def prefetch(self, pin: Pin, **kw: Any) -> int:
        self.calls.append((pin, kw))
        self.started.set()
        stop: threading.Event = kw["stop"]
        if stop.wait(5):
            self.stopped.set()
        kw["tally"].stored(123)
        return 123


def _agent(tmp_path: Path, kube: RemoteKube, engine: FakeEngine, store: PrefetchStore,
           *, prefetch: bool = True) -> NodeAgent:
    return NodeAgent("node-a", kube, engine, engine,  # type: ignore[arg-type]
                     view=kube, stores=FakeStores(store), proc_root=fake_proc(tmp_path),
                     clock=lambda: NOW, prefetch=prefetch)


def test_a_waiting_pod_gets_one_prefetch_stopped_when_its_restore_starts(
        tmp_path: Path) -> None:
    stopping = _preempt("Uploading")
    earlier = _done("box-1-rebalance", "2026-01-02T03:05:00Z")
    kube = RemoteKube([pod("box-2", annotations=WAITS)], [stopping, earlier])
    engine, store = FakeEngine(), PrefetchStore()
    agent = _agent(tmp_path, kube, engine, store)
    agent.reconcile_once()
    assert store.started.wait(5)
    agent.reconcile_once()  # still waiting: no second prefetch, no restore
    assert engine.calls == [] and len(store.calls) == 1
    assert agent.next_wait(2.0) == agent_module.REMOTE_POLL_SECONDS
    pin, _ = store.calls[0]
    assert pin.checkpoint == "box-1-rebalance"
    assert (pin.uid, pin.digest) == ("sbx-uid", DIGEST)

    stopping["status"] = {"phase": "Completed", "manifestDigest": DIGEST}
    agent.reconcile_once()
    assert store.stopped.wait(5), "the prefetch was not stopped when the restore started"
    agent.shutdown()
    [(target, _)] = engine.calls
    assert target.checkpoint == "box-1-preempt"
    assert agent.next_wait(2.0) == 2.0
    [(_, restored)] = [a for a in kube.annotations
                       if a[1][protocol.ANNOTATION_RESTORE_PHASE] == protocol.RESTORED]
    assert "0 of 0 chunks from the local cache" in str(
        restored[protocol.ANNOTATION_RESTORE_MESSAGE])


def test_no_prefetch_when_off_and_a_gone_pod_stops_it(
        tmp_path: Path) -> None:
    kube = RemoteKube([pod("box-2", annotations=WAITS)],
                      [_preempt("Dumping"), _done("box-1-i1", "2026-01-02T03:05:00Z")])
    engine, store = FakeEngine(), PrefetchStore()
    off = _agent(tmp_path, kube, engine, store, prefetch=False)
    off.reconcile_once()
    off.shutdown()
    assert store.calls == [] and engine.calls == []

    agent = _agent(tmp_path / "on", kube, engine, store)
    agent.reconcile_once()
    assert store.started.wait(5)
    kube.pods = []
    agent.reconcile_once()
    assert store.stopped.wait(5), "the prefetch of a pod that is gone was not stopped"
    agent.shutdown()
    assert engine.calls == []


def test_a_prefetch_goes_on_until_the_restore_starts_not_until_the_checkpoint_is_durable(
        tmp_path: Path) -> None:
    """The restore waits for the pod to run, seconds after the checkpoint is durable: the
    prefetch started meanwhile keeps filling the cache (in a rehearsal it was stopped at
    the durable mark after 1.2 s spent on its credentials and manifest: 0 bytes)."""
    stopping = _preempt("Uploading")
    kube = RemoteKube([pod("box-2", annotations=WAITS, running=False, phase="Pending")],
                      [stopping, _done("box-1-rebalance", "2026-01-02T03:05:00Z")])
    engine, store = FakeEngine(), PrefetchStore()
    agent = _agent(tmp_path, kube, engine, store)
    agent.reconcile_once()
    assert store.started.wait(5)
    stopping["status"] = {"phase": "Completed", "manifestDigest": DIGEST}
    agent.reconcile_once()  # durable, the pod not running yet: no restore, no stop
    assert engine.calls == [] and not store.stopped.is_set()
    kube.pods = [pod("box-2", annotations=WAITS)]
    agent.reconcile_once()  # the pod runs: the restore starts and stops the prefetch
    assert store.stopped.wait(5), "the prefetch was not stopped when the restore started"
    agent.shutdown()
    [(target, _)] = engine.calls
    assert target.checkpoint == "box-1-preempt" and len(store.calls) == 1
