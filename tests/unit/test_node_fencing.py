"""Fencing: Checkpoint claims with a resourceVersion precondition, the incarnation fence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hermit_common import protocol
from hermit_node.control import fence
from hermit_node.control.kube import KubeTransient
from tests.support.node_agent import (
    DIGEST,
    FakeEngine,
    FakeKube,
    ckpt,
    make_agent,
    pod,
    sps,
)


def _with_rv(obj: dict[str, Any], rv: str) -> dict[str, Any]:
    obj["metadata"]["resourceVersion"] = rv
    return obj


def test_the_claim_is_made_on_the_version_listed(tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [_with_rv(ckpt("manual"), "41")])
    agent = make_agent(tmp_path, kube, FakeEngine())
    agent.reconcile_once()
    agent.shutdown()
    assert kube.claims[0] == ("manual", "41")  # Dumping, only on that version
    assert kube.checkpoints["manual"]["status"]["phase"] == "Completed"


def _listed_as(kube: FakeKube, rv: str) -> None:
    """The loop's listing shows every Checkpoint Pending at ``rv`` (an older version)."""
    listed = [{**c, "metadata": {**c["metadata"], "resourceVersion": rv}, "status": {}}
              for c in kube.list_node_checkpoints()]
    kube.list_node_checkpoints = lambda: listed  # type: ignore[method-assign]


def test_a_checkpoint_changed_but_still_pending_is_claimed_on_its_new_version(
        tmp_path: Path) -> None:
    kube = FakeKube([pod("box-1")], [_with_rv(ckpt("manual"), "41")])
    _listed_as(kube, "40")  # e.g. the operator adopted it after the list
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    assert kube.claims[0] == ("manual", "41")
    assert [t.checkpoint for t, _ in engine.calls] == ["manual"]


def test_a_checkpoint_another_agent_took_is_not_taken(tmp_path: Path) -> None:
    taken = _with_rv(ckpt("manual", status={"phase": "Dumping", "nodeName": "node-b"}), "41")
    kube = FakeKube([pod("box-1")], [taken])
    _listed_as(kube, "40")  # listed while it was still Pending
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()  # 409, re-read: Dumping elsewhere; nothing is done here
    agent.shutdown()
    assert engine.calls == [] and kube.statuses == [] and kube.claims == []


def _pods(*specs: tuple[str, int, str, bool]) -> list[dict[str, Any]]:
    return [pod(name, incarnation=inc, phase=phase, terminating=term, node="node-x")
            for name, inc, phase, term in specs]


def test_older_alive_is_any_older_incarnation_not_ended() -> None:
    sp = sps(pod("box-3", incarnation=3))[0]
    pods = _pods(("box-1", 1, "Succeeded", False), ("box-2", 2, "Running", True),
                 ("box-3", 3, "Running", False), ("box-4", 4, "Running", False))
    assert fence.older_alive(pods, sp) == ["box-2"]  # terminating may still run
    assert fence.older_alive(_pods(("box-2", 2, "Failed", True)), sp) == []
    assert fence.older_alive(_pods(("box-2", 2, "Unknown", False)), sp) == ["box-2"]
    assert fence.older_alive(_pods(("box-2", 2, "Pending", False)), sp) == ["box-2"]
    other = pod("other-1", sandbox="other", incarnation=1)
    assert fence.older_alive([other], sp) == []


class _Pods:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.fail = False

    def list_sandbox_pods(self, namespace: str, sandbox: str) -> list[dict[str, Any]]:
        if self.fail:
            raise KubeTransient("HTTP 503")
        return self.pods


def test_a_restore_waits_while_an_older_incarnation_may_run(tmp_path: Path) -> None:
    restoring = pod("box-2", incarnation=2,
                    annotations={protocol.ANNOTATION_RESTORE_FROM: "box-1-preempt"})
    kube = FakeKube([restoring], [ckpt("box-1-preempt", reason="Preemption", status={
        "phase": "Completed", "manifestDigest": DIGEST, "nodeName": "node-b"})])
    old = pod("box-1", incarnation=1, terminating=True, node="node-b")
    pods = _Pods([old, restoring])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine, fence=fence.Fence(pods))
    agent.reconcile_once()
    pods.fail = True
    agent.reconcile_once()  # the API does not answer: cannot tell, so wait
    pods.fail = False
    agent._jobs.shutdown()
    assert engine.calls == [] and kube.annotations == []  # not started, nothing written
    old["status"]["phase"] = "Failed"  # the kubelet reports the old pod ended
    agent = make_agent(tmp_path / "again", kube, engine, fence=fence.Fence(pods))
    agent.reconcile_once()
    agent.shutdown()
    assert [t.checkpoint for t, _ in engine.calls] == ["box-1-preempt"]
    assert [a[protocol.ANNOTATION_RESTORE_PHASE] for _, a in kube.annotations] == [
        "Restoring", "Restored"]
