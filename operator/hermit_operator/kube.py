"""The operator's narrow window onto the Kubernetes API (the official ``kubernetes`` client).

Everything goes in and out as plain dicts in API (camelCase) form. API failures
become Hermit errors: ``KubeTransient`` (retry later) or ``InvalidSpec`` (the
API rejected the pod we built from the sandbox's spec).
"""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_common import api
from hermit_common.errors import HermitError
from hermit_common.kubeclient import (
    MERGE_PATCH,
    REQUEST_TIMEOUT,
    KubeUnavailable,
    api_message,
    load_configuration,
    one_line,
)
from hermit_operator.podspec import InvalidSpec

Manifest = dict[str, Any]


class KubeTransient(HermitError):
    """An API call failed in a way that may succeed later (network, 5xx, 429, conflicts)."""


class Kube:
    """get/create/delete pods, get sandboxes and patch their status, list/create/patch/delete
    Checkpoints."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._client = api_client
        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    @classmethod
    def connect(cls) -> Kube:
        return cls(client.ApiClient(load_configuration()))

    @property
    def host(self) -> str:
        return str(self._client.configuration.host)

    def check(self) -> str:
        """The server's version; KubeUnavailable when the API does not answer."""
        try:
            info = client.VersionApi(self._client).get_code(_request_timeout=REQUEST_TIMEOUT)
        except ApiException as exc:
            raise KubeUnavailable(
                f"the Kubernetes API at {self.host} refused us: {api_message(exc)}") from None
        except Exception as exc:  # urllib3 / socket errors: many types, one meaning
            cause = getattr(exc, "reason", None) or exc  # urllib3's MaxRetryError wraps it
            raise KubeUnavailable(
                f"cannot reach the Kubernetes API at {self.host}: {one_line(cause)}") from None
        return str(info.git_version)

    def _dict(self, obj: object) -> Manifest:
        out = self._client.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return out if isinstance(out, dict) else {}

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except ApiException:
            raise
        except Exception as exc:  # network trouble: retry later
            raise KubeTransient(f"{what} failed: {one_line(exc)}") from None

    @staticmethod
    def _transient(what: str, exc: ApiException) -> KubeTransient:
        return KubeTransient(f"{what} failed: {api_message(exc)}")

    def get_pod(self, namespace: str, name: str) -> Manifest | None:
        what = f"reading pod {namespace}/{name}"
        try:
            return self._dict(self._call(what, self._core.read_namespaced_pod, name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise self._transient(what, exc) from None

    def create_pod(self, manifest: Manifest) -> Manifest:
        """Create the pod; when it already exists and belongs to the same owner, return it."""
        meta = manifest["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        what = f"creating pod {namespace}/{name}"
        try:
            return self._dict(self._call(what, self._core.create_namespaced_pod, namespace,
                                         manifest))
        except ApiException as exc:
            if exc.status in (400, 422):
                raise InvalidSpec(f"the API rejected pod {name}: {api_message(exc)}") from None
            if exc.status != 409:
                raise self._transient(what, exc) from None
        existing = self.get_pod(namespace, name)
        if existing is None:
            raise KubeTransient(f"{what}: it exists and vanished; retrying")
        want = meta["ownerReferences"][0]["uid"]
        owners = [o.get("uid") for o in (existing.get("metadata") or {}).get("ownerReferences")
                  or [] if o.get("controller")]
        if want not in owners:
            raise InvalidSpec(f"pod {namespace}/{name} already exists and is not owned by "
                              "this sandbox; delete it or rename the sandbox")
        return existing

    def delete_pod(self, namespace: str, name: str) -> None:
        what = f"deleting pod {namespace}/{name}"
        try:
            self._call(what, self._core.delete_namespaced_pod, name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise self._transient(what, exc) from None

    def get_sandbox(self, namespace: str, name: str) -> Manifest | None:
        what = f"reading AgentSandbox {namespace}/{name}"
        try:
            out = self._call(what, self._custom.get_namespaced_custom_object, api.GROUP,
                             api.VERSION, namespace, api.SANDBOX_PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise self._transient(what, exc) from None
        return out if isinstance(out, dict) else None

    def patch_sandbox_status(self, namespace: str, name: str, status: Manifest) -> None:
        """A JSON merge patch of .status (None values remove fields)."""
        what = f"patching the status of AgentSandbox {namespace}/{name}"
        try:
            self._call(what, self._custom.patch_namespaced_custom_object_status, api.GROUP,
                       api.VERSION, namespace, api.SANDBOX_PLURAL, name, {"status": status},
                       _content_type=MERGE_PATCH)
        except ApiException as exc:
            if exc.status == 404:
                return  # the sandbox is gone; nothing left to report on
            raise self._transient(what, exc) from None

    def list_checkpoints(self, namespace: str) -> list[Manifest]:
        """Every Checkpoint in the namespace (callers pick a sandbox's by spec.sandboxRef)."""
        what = f"listing Checkpoints in {namespace}"
        try:
            out = self._call(what, self._custom.list_namespaced_custom_object, api.GROUP,
                             api.VERSION, namespace, api.CHECKPOINT_PLURAL)
        except ApiException as exc:
            raise self._transient(what, exc) from None
        items = out.get("items") if isinstance(out, dict) else None
        return [i for i in items or [] if isinstance(i, dict)]

    def create_checkpoint(self, manifest: Manifest) -> None:
        """Create a Checkpoint request; one that already exists is left as it is."""
        meta = manifest["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        what = f"creating Checkpoint {namespace}/{name}"
        try:
            self._call(what, self._custom.create_namespaced_custom_object, api.GROUP,
                       api.VERSION, namespace, api.CHECKPOINT_PLURAL, manifest)
        except ApiException as exc:
            if exc.status != 409:
                raise self._transient(what, exc) from None

    def patch_checkpoint(self, namespace: str, name: str, patch: Manifest) -> None:
        """A JSON merge patch of a Checkpoint (metadata only; its status is the node-agent's)."""
        what = f"patching Checkpoint {namespace}/{name}"
        try:
            self._call(what, self._custom.patch_namespaced_custom_object, api.GROUP,
                       api.VERSION, namespace, api.CHECKPOINT_PLURAL, name, patch,
                       _content_type=MERGE_PATCH)
        except ApiException as exc:
            if exc.status != 404:
                raise self._transient(what, exc) from None

    def delete_checkpoint(self, namespace: str, name: str) -> None:
        what = f"deleting Checkpoint {namespace}/{name}"
        try:
            self._call(what, self._custom.delete_namespaced_custom_object, api.GROUP,
                       api.VERSION, namespace, api.CHECKPOINT_PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise self._transient(what, exc) from None
