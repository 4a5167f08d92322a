"""The node-agent's turn endpoint over HTTP (HERMIT_TURN_PORT; docs/turns.md).

A threaded HTTP server that hands ``POST`` requests to ``turns.TurnService.handle`` and
writes its ``Reply`` as JSON. Plain HTTP: the bearer token is a service-account token the
API server reviews, on the node's own network (the chart maps the port to the node's IP
with ``hostPort``). Anything but ``POST`` is 405.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hermit_common.errors import HermitError
from hermit_common.settings import NodeSettings
from hermit_node import snapshot
from hermit_node.inspector import Snapshot
from hermit_node.kube import Kube
from hermit_node.planner import SandboxPod
from hermit_node.turns import MAX_BODY, Reply, TurnService


def _handler(service: TurnService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, reply: Reply) -> None:
            body = json.dumps(reply.body, sort_keys=True).encode() + b"\n"
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= MAX_BODY:
                self._send(Reply(413, {"error": f"the body must be at most {MAX_BODY} bytes"}))
                return
            self._send(service.handle(self.path, self.headers.get("Authorization"),
                                      self.rfile.read(length)))

        def do_GET(self) -> None:
            self._send(Reply(405, {"error": "POST {\"turn\": N} to "
                                            "/v1/namespaces/NS/agentsandboxes/NAME/turns"}))

        def log_message(self, format: str, *args: object) -> None:
            pass  # the service logs what it decides; never a token

    return Handler


def serve(port: int, service: TurnService, *, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serves turn requests on ``port`` from a daemon thread; OSError when it cannot bind."""
    server = ThreadingHTTPServer((host, port), _handler(service))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="hermit-turns", daemon=True).start()
    return server


def take_snapshot(sp: SandboxPod) -> Snapshot:
    if sp.container_id is None:
        raise HermitError(f"pod {sp.namespace}/{sp.pod} has no container id")
    return snapshot.take(sp.container_id, sp.workspace_path)


def read_after_thaw(sp: SandboxPod) -> Snapshot | None:
    if sp.container_id is None:
        return None
    return snapshot.after_thaw(sp.container_id, sp.workspace_path)


def start(settings: NodeSettings) -> ThreadingHTTPServer | None:
    """The turn endpoint of ``settings`` (None when HERMIT_TURN_PORT is 0)."""
    if not settings.turn_port:
        return None
    service = TurnService(settings.node_name, Kube.connect(settings.node_name), take_snapshot,
                          read_after_thaw, audience=settings.turn_audience)
    return serve(settings.turn_port, service)
