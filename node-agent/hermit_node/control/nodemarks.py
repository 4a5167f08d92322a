"""What this node-agent writes on its Node: the taint and cordon of a cloud notice, and
the labels that say it is ready (sandbox pods require it) and which checkpoint format it
reads (restores of newer checkpoints require it)."""

from __future__ import annotations

import logging

from hermit_common.protocol import KubeObject
from hermit_node.control import planner
from hermit_node.control.kube import Kube, KubeError
from hermit_node.control.notices import Notices
from hermit_node.control.ports import Health

log = logging.getLogger("hermit_node")


class NodeMarks:
    def __init__(self, node: str, kube: Kube, notices: Notices, health: Health) -> None:
        self.node = node
        self._kube = kube
        self._notices = notices
        self._health = health
        self._tainted = False

    def taint_on_notice(self, node: KubeObject | None) -> None:
        """A cloud notice: taint and cordon the node, once, so nothing new lands there."""
        notice = self._notices.interruption()
        if notice is not None and not self._tainted and node is not None:
            try:
                patch = planner.node_taint_patch(node, notice.kind)
                if patch is not None:
                    self._kube.patch_node(patch)
                self._tainted = True
                log.info("node %s tainted %s and cordoned", self.node, notice.kind)
            except KubeError as exc:
                log.warning("cannot taint node %s yet: %s", self.node, exc)

    def mark_ready(self, node: KubeObject | None) -> None:
        """Once this agent is ready (its /readyz), label its node with it
        (protocol.LABEL_NODE_AGENT; sandbox pods require the label) and with the checkpoint
        format level it reads (protocol.LABEL_CHECKPOINT_FORMAT; restores of checkpoints of
        a newer level than 1 require it). Written only while either is missing or differs;
        an API error is logged and the next loop tries again. Never removed: a sandbox
        already on the node stays where it is when this agent stops being ready
        (docs/real-clusters.md, "Which nodes")."""
        if node is None or not self._health.readiness().ok:
            return
        patch = planner.node_ready_patch(node)
        if patch is None:
            return
        marks = ", ".join(f"{k}={v}" for k, v in planner.node_ready_labels().items())
        try:
            self._kube.patch_node(patch)
        except KubeError as exc:
            log.warning("cannot label node %s %s yet: %s", self.node, marks, exc)
            return
        log.info("node %s labelled %s", self.node, marks)
