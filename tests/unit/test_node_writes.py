"""What a node-agent writes, and what it restores (issue 17, Deliver 4).

- Its requests (Preemption, Eviction, Rebalance, Turn) cannot be blocked by another node
  that created their names first (hermit_node/control/requests.py), and their names stay within
  the pattern the chart's policy allows (protocol.NODE_AGENT_CHECKPOINT_NAMES).
- A restore starts only into a pod the operator made, from a checkpoint the operator
  verified (planner.restore_authority); a refusal is on the pod and in an Event.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hermit_common import protocol
from hermit_node.control import planner, requests
from tests.support.node_agent import (
    DIGEST,
    NODE,
    NOW,
    FakeEngine,
    FakeKube,
    ckpt,
    make_agent,
    notice,
    pod,
    sps,
)

THERE = "node-z"  # another node, compromised
KEY = b"k" * 32
NAMES = re.compile(protocol.NODE_AGENT_CHECKPOINT_NAMES)


class NodeKube(FakeKube):
    """FakeKube whose node-agent lists only the Checkpoints labelled with its node (as its
    label-selected watch does), while names are unique across all of them."""

    def list_node_checkpoints(self) -> list[dict[str, Any]]:
        return [c for c in self.checkpoints.values() if protocol.node_of(c) == NODE]

    def checkpoints_now(self) -> list[dict[str, Any]]:
        return self.list_node_checkpoints()


def squatted(name: str, reason: str = "Preemption", incarnation: int = 1) -> dict[str, Any]:
    """What another node creates first: the name, labelled with its own node (the policy
    lets it label nothing else)."""
    return ckpt(name, reason=reason, node=THERE, incarnation=incarnation, verified=False)


# -- names --------------------------------------------------------------------------------

def test_every_name_a_node_agent_gives_matches_the_policys_pattern_and_no_operator_name_does(
        ) -> None:
    [sp] = sps(pod("a-very-long-sandbox-name-" + "x" * 240 + "-7", incarnation=7,
                   sandbox="a-very-long-sandbox-name-" + "x" * 240))
    for reason, tag in [("Preemption", ""), ("Preemption", "-r12"), ("Eviction", ""),
                        ("Eviction", "-r2"), ("Rebalance", ""), ("Turn", "15")]:
        for name in (protocol.checkpoint_name(sp.sandbox, 7, reason, tag),
                     requests.unsquatted(sp, reason, tag, KEY)):
            assert NAMES.search(name), name
            assert len(name) <= protocol.NAME_LIMIT
    assert set(protocol.NODE_AGENT_REASONS) == {"Preemption", "Eviction", "Rebalance", "Turn"}
    for name in ("box-3-suspend", "box-3-i1767268800", "box-3-manual", "my-request",
                 "box-3-preempt-zzzzzzzz", "box-3-preempt-0a1b2c3d4"):
        assert not NAMES.search(name), name


def test_the_tag_is_the_same_for_the_same_name_and_depends_on_the_secret_key() -> None:
    [sp] = sps(pod("box-1"))
    one = requests.unsquatted(sp, "Preemption", "", KEY)
    assert one == requests.unsquatted(sp, "Preemption", "", KEY)
    assert one.startswith("box-1-preempt-") and len(one) == len("box-1-preempt-") + 8
    assert one != requests.unsquatted(sp, "Preemption", "", b"x" * 32)
    assert requests.unsquatted(sp, "Preemption", "") != one  # this process's own key


# -- requests another node took first ----------------------------------------------------

def test_a_squatted_request_name_is_passed_over_for_the_secret_one() -> None:
    [sp] = sps(pod("box-1"))
    kube = NodeKube([pod("box-1")], [squatted("box-1-preempt")])
    made = requests.create(kube, sp, "Preemption", NODE, key=KEY)  # type: ignore[arg-type]
    assert protocol.name_of(made) == requests.unsquatted(sp, "Preemption", "", KEY)
    assert requests.own_request(made, sp, "Preemption", NODE)
    # made again (a later loop, a lost answer): the same request, not a third one
    assert requests.create(kube, sp, "Preemption", NODE, key=KEY) == made  # type: ignore[arg-type]
    assert len(kube.checkpoints) == 2


@pytest.mark.parametrize("held", [
    squatted("box-1-preempt"),  # another node's
    ckpt("box-1-preempt", reason="Manual", incarnation=1, verified=False),  # another reason
    ckpt("box-1-preempt", reason="Preemption", incarnation=0, verified=False),  # incarnation
])
def test_only_this_nodes_own_request_counts_as_made(held: dict[str, Any]) -> None:
    [sp] = sps(pod("box-1"))
    assert not requests.own_request(held, sp, "Preemption", NODE)


def test_both_names_taken_is_an_error_not_someone_elses_request() -> None:
    [sp] = sps(pod("box-1"))
    kube = NodeKube([pod("box-1")], [
        squatted("box-1-preempt"), squatted(requests.unsquatted(sp, "Preemption", "", KEY))])
    with pytest.raises(requests.NameTaken, match="held by Checkpoints this node did not create"):
        requests.create(kube, sp, "Preemption", NODE, key=KEY)  # type: ignore[arg-type]


def test_a_notice_checkpoints_the_sandbox_although_another_node_took_its_request_name(
        tmp_path: Path) -> None:
    """The attack: node-z creates box-1-preempt before node-a's notice. node-a's create
    answers AlreadyExists with node-z's object; node-a makes its own request under the
    secret name at once, serves it in the same loop (no operator round trip), and the next
    loop finds it by its labels instead of making another."""
    kube = NodeKube([pod("box-1")], [squatted("box-1-preempt")])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.on_notice(notice())
    agent.reconcile_once()
    agent.shutdown()
    [(target, stop)] = engine.calls
    [sp] = sps(pod("box-1"))
    assert stop is True and target.checkpoint == requests.unsquatted(sp, "Preemption", "")
    assert [(n, s["phase"]) for n, s in kube.statuses] == [
        (target.checkpoint, "Dumping"), (target.checkpoint, "Uploading"),
        (target.checkpoint, "Completed")]
    assert "status" not in kube.checkpoints["box-1-preempt"], "the squatter's is not touched"
    assert sorted(kube.checkpoints) == sorted(["box-1-preempt", target.checkpoint])


def test_a_turn_checkpoint_is_made_although_another_node_took_its_name() -> None:
    [sp] = sps(pod("box-1"))
    kube = NodeKube([pod("box-1")], [squatted("box-1-turn4", reason="Turn")])
    made = requests.create(kube, sp, "Turn", NODE, "4", KEY)  # type: ignore[arg-type]
    assert protocol.name_of(made) == requests.unsquatted(sp, "Turn", "4", KEY)
    assert NAMES.search(protocol.name_of(made))


# -- who may be restored -----------------------------------------------------------------

def operator_sandbox(pod_name: str = "box-2", incarnation: int = 2,
                     uid: str = "sbx-uid") -> dict[str, Any]:
    return {"metadata": {"name": "box", "namespace": "agents", "uid": uid},
            "status": {"podName": pod_name, "incarnation": incarnation}}


def restoring(name: str = "box-2", incarnation: int = 2, source: str = "box-1-preempt",
              created: str = "2026-01-02T03:04:00Z") -> planner.SandboxPod:
    p = pod(name, incarnation=incarnation,
            annotations={protocol.ANNOTATION_RESTORE_FROM: source})
    p["metadata"]["creationTimestamp"] = created
    [sp] = sps(p)
    return sp


def completed(name: str = "box-1-preempt", *, verified: bool = True,
              reason: str = "Preemption", incarnation: int | None = 1) -> dict[str, Any]:
    return ckpt(name, reason=reason, incarnation=incarnation, verified=verified,
                node="node-old", status={"phase": "Completed", "manifestDigest": DIGEST})


def test_the_current_pod_restores_a_verified_checkpoint() -> None:
    assert planner.restore_authority(restoring(), operator_sandbox(), completed(), NOW) == \
        planner.Authority(planner.ALLOW)


@pytest.mark.parametrize(("sp", "sandbox", "says"), [
    # a pod made by someone else, named anything, labelled and owned as a sandbox's
    (restoring("fake"), operator_sandbox(), "is not the pod of AgentSandbox box its status "
                                            "names (box-2, incarnation 2)"),
    # the right name, the wrong incarnation label
    (restoring("box-2", incarnation=3), operator_sandbox(), "is not the pod"),
    # an owner reference naming another uid than the sandbox's
    (restoring(), operator_sandbox(uid="other-uid"), "is owned by AgentSandbox uid sbx-uid, "
                                                     "not by box (uid other-uid)"),
    (restoring(), None, "names AgentSandbox box, which does not exist"),
])
def test_a_pod_the_operator_did_not_make_is_refused(
        sp: planner.SandboxPod, sandbox: dict[str, Any] | None, says: str) -> None:
    verdict = planner.restore_authority(sp, sandbox, completed(), NOW)
    assert verdict.verdict == planner.REFUSE and not verdict.retryable
    assert verdict.message.startswith("refused: ") and says in verdict.message


def test_a_moves_replacement_restores_before_the_status_names_it() -> None:
    """Flow 2 (overlap): pod N+1 waits for the stopping checkpoint of N; the status names
    it only once the operator adopts it. Its restore must not wait for that."""
    sb = operator_sandbox("box-1", 1)
    assert planner.restore_authority(restoring(), sb, completed(), NOW).verdict == \
        planner.ALLOW
    # named as the operator names it, but restoring something else: waits for the status
    other = restoring(source="box-0-i5")
    wait = planner.restore_authority(other, sb, completed("box-0-i5", reason="Interval",
                                                           incarnation=0), NOW)
    assert wait.verdict == planner.WAIT
    late = NOW + timedelta(seconds=planner.AUTHORITY_WAIT_SECONDS + 60)
    assert planner.restore_authority(other, sb, completed("box-0-i5", reason="Interval",
                                                           incarnation=0), late).verdict \
        == planner.REFUSE
    # the checkpoint of another sandbox, or of another incarnation, is no move's
    assert planner.restore_authority(restoring(), sb, completed(incarnation=0), NOW).verdict \
        == planner.WAIT


def test_an_unverified_checkpoint_waits_for_the_operator_then_is_refused_as_retryable() -> None:
    sp, sb = restoring(), operator_sandbox()
    assert planner.restore_authority(sp, sb, completed(verified=False), NOW).verdict == \
        planner.WAIT
    late = NOW + timedelta(seconds=planner.AUTHORITY_WAIT_SECONDS + 60)
    verdict = planner.restore_authority(sp, sb, completed(verified=False), late)
    assert verdict.verdict == planner.REFUSE and verdict.retryable
    assert "is not marked hermit.dev/node-verified by the operator" in verdict.message


def test_a_missing_or_unfinished_checkpoint_is_left_to_the_restore_to_report() -> None:
    sp, sb = restoring(), operator_sandbox()
    assert planner.restore_authority(sp, sb, None, NOW).verdict == planner.ALLOW
    pending = ckpt("box-1-preempt", reason="Preemption", incarnation=1, verified=False)
    assert planner.restore_authority(sp, sb, pending, NOW).verdict == planner.ALLOW


def test_a_pod_faked_with_the_sandbox_label_and_a_restore_from_is_not_restored(
        tmp_path: Path) -> None:
    """The attack: a pod on this node, labelled hermit.dev/sandbox=box, owned (by uid) by
    the AgentSandbox, asking for box's verified checkpoint. The operator's status names
    another pod: nothing is restored, the pod says why and an Event records it."""
    fake = pod("box-debug", incarnation=2,
               annotations={protocol.ANNOTATION_RESTORE_FROM: "box-1-preempt"})
    real = pod("box-2", incarnation=2, node="node-b")  # the sandbox's pod, elsewhere
    kube = FakeKube([real, fake], [completed()])  # the status names the first
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    assert engine.calls == []
    [(name, annotations)] = kube.annotations
    assert name == "box-debug"
    assert annotations[protocol.ANNOTATION_RESTORE_PHASE] == protocol.RESTORE_FAILED
    assert annotations[protocol.ANNOTATION_RESTORE_RETRYABLE] == "false"
    assert "is not the pod of AgentSandbox box its status names (box-2" in \
        str(annotations[protocol.ANNOTATION_RESTORE_MESSAGE])
    assert kube.events == [("box-debug", "Warning", "RestoreRefused")]


def test_a_restore_waits_for_the_operators_mark_without_writing_anything(
        tmp_path: Path) -> None:
    waiting = pod("box-2", incarnation=2,
                  annotations={protocol.ANNOTATION_RESTORE_FROM: "box-1-preempt"})
    kube = FakeKube([waiting], [completed(verified=False)])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.reconcile_once()
    agent.shutdown()
    assert engine.calls == [] and kube.annotations == [] and kube.events == []
    assert agent.next_wait(30.0) == 1.0, "it looks again soon"


def test_a_prefetch_reads_only_checkpoints_the_operator_verified() -> None:
    [sp] = sps(pod("box-2", incarnation=2, annotations={
        protocol.ANNOTATION_RESTORE_FROM: "box-1-preempt"}))
    forged = ckpt("box-1-i9", incarnation=1, verified=False,
                  status={"phase": "Completed", "manifestDigest": DIGEST,
                          "completedAt": "2026-01-02T03:05:00Z"})
    good = ckpt("box-1-i1", incarnation=1,
                status={"phase": "Completed", "manifestDigest": DIGEST,
                        "completedAt": "2026-01-02T03:00:00Z"})
    source = planner.prefetch_source([forged, good], sp)
    assert source is not None and source.checkpoint == "box-1-i1"
    assert planner.prefetch_source([forged], sp) is None


def test_a_notice_checkpoints_the_operators_pod_not_a_look_alike(tmp_path: Path) -> None:
    """A pod someone else made with the sandbox's label, owner and incarnation (on the same
    node, listed first) is never checkpointed in the sandbox's stead: it has another name
    than the operator gives that incarnation's pod."""
    fake = pod("box-copy", incarnation=1)
    kube = FakeKube([fake, pod("box-1")], [])
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine)
    agent.on_notice(notice())
    agent.shutdown()
    [(target, _)] = engine.calls
    assert target.checkpoint == "box-1-preempt"
    assert [sp.pod for sp in planner.pods_to_checkpoint_on_notice(sps(fake, pod("box-1")))] \
        == ["box-1"]
    assert planner.pods_to_checkpoint_on_notice(sps(fake)) == []
