"""``hermit-operator``: settings from the environment, a Kubernetes pre-flight, then kopf.

HERMIT_METRICS_PORT serves the metrics, ``/healthz`` and ``/readyz`` from the start, so a
standby that waits for the leadership Lease answers its probes too (operator.health);
HERMIT_KEY_SERVICE_PORT, when set, serves the key service (keyservice.py) on every
replica from the start too, and HERMIT_SIG_WEBHOOK_PORT the SIG Sandbox pods' admission
webhook (sigwebhook.py).

Exit codes: 2 for a bad setting, 1 when the Kubernetes API cannot be used; each with a
one-line message on stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import TYPE_CHECKING

from hermit_common import health as http_health
from hermit_common import logformat
from hermit_common.errors import HermitError, SettingsError
from hermit_common.settings import OperatorSettings, redacted
from hermit_operator.health import KOPF_LIVENESS_ENDPOINT, OperatorHealth
from hermit_operator.leader import LeaseElector

if TYPE_CHECKING:
    from hermit_operator.kube import Kube

log = logging.getLogger("hermit.operator")


def _fail(message: str, code: int) -> None:
    print(f"hermit-operator: {message}", file=sys.stderr)
    sys.exit(code)


def main() -> None:
    try:
        settings = OperatorSettings.from_env(os.environ)
    except SettingsError as exc:
        _fail(str(exc), 2)
        return
    own_handler = logformat.configure(settings.log_level, settings.log_format)
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # retries: one line
    log.info("settings: %s", json.dumps(redacted(settings), default=str))

    import kopf

    from hermit_operator import handlers  # noqa: F401  (registers the handlers)
    from hermit_operator.kube import Kube

    try:
        kube = Kube.connect(settings.watch_namespaces)
        version = kube.check()
    except HermitError as exc:
        _fail(str(exc), 1)
        return
    log.info("Kubernetes API %s at %s", version, kube.host)
    from hermit_common.metrics import build_version
    from hermit_operator import metrics
    metrics.record_build(build_version())

    health = OperatorHealth(settings.leader_election)
    try:
        http_health.serve(settings.metrics_port, health.liveness, health.readiness)
    except OSError as exc:
        _fail(f"cannot serve metrics on port {settings.metrics_port}: {exc.strerror}", 1)
    if settings.key_service.port:
        _serve_keys(settings, kube)
    if settings.sig_webhook.port:
        _serve_sig_webhook(settings)
    elector = _lead(settings, health) if settings.leader_election else None
    health.leading()
    kopf.configure(verbose=settings.log_level == "DEBUG", log_format=(
        kopf.LogFormat.JSON if settings.log_format == logformat.JSON else kopf.LogFormat.FULL))
    # kopf's handler (which also names the object a handler's line is about) prints from
    # here on; ours too would print every line twice.
    if own_handler is not None:
        logging.getLogger().removeHandler(own_handler)
    logging.getLogger().setLevel(settings.log_level)
    kopf.run(
        clusterwide=settings.clusterwide,
        namespaces=list(settings.watch_namespaces),
        standalone=settings.peering_name is None,
        peering_name=settings.peering_name,
        liveness_endpoint=KOPF_LIVENESS_ENDPOINT,
        memo=kopf.Memo(settings=settings, kube=kube, elector=elector),
    )


def _serve_keys(settings: OperatorSettings, kube: Kube) -> None:
    """The key service (keyservice.py), on every replica: it needs no leadership."""
    from hermit_operator import keyservice

    try:
        keyservice.serve(settings.key_service, kube, store=settings.store)
    except SettingsError as exc:
        _fail(str(exc), 2)
    except OSError as exc:
        _fail(f"cannot serve the key service on port {settings.key_service.port}: "
              f"{exc.strerror}", 1)
    log.info("key service on port %d (callers: %s; scoped store credentials: %s)",
             settings.key_service.port, ", ".join(settings.key_service.callers),
             "on" if settings.key_service.store_credentials else "off")


def _serve_sig_webhook(settings: OperatorSettings) -> None:
    """The SIG Sandbox pods' admission webhook (sigwebhook.py), on every replica: the API
    server calls whichever one its Service picks."""
    from hermit_operator import sigwebhook

    try:
        sigwebhook.serve(settings)
    except SettingsError as exc:
        _fail(str(exc), 2)
    except OSError as exc:
        _fail(f"cannot serve the SIG Sandbox webhook on port {settings.sig_webhook.port}: "
              f"{exc.strerror}", 1)
    log.info("SIG Sandbox pod webhook on port %d", settings.sig_webhook.port)
    hook = settings.sig_webhook
    if hook.configuration and hook.ca_file:
        import threading

        from kubernetes import client

        from hermit_common.kubeclient import load_configuration

        api = client.AdmissionregistrationV1Api(client.ApiClient(load_configuration()))
        threading.Thread(target=sigwebhook.keep_ca_bundle,
                         args=(api, hook.configuration, hook.ca_file, threading.Event()),
                         name="hermit-webhook-ca", daemon=True).start()


def _lead(settings: OperatorSettings, health: OperatorHealth) -> LeaseElector:
    """Wait for the Lease, then keep it in the background (losing it ends the process)."""
    from kubernetes import client

    from hermit_common.kubeclient import load_configuration

    assert settings.namespace is not None  # checked with the settings
    elector = LeaseElector(client.CoordinationV1Api(client.ApiClient(load_configuration())),
                           settings.namespace, settings.lease_name, settings.identity,
                           on_turn=health.lease_turn)
    health.standing_by()
    elector.acquire()
    elector.keep()
    return elector


if __name__ == "__main__":
    main()
