"""The mutating admission webhook for SIG Sandbox pods (docs/agent-sandbox.md, "Opting a
Sandbox in"): an AdmissionReview in, sigpod.py's answer out, over TLS.

Served by every operator replica from the start, as the key service is, and not by kopf's
webhook server: kopf runs on the leader only (leader.py), and the API server calls
whichever replica its Service picks, during a failover too. The answer needs nothing but
the pod in the request, so any replica gives the same one.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from pathlib import Path
from typing import Any, Protocol

from hermit_common import hardhttp
from hermit_common.errors import SettingsError
from hermit_common.hardhttp import HardenedHTTPServer, Reply, TlsFiles
from hermit_common.protocol import KubeObject
from hermit_common.settings import OperatorSettings
from hermit_operator import sigpod
from hermit_operator.podspec import InvalidSpec

log = logging.getLogger("hermit.operator.webhook")

PATH = "/mutate-sig-sandbox-pod"
# A pod is at most ~1.5 MB in etcd; the review carries it (and, on UPDATE, the old one).
MAX_BODY = 4 * 1024 * 1024
USAGE = f"POST an admission.k8s.io/v1 AdmissionReview to {PATH}"
REVIEW_VERSION = "admission.k8s.io/v1"
# How often the operator checks the configuration's caBundle (a `helm upgrade` that
# re-renders it, a rotated CA).
CA_BUNDLE_PERIOD_SECONDS = 300.0


def review(body: KubeObject, settings: OperatorSettings) -> KubeObject:
    """The AdmissionReview answering ``body``: a pod that ``sigpod.applies_to`` gets a
    JSONPatch or is refused with the reason; anything else is allowed as it is."""
    request = body.get("request") or {}
    uid = request.get("uid") or ""
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    pod = request.get("object") or {}
    if request.get("operation") == "CREATE" and request.get("kind", {}).get("kind") == "Pod" \
            and sigpod.applies_to(pod):
        if not (pod.get("metadata") or {}).get("namespace"):
            pod = {**pod, "metadata": {**pod["metadata"],
                                       "namespace": request.get("namespace") or ""}}
        try:
            mutated = sigpod.mutate(pod, settings)
        except InvalidSpec as exc:
            sandbox = sigpod.sig_sandbox_owner(pod)
            response = {"uid": uid, "allowed": False, "status": {
                "code": 403, "reason": "Forbidden",
                "message": f"Hermit refuses the pod of Sandbox {sandbox}: {exc}"}}
        else:
            ops = sigpod.patch(pod, mutated)
            response["patchType"] = "JSONPatch"
            response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": response}


def handle(settings: OperatorSettings, path: str, data: bytes) -> Reply:
    if path.split("?")[0] != PATH:
        return Reply(404, {"error": f"not found: {USAGE}"})
    try:
        body = json.loads(data)
    except ValueError:
        return Reply(400, {"error": "the body is not JSON"})
    if not isinstance(body, dict) or body.get("kind") != "AdmissionReview":
        return Reply(400, {"error": USAGE})
    answer = review(body, settings)
    if not answer["response"]["allowed"]:
        log.info("refused: %s", answer["response"]["status"]["message"])
    return Reply(200, answer)


def serve(settings: OperatorSettings, *, host: str = "0.0.0.0") -> HardenedHTTPServer:
    """Serves the webhook on HERMIT_SIG_WEBHOOK_PORT in daemon threads. SettingsError naming
    the setting when the TLS files cannot be used; OSError when the port cannot be bound."""
    hook = settings.sig_webhook
    assert hook.port and hook.tls_cert_file and hook.tls_key_file
    tls = TlsFiles(hook.tls_cert_file, hook.tls_key_file)
    try:
        tls.context()
    except (OSError, ValueError) as exc:
        raise SettingsError(
            f"HERMIT_SIG_WEBHOOK_TLS_CERT_FILE={hook.tls_cert_file} and "
            f"HERMIT_SIG_WEBHOOK_TLS_KEY_FILE={hook.tls_key_file}: not a usable "
            f"certificate and key: {exc}") from None
    return hardhttp.serve(hook.port, lambda path, _auth, data, _src: handle(settings, path,
                                                                             data),
                          max_body=MAX_BODY, usage=USAGE, name="sig-webhook", host=host,
                          tls=tls)


def ca_bundle_patch(configuration: KubeObject, ca_pem: bytes) -> list[dict[str, Any]]:
    """The JSONPatch that sets every webhook's clientConfig.caBundle of ``configuration``
    to ``ca_pem`` (empty when all have it already)."""
    bundle = base64.b64encode(ca_pem).decode()
    return [{"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
            for i, hook in enumerate(configuration.get("webhooks") or [])
            if (hook.get("clientConfig") or {}).get("caBundle") != bundle]


class WebhookConfigurations(Protocol):
    """The Kubernetes API's MutatingWebhookConfigurations (AdmissionregistrationV1Api)."""

    def read_mutating_webhook_configuration(self, name: str, **kwargs: Any) -> Any: ...

    def patch_mutating_webhook_configuration(self, name: str, body: Any) -> Any: ...


def keep_ca_bundle(api: WebhookConfigurations, name: str, ca_file: str,
                   stop: threading.Event, period: float = CA_BUNDLE_PERIOD_SECONDS) -> None:
    """Keeps the caBundle of the MutatingWebhookConfiguration ``name`` equal to ``ca_file``
    (the chart renders none: it renders no key or certificate), now and every ``period``
    seconds until ``stop``. Every replica does it; the patches agree."""
    from kubernetes.client.exceptions import ApiException

    while True:
        try:
            raw = api.read_mutating_webhook_configuration(name, _preload_content=False)
            config = json.loads(raw.data)
            ops = ca_bundle_patch(config, Path(ca_file).read_bytes())
            if ops:
                api.patch_mutating_webhook_configuration(name, ops)
                log.info("MutatingWebhookConfiguration %s: caBundle set from %s", name,
                         ca_file)
        except (ApiException, OSError, ValueError) as exc:
            log.warning("MutatingWebhookConfiguration %s: caBundle not checked: %s; again "
                        "in %.0f s", name, getattr(exc, "reason", None) or exc, period)
        if stop.wait(period):
            return
