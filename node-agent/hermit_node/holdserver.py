"""The node-agent's hold endpoint (HERMIT_HOLD_PORT; docs/protocol.md, "Evictions").

Every sandbox container has a preStop hook: before the kubelet sends SIGTERM to a pod
being deleted (an eviction by a drain or an autoscaler, say) it GETs
``/v1/hold/<namespace>/<pod>`` on ``127.0.0.1:<port>`` and waits for the answer, at most
the pod's grace period. The answer comes once the pod's Eviction checkpoint is durable
(or failed, or there is nothing to save: ``NodeAgent.hold``).

The port is the node-agent pod's ``hostPort`` on the node's loopback, where the kubelet
calls it; any process that reaches it may ask, so a request only ever does what the pod's
deletion does anyway (``planner.hold_decision``), parses nothing but a bounded path, and
the server (``hermit_common.hardhttp``) caps connections and bounds request heads.
"""

from __future__ import annotations

from collections.abc import Callable

from hermit_common import hardhttp, protocol, turnlimits
from hermit_common.hardhttp import HardenedHTTPServer, Reply
from hermit_common.settings import NodeSettings
from hermit_node.planner import HoldDecision

USAGE = "GET /v1/hold/NAMESPACE/POD (a sandbox container's preStop hook)"
# Connections at once: one per sandbox pod being deleted on the node, with room to spare.
# They all come from the kubelet's one address, so the per-source cap is the same.
MAX_CONNECTIONS = 256
MAX_HEAD_SECONDS = 5.0

Hold = Callable[[str, str], HoldDecision]


def reply_for(path: str, hold: Hold) -> Reply:
    """The answer to a GET of ``path``: 404 for anything but a hold path, else what
    ``hold`` decided (it may wait for a checkpoint first)."""
    parsed = protocol.parse_hold_path(path)
    if parsed is None:
        return Reply(404, {"error": USAGE})
    decision = hold(*parsed)
    body = {"verdict": decision.verdict, "message": decision.message}
    if decision.checkpoint:
        body["checkpoint"] = decision.checkpoint
    return Reply(decision.status, body)


def _refuse_posts(path: str, auth: str | None, body: bytes, source: str) -> Reply:
    return Reply(405, {"error": USAGE})


def serve(port: int, hold: Hold, *, host: str = "0.0.0.0",
          slots: turnlimits.ConnectionSlots | None = None) -> HardenedHTTPServer:
    """Serves hold requests on ``port`` from a daemon thread; OSError when it cannot bind."""
    return hardhttp.serve(
        port, _refuse_posts, max_body=0, usage=USAGE, name="hold", host=host,
        head_timeout=MAX_HEAD_SECONDS,
        slots=slots or turnlimits.ConnectionSlots(MAX_CONNECTIONS, MAX_CONNECTIONS),
        get=lambda path, source: reply_for(path, hold))


def start(settings: NodeSettings, hold: Hold) -> HardenedHTTPServer | None:
    """The hold endpoint of ``settings`` (None when HERMIT_HOLD_PORT is 0)."""
    if not settings.hold_port:
        return None
    return serve(settings.hold_port, hold)


__all__ = ["USAGE", "reply_for", "serve", "start"]
