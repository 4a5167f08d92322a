"""The node-agent's narrow window onto the Kubernetes API (the official ``kubernetes`` client).

Built once at start-up from the pod's service account, else $KUBECONFIG (or
~/.kube/config). Objects go in and out as plain dicts in API (camelCase) form;
every API failure becomes ``KubeError`` with a one-line message.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_common import api
from hermit_common.errors import HermitError
from hermit_common.kubeclient import (
    MERGE_PATCH,
    REQUEST_TIMEOUT,
    api_message,
    load_configuration,
    one_line,
)

Manifest = dict[str, Any]

COMPONENT = "hermit-node"


class KubeError(HermitError):
    """A Kubernetes API call failed (network, refusal, conflict); the loop retries later."""


class Kube:
    """Exactly the calls the node-agent makes."""

    def __init__(self, api_client: client.ApiClient, node_name: str) -> None:
        self._client = api_client
        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self.node_name = node_name

    @classmethod
    def connect(cls, node_name: str) -> Kube:
        return cls(client.ApiClient(load_configuration()), node_name)

    @property
    def host(self) -> str:
        return str(self._client.configuration.host)

    def _dict(self, obj: object) -> Manifest:
        out = self._client.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return out if isinstance(out, dict) else {}

    def _call(self, what: str, fn: Any, *args: Any, missing_ok: bool = False,
              **kwargs: Any) -> Any:
        """Call the API; None for a 404 when ``missing_ok``; KubeError for any failure."""
        try:
            return fn(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None
            raise KubeError(f"{what} failed: {api_message(exc)}") from None
        except Exception as exc:  # urllib3 / socket errors: many types, one meaning
            cause = getattr(exc, "reason", None) or exc
            raise KubeError(f"{what} failed: {one_line(cause)}") from None

    # -- pods -----------------------------------------------------------------------

    def list_node_pods(self) -> list[Manifest]:
        """Every pod scheduled on this node (all namespaces)."""
        out = self._call(f"listing pods on node {self.node_name}",
                         self._core.list_pod_for_all_namespaces,
                         field_selector=f"spec.nodeName={self.node_name}")
        return [self._dict(p) for p in out.items or []]

    def annotate_pod(self, namespace: str, name: str,
                     annotations: dict[str, str | None]) -> None:
        """Merge ``annotations`` into the pod's (a None value removes one)."""
        self._call(f"annotating pod {namespace}/{name}", self._core.patch_namespaced_pod,
                   name, namespace, {"metadata": {"annotations": annotations}},
                   _content_type=MERGE_PATCH)

    # -- node -----------------------------------------------------------------------

    def get_node(self) -> Manifest:
        return self._dict(self._call(f"reading node {self.node_name}", self._core.read_node,
                                     self.node_name))

    def patch_node(self, patch: Manifest) -> None:
        self._call(f"patching node {self.node_name}", self._core.patch_node, self.node_name,
                   patch, _content_type=MERGE_PATCH)

    # -- custom objects -------------------------------------------------------------

    def list_checkpoints(self) -> list[Manifest]:
        out = self._call("listing Checkpoints", self._custom.list_cluster_custom_object,
                         api.GROUP, api.VERSION, api.CHECKPOINT_PLURAL)
        items = out.get("items") if isinstance(out, dict) else None
        return [i for i in items or [] if isinstance(i, dict)]

    def get_checkpoint(self, namespace: str, name: str) -> Manifest | None:
        out = self._call(f"reading Checkpoint {namespace}/{name}",
                         self._custom.get_namespaced_custom_object, api.GROUP, api.VERSION,
                         namespace, api.CHECKPOINT_PLURAL, name, missing_ok=True)
        return out if isinstance(out, dict) else None

    def get_sandbox(self, namespace: str, name: str) -> Manifest | None:
        out = self._call(f"reading AgentSandbox {namespace}/{name}",
                         self._custom.get_namespaced_custom_object, api.GROUP, api.VERSION,
                         namespace, api.SANDBOX_PLURAL, name, missing_ok=True)
        return out if isinstance(out, dict) else None

    def create_checkpoint(self, namespace: str, body: Manifest) -> Manifest:
        """Create a Checkpoint; when one of that name exists already, return it."""
        name = body["metadata"]["name"]
        what = f"creating Checkpoint {namespace}/{name}"
        try:
            out = self._custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.CHECKPOINT_PLURAL, body,
                _request_timeout=REQUEST_TIMEOUT)
        except ApiException as exc:
            if exc.status != 409:
                raise KubeError(f"{what} failed: {api_message(exc)}") from None
            out = self.get_checkpoint(namespace, name)
            if out is None:
                raise KubeError(f"{what}: it existed and vanished") from None
        except Exception as exc:
            raise KubeError(f"{what} failed: {one_line(exc)}") from None
        return out if isinstance(out, dict) else {}

    def patch_checkpoint_status(self, namespace: str, name: str, status: Manifest) -> None:
        """A JSON merge patch of the Checkpoint's status subresource."""
        self._call(f"patching the status of Checkpoint {namespace}/{name}",
                   self._custom.patch_namespaced_custom_object_status, api.GROUP, api.VERSION,
                   namespace, api.CHECKPOINT_PLURAL, name, {"status": status},
                   _content_type=MERGE_PATCH)

    # -- events ---------------------------------------------------------------------

    def checkpoint_event(self, ckpt: Manifest, event_type: str, reason: str,
                         message: str) -> None:
        """Record an Event on a Checkpoint."""
        meta = ckpt.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {"apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
                               "name": name, "namespace": namespace, "uid": meta.get("uid")},
            "type": event_type, "reason": reason, "message": message,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT, "reportingInstance": self.node_name,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self._call(f"recording an Event on Checkpoint {namespace}/{name}",
                   self._core.create_namespaced_event, namespace, body)
