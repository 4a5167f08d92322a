"""The node-agent labels its node once it is ready (protocol.LABEL_NODE_AGENT), which
sandbox pods require (issue 19, point 5): written only while missing, tried again on later
loops after an API error, never a reason for the agent to fail."""

from __future__ import annotations

from pathlib import Path

from hermit_common import protocol
from hermit_common.health import Heartbeats, Verdict
from hermit_node.control import planner
from hermit_node.control.agent import NodeAgent
from tests.support.node_agent import NODE, NOW, FakeEngine, FakeKube, fake_proc

# With the checkpoint format it reads (issue 21): restores of newer checkpoints require it.
READY = {"metadata": {"labels": {protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY,
                                 protocol.LABEL_CHECKPOINT_FORMAT: "2"}}}


class Health:
    """The agent's health as the loop reads it: heartbeats and a readiness verdict."""

    def __init__(self) -> None:
        self.beats = Heartbeats()
        self.ready = False

    def readiness(self) -> Verdict:
        return Verdict(self.ready, "test")


def _agent(tmp_path: Path, kube: FakeKube, health: Health | None) -> NodeAgent:
    engine = FakeEngine()
    # None: the agent's default (NoHealth), as without probes.
    given = {} if health is None else {"health": health}
    return NodeAgent(NODE, kube, engine, engine,  # type: ignore[arg-type]
                     view=kube, proc_root=fake_proc(tmp_path), clock=lambda: NOW,
                     **given)  # type: ignore[arg-type]


def test_the_patch_sets_only_the_label_and_none_when_it_is_there() -> None:
    assert planner.node_ready_patch({"metadata": {"labels": {"zone": "a"}}}) == READY
    assert planner.node_ready_patch({"metadata": {}}) == READY
    assert planner.node_ready_patch({"metadata": {"labels": {
        protocol.LABEL_NODE_AGENT: "other"}}}) == READY
    assert planner.node_ready_patch({"metadata": {"labels": {
        protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY, "zone": "a"}}}) == READY
    assert planner.node_ready_patch({"metadata": {"labels": {
        protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY,
        protocol.LABEL_CHECKPOINT_FORMAT: "2", "zone": "a"}}}) is None


def test_the_format_label_follows_this_release_and_is_what_the_policy_admits() -> None:
    """An upgrade from a release without levels adds the label to a node already labelled
    ready; one from another level (an older or newer release's label) sets this one's.
    The value is the decimal integer the chart's policy admits (tests/integration/
    test_node_policy.py) and the restores' Gt requirement compares."""
    assert planner.node_ready_labels()[protocol.LABEL_CHECKPOINT_FORMAT] == str(
        protocol.CHECKPOINT_FORMAT_LEVEL)
    for other in ("1", "3"):
        assert planner.node_ready_patch({"metadata": {"labels": {
            protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY,
            protocol.LABEL_CHECKPOINT_FORMAT: other}}}) == READY
    assert protocol.LABEL_CHECKPOINT_FORMAT == "hermit.dev/checkpoint-format"


def test_the_node_is_labelled_once_the_agent_is_ready_and_only_once(tmp_path: Path) -> None:
    kube = FakeKube([], [])
    health = Health()
    agent = _agent(tmp_path, kube, health)
    agent.reconcile_once()
    assert kube.node_patches == []  # not ready yet: no label
    health.ready = True
    agent.reconcile_once()
    assert kube.node_patches == [READY]
    assert kube.node["metadata"]["labels"] == READY["metadata"]["labels"]
    agent.reconcile_once()
    health.ready = False  # not ready any more: the label stays, nothing is written
    agent.reconcile_once()
    assert kube.node_patches == [READY]
    assert kube.node["metadata"]["labels"] == READY["metadata"]["labels"]


def test_an_api_error_is_tried_again_on_the_next_loop(tmp_path: Path) -> None:
    kube = FakeKube([], [])
    kube.fail_node_patches = 2
    health = Health()
    health.ready = True
    agent = _agent(tmp_path, kube, health)
    agent.reconcile_once()  # does not raise
    agent.reconcile_once()
    assert "labels" not in kube.node["metadata"]
    agent.reconcile_once()
    assert kube.node_patches == [READY, READY, READY]
    assert kube.node["metadata"]["labels"] == READY["metadata"]["labels"]


def test_without_a_health_recorder_nothing_is_labelled(tmp_path: Path) -> None:
    kube = FakeKube([], [])
    _agent(tmp_path, kube, None).reconcile_once()
    assert kube.node_patches == []
