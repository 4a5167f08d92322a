"""The node-agent's turn endpoint over HTTP(S) (HERMIT_TURN_PORT; docs/turns.md).

``hermit_common.hardhttp``'s server handing ``POST`` requests to
``turns.TurnService.handle``. The port is on the node's IP (``hostPort``), so it is built
to be attacked (turnlimits, hardhttp; docs/turns.md#limits): connection caps, one
deadline per request, bounded heads and bodies, TLS when HERMIT_TURN_TLS_CERT_FILE and
HERMIT_TURN_TLS_KEY_FILE are set (re-read when the files change).

The rate limits and the TokenReview cache are the service's (``turns.Guards``).
"""

from __future__ import annotations

import ssl

from hermit_common import hardhttp, turnlimits
from hermit_common.errors import HermitError, SettingsError
from hermit_common.hardhttp import HardenedHTTPServer, TlsFiles
from hermit_common.settings import NodeSettings
from hermit_node.control.kube import Kube
from hermit_node.control.planner import SandboxPod
from hermit_node.engine import snapshot
from hermit_node.engine.inspector import Snapshot
from hermit_node.turns.turns import MAX_BODY, TurnService

__all__ = ["TlsFiles", "TurnHTTPServer", "serve", "service", "start", "tls_of"]

TurnHTTPServer = HardenedHTTPServer
USAGE = "POST {\"turn\": N} to /v1/namespaces/NS/agentsandboxes/NAME/turns"


def serve(port: int, service: TurnService, *, host: str = "0.0.0.0",
          tls: TlsFiles | None = None,
          head_timeout: float = turnlimits.HEAD_TIMEOUT_SECONDS,
          slots: turnlimits.ConnectionSlots | None = None) -> TurnHTTPServer:
    """Serves turn requests on ``port`` from a daemon thread; OSError when it cannot bind."""
    return hardhttp.serve(
        port, lambda path, auth, body, source: service.handle(path, auth, body, source=source),
        max_body=MAX_BODY, usage=USAGE, name="turns", host=host, tls=tls,
        head_timeout=head_timeout, slots=slots)


def take_snapshot(sp: SandboxPod) -> Snapshot:
    if sp.container_id is None:
        raise HermitError(f"pod {sp.namespace}/{sp.pod} has no container id")
    return snapshot.take(sp.container_id, sp.workspace_path)


def read_at_dump(sp: SandboxPod) -> Snapshot | None:
    if sp.container_id is None:
        return None
    return snapshot.at_dump(sp.container_id)


def read_after_thaw(sp: SandboxPod) -> Snapshot | None:
    if sp.container_id is None:
        return None
    return snapshot.after_thaw(sp.container_id, sp.workspace_path)


def tls_of(settings: NodeSettings) -> TlsFiles | None:
    """The endpoint's TLS files, checked now; SettingsError naming the settings."""
    if settings.turn_tls_cert_file is None or settings.turn_tls_key_file is None:
        return None
    tls = TlsFiles(settings.turn_tls_cert_file, settings.turn_tls_key_file)
    try:
        tls.context()
    except (OSError, ssl.SSLError) as exc:
        raise SettingsError(
            f"HERMIT_TURN_TLS_CERT_FILE={settings.turn_tls_cert_file} and "
            f"HERMIT_TURN_TLS_KEY_FILE={settings.turn_tls_key_file}: not a usable "
            f"certificate and key: {exc}") from None
    return tls


def service(settings: NodeSettings) -> TurnService | None:
    """The turn service of ``settings`` (None when HERMIT_TURN_PORT is 0); its TLS files
    are checked now (SettingsError)."""
    if not settings.turn_port:
        return None
    tls_of(settings)
    return TurnService(settings.node_name, Kube.connect(settings.node_name), take_snapshot,
                       read_after_thaw, at_dump=read_at_dump, audience=settings.turn_audience)


def start(settings: NodeSettings, turn_service: TurnService) -> TurnHTTPServer:
    """Serves ``turn_service`` on HERMIT_TURN_PORT (with its TLS files, when set)."""
    return serve(settings.turn_port, turn_service, tls=tls_of(settings))
