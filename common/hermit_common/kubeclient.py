"""Connecting to the Kubernetes API, shared by the operator and the node-agent.

Imports the official ``kubernetes`` client, which both components' extras install;
nothing else in hermit_common needs it but ``hermit_common.kubeapi`` (the adapter base
both components' ``Kube`` build on, and the API errors by HTTP meaning).
"""

from __future__ import annotations

import json
import os

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from hermit_common.errors import Retryable
from hermit_common.protocol import one_line

REQUEST_TIMEOUT = (5.0, 30.0)  # connect, read seconds
MERGE_PATCH = "application/merge-patch+json"
DETAIL_LIMIT = 300  # the cause of an API error, inside a longer message


class KubeUnavailable(Retryable):
    """No credentials for, or no answer from, the Kubernetes API."""


def load_configuration() -> client.Configuration:
    """In-cluster service account first, then $KUBECONFIG or ~/.kube/config."""
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        return cfg
    except ConfigException:
        pass
    path = os.path.expanduser(os.environ.get("KUBECONFIG", "~/.kube/config"))
    try:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, client_configuration=cfg)
    except (ConfigException, OSError) as exc:
        raise KubeUnavailable(
            f"no Kubernetes credentials: not in a pod with a service account, and no usable "
            f"kubeconfig at {path} ({one_line(exc, DETAIL_LIMIT, mark='')})") from None
    return cfg


def api_causes(exc: ApiException) -> tuple[str, ...]:
    """The reasons of an error response's ``details.causes`` (Status), in order."""
    try:
        body = json.loads(exc.body or "")
    except ValueError:
        return ()
    details = body.get("details") if isinstance(body, dict) else None
    causes = details.get("causes") if isinstance(details, dict) else None
    return tuple(str(c.get("reason")) for c in causes or () if isinstance(c, dict)
                 and c.get("reason"))


def api_message(exc: ApiException) -> str:
    """The API server's own message from an error response, else the HTTP status."""
    try:
        body = json.loads(exc.body or "")
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except ValueError:
        pass
    return f"HTTP {exc.status} {exc.reason or ''}".strip()
