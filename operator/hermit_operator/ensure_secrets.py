"""``python -m hermit_operator.ensure_secrets``: create Hermit's generated Secrets when
they are absent, and never change a key that exists.

The chart runs this as a pre-install/pre-upgrade hook Job (templates/secrets-job.yaml)
instead of rendering keys with ``lookup``/``randBytes``: under ``helm template``, Argo CD
or Flux ``lookup`` sees nothing, so every sync would have written a new sealing key and
made every sealed checkpoint unreadable.

- the sealing Secret (``--sealing``): one random KEK; an existing one is left as it is,
  rotations included;
- the key service's serving Secret (``--serving``, ``kubernetes.io/tls``: its own CA
  and a certificate for the Service's DNS names) and the CA alone (``--trust``), what
  node-agents mount. The CA Secret is made to match the serving Secret's CA (it holds no
  secret), so deleting the serving Secret rotates both;
- the SIG Sandbox pod webhook's serving Secret (``--webhook-serving``, for the Service
  ``--webhook-service``), with its own CA in ``ca.crt`` (the operator copies it into the
  MutatingWebhookConfiguration's caBundle).

Two runs at once are safe: a create that meets AlreadyExists reads the winner's Secret.
Exit codes: 0 done, 1 the API refused (message on stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import base64
import logging
import sys
from collections.abc import Callable, Mapping

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_common.kubeclient import api_message, load_configuration
from hermit_operator import secretgen

log = logging.getLogger("hermit.ensure-secrets")

MANAGED_BY = {"app.kubernetes.io/managed-by": "hermit-ensure-secrets"}


def _encode(data: Mapping[str, bytes]) -> dict[str, bytes | str]:
    return {k: base64.b64encode(v).decode() for k, v in data.items()}


def _decode(data: Mapping[str, bytes | str] | None) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (data or {}).items()}


class Secrets:
    """Read and create Secrets of one namespace (the only I/O here)."""

    def __init__(self, api: client.CoreV1Api, namespace: str) -> None:
        self.api = api
        self.namespace = namespace

    def read(self, name: str) -> dict[str, bytes] | None:
        try:
            secret = self.api.read_namespaced_secret(name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return _decode(secret.data)

    def create(self, name: str, data: Mapping[str, bytes], secret_type: str,
               labels: Mapping[str, str], annotations: Mapping[str, str]) -> bool:
        """True when created; False when it exists already (someone else won)."""
        body = client.V1Secret(
            metadata=client.V1ObjectMeta(name=name, namespace=self.namespace,
                                         labels={**labels, **MANAGED_BY},
                                         annotations=dict(annotations)),
            type=secret_type, data=_encode(data))
        try:
            self.api.create_namespaced_secret(self.namespace, body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def replace_data(self, name: str, data: Mapping[str, bytes]) -> None:
        self.api.patch_namespaced_secret(name, self.namespace, {"data": _encode(data)})


def ensure(secrets: Secrets, name: str, make: Callable[[], dict[str, bytes]],
           secret_type: str, labels: Mapping[str, str],
           annotations: Mapping[str, str] | None = None) -> dict[str, bytes]:
    """The Secret's data: as it is when it exists (never regenerated), else made now."""
    existing = secrets.read(name)
    if existing:
        log.info("Secret %s/%s exists: kept as it is", secrets.namespace, name)
        return existing
    if secrets.create(name, make(), secret_type, labels, annotations or {}):
        log.info("Secret %s/%s created", secrets.namespace, name)
    won = secrets.read(name)
    if not won:
        raise RuntimeError(f"Secret {secrets.namespace}/{name} vanished right after its creation")
    return won


def ensure_all(secrets: Secrets, *, sealing: str | None, serving: str | None,
               trust: str | None, service: str | None,
               labels: Mapping[str, str], webhook_serving: str | None = None,
               webhook_service: str | None = None) -> None:
    if sealing:
        # Not Helm's object: an uninstall leaves it (losing it loses every sealed checkpoint).
        ensure(secrets, sealing, secretgen.new_sealing_keys, "Opaque", labels)
    if serving and trust and service:
        tls = ensure(secrets, serving, lambda: secretgen.new_serving_tls(
            f"{service}-ca", secretgen.service_dns_names(service, secrets.namespace)),
            "kubernetes.io/tls", labels)
        bundle = {"ca.crt": tls["ca.crt"]}
        current = ensure(secrets, trust, lambda: bundle, "Opaque", labels)
        if current.get("ca.crt") != tls["ca.crt"]:
            log.info("Secret %s/%s: CA replaced by the serving Secret's", secrets.namespace,
                     trust)
            secrets.replace_data(trust, bundle)
    if webhook_serving and webhook_service:
        # The SIG Sandbox pod webhook's: its own CA (ca.crt, which the operator puts in the
        # MutatingWebhookConfiguration's caBundle), for its own Service.
        ensure(secrets, webhook_serving, lambda: secretgen.new_serving_tls(
            f"{webhook_service}-ca",
            secretgen.service_dns_names(webhook_service, secrets.namespace)),
            "kubernetes.io/tls", labels)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hermit_operator.ensure_secrets",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--namespace", required=True)
    p.add_argument("--sealing", help="the sealing Secret's name (omit: not managed here)")
    p.add_argument("--serving", help="the key service's serving (TLS) Secret's name")
    p.add_argument("--trust", help="the key service's CA Secret's name (node-agents mount it)")
    p.add_argument("--service", help="the key service's Service name (the certificate's DNS names)")
    p.add_argument("--webhook-serving", help="the SIG Sandbox pod webhook's serving (TLS) "
                   "Secret's name")
    p.add_argument("--webhook-service", help="the SIG Sandbox pod webhook's Service name")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE",
                   help="a label for the Secrets made (repeatable)")
    args = p.parse_args(argv)
    if bool(args.serving) != bool(args.trust) or bool(args.serving) != bool(args.service):
        p.error("--serving, --trust and --service go together")
    if bool(args.webhook_serving) != bool(args.webhook_service):
        p.error("--webhook-serving and --webhook-service go together")
    if not (args.sealing or args.serving or args.webhook_serving):
        p.error("nothing to do: name --sealing, --serving/--trust/--service and/or "
                "--webhook-serving/--webhook-service")
    for item in args.label:
        if "=" not in item:
            p.error(f"--label {item!r}: expected KEY=VALUE")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    labels = dict(item.split("=", 1) for item in args.label)
    api = client.CoreV1Api(client.ApiClient(load_configuration()))
    try:
        ensure_all(Secrets(api, args.namespace), sealing=args.sealing, serving=args.serving,
                   trust=args.trust, service=args.service, labels=labels,
                   webhook_serving=args.webhook_serving,
                   webhook_service=args.webhook_service)
    except ApiException as exc:
        print(f"ensure-secrets: {api_message(exc)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
