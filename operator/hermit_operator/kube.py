"""The operator's narrow window onto the Kubernetes API (the official ``kubernetes`` client).

Everything goes in and out as plain dicts in API (camelCase) form. API failures are
``hermit_common.kubeapi`` errors, classified by HTTP meaning: ``KubeTransient`` (retry
later: 429, 5xx, network), ``KubeForbidden`` (``KubeNamespaceTerminating``: nothing can be
created in a namespace being deleted), ``KubeConflict``, ``KubeInvalid``, ``KubeNotFound``,
all of them ``KubeApiError`` (also exported as ``KubeError``). A pod the
API rejects as invalid (400, 422) is ``InvalidSpec`` instead: the sandbox's spec is wrong.
"""

from __future__ import annotations

import contextlib

from kubernetes import client

from hermit_common import api, protocol
from hermit_common.kubeapi import (
    KubeApi,
    KubeApiError,
    KubeConflict,
    KubeForbidden,
    KubeInvalid,
    KubeNamespaceTerminating,
    KubeNotFound,
    KubeTransient,
)
from hermit_common.kubeclient import MERGE_PATCH
from hermit_common.protocol import KubeObject
from hermit_operator.podspec import InvalidSpec

KubeError = KubeApiError

__all__ = [
    "Kube",
    "KubeApiError",
    "KubeConflict",
    "KubeError",
    "KubeForbidden",
    "KubeInvalid",
    "KubeNamespaceTerminating",
    "KubeNotFound",
    "KubeObject",
    "KubeTransient",
]


class Kube(KubeApi):
    """get/create/delete pods, get sandboxes and patch their status, list/create/patch/delete
    Checkpoints (and fail orphaned ones), create/delete sandboxes' PodDisruptionBudgets."""

    def __init__(self, api_client: client.ApiClient, namespaces: tuple[str, ...] = ()) -> None:
        """``namespaces``: the watched ones (HERMIT_WATCH_NAMESPACE); empty: every one."""
        super().__init__(api_client)
        self._policy = client.PolicyV1Api(api_client)
        self._namespaces = namespaces

    def _outside(self, namespace: str) -> bool:
        """Outside the watched namespaces (operator.watchNamespaces); never when all are."""
        return bool(self._namespaces) and namespace not in self._namespaces

    def namespace_terminating(self, namespace: str) -> bool:
        """Whether ``namespace`` is being deleted. A list by name: the operator may list
        and watch namespaces (kopf's), not get them."""
        out = self._call(f"listing namespace {namespace}", self._core.list_namespace,
                         field_selector=f"metadata.name={namespace}")
        return any(ns.metadata.deletion_timestamp is not None
                   or (ns.status is not None and ns.status.phase == "Terminating")
                   for ns in out.items or [])

    # -- pods -----------------------------------------------------------------------

    def get_pod(self, namespace: str, name: str) -> KubeObject | None:
        out = self._get_or_none(f"reading pod {namespace}/{name}",
                                self._core.read_namespaced_pod, name, namespace)
        return None if out is None else self._dict(out)

    def list_node_sandbox_pods(self, node: str, namespace: str) -> list[KubeObject]:
        """Every sandbox pod (labelled ``hermit.dev/sandbox``) bound to ``node`` in
        ``namespace``, read now (the key service's authorisation: keyaccess.py, which looks
        at that namespace only). None outside the watched namespaces: no sandbox there is
        the operator's, and it may not read their pods (operator.watchNamespaces)."""
        if self._outside(namespace):
            return []
        out = self._call(f"listing the sandbox pods of node {node} in {namespace}",
                         self._core.list_namespaced_pod, namespace,
                         field_selector=f"spec.nodeName={node}",
                         label_selector=protocol.LABEL_SANDBOX)
        return [self._dict(p) for p in out.items or []]

    def list_sandbox_pods(self, namespace: str, sandbox: str) -> list[KubeObject]:
        """The pods labelled as ``sandbox``'s (``hermit.dev/sandbox``) in ``namespace``."""
        out = self._call(f"listing the pods of sandbox {namespace}/{sandbox}",
                         self._core.list_namespaced_pod, namespace,
                         label_selector=f"{protocol.LABEL_SANDBOX}={sandbox}")
        return [self._dict(p) for p in out.items or []]

    def create_pod(self, manifest: KubeObject) -> KubeObject:
        """Create the pod; when it already exists and belongs to the same owner, return it.
        InvalidSpec when the API rejects it (400, 422) or one of that name is not ours."""
        meta = manifest["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        what = f"creating pod {namespace}/{name}"
        try:
            return self._dict(self._call(what, self._core.create_namespaced_pod, namespace,
                                         manifest))
        except KubeInvalid as exc:
            raise InvalidSpec(f"the API rejected pod {name}: {exc.detail}") from None
        except KubeConflict:
            pass
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

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None,
                   uid: str | None = None) -> None:
        """Delete the pod (``grace_seconds``: its grace period instead of the pod's own; 0
        removes the object at once, whatever the kubelet still does). ``uid``: only that
        pod, not another of the same name made since (a conflict is then nothing to do)."""
        # With a body the API server reads the options from it alone, not the query.
        body = None if uid is None else client.V1DeleteOptions(
            grace_period_seconds=grace_seconds, preconditions=client.V1Preconditions(uid=uid))
        with contextlib.suppress(KubeNotFound, KubeConflict):
            self._call(f"deleting pod {namespace}/{name}", self._core.delete_namespaced_pod,
                       name, namespace, grace_period_seconds=grace_seconds, body=body)

    # -- AgentSandboxes -------------------------------------------------------------

    def get_sandbox(self, namespace: str, name: str) -> KubeObject | None:
        """None outside the watched namespaces (no sandbox there is the operator's, and it
        may not read them): the key service refuses such a sandbox's keys (403)."""
        return None if self._outside(namespace) else super().get_sandbox(namespace, name)

    def get_secret(self, namespace: str, name: str) -> KubeObject | None:
        """One Secret a sandbox names as its store's credentials (the key service's, for
        per-sandbox store credentials), None when it does not exist or is outside the
        watched namespaces; never listed or watched. Its data must never reach a log."""
        if self._outside(namespace):
            return None
        out = self._get_or_none(f"reading Secret {namespace}/{name}",
                                self._core.read_namespaced_secret, name, namespace)
        return None if out is None else self._dict(out)

    def patch_sandbox_status(self, namespace: str, name: str, status: KubeObject) -> None:
        """A JSON merge patch of .status (None values remove fields); a sandbox that is
        gone has nothing left to report on."""
        with contextlib.suppress(KubeNotFound):
            self._call(f"patching the status of AgentSandbox {namespace}/{name}",
                       self._custom.patch_namespaced_custom_object_status, api.GROUP,
                       api.VERSION, namespace, api.SANDBOX_PLURAL, name, {"status": status},
                       _content_type=MERGE_PATCH)

    # -- Checkpoints (get, list, create: KubeApi) -----------------------------------

    def patch_checkpoint(self, namespace: str, name: str, patch: KubeObject) -> None:
        """A JSON merge patch of a Checkpoint (metadata only; its status is the node-agent's)."""
        with contextlib.suppress(KubeNotFound):
            self._call(f"patching Checkpoint {namespace}/{name}",
                       self._custom.patch_namespaced_custom_object, api.GROUP, api.VERSION,
                       namespace, api.CHECKPOINT_PLURAL, name, patch, _content_type=MERGE_PATCH)

    def delete_checkpoint(self, namespace: str, name: str) -> None:
        with contextlib.suppress(KubeNotFound):
            self._call(f"deleting Checkpoint {namespace}/{name}",
                       self._custom.delete_namespaced_custom_object, api.GROUP, api.VERSION,
                       namespace, api.CHECKPOINT_PLURAL, name)

    def patch_checkpoint_status(self, namespace: str, name: str, status: KubeObject) -> None:
        """A JSON merge patch of a Checkpoint's status. The node-agent writes it, except for a
        Checkpoint of an AgentSandbox that does not exist: the operator fails that one (and
        one that is gone needs no failing)."""
        with contextlib.suppress(KubeNotFound):
            super().patch_checkpoint_status(namespace, name, status)

    # -- PodDisruptionBudgets -------------------------------------------------------

    def get_pdb(self, namespace: str, name: str) -> KubeObject | None:
        out = self._get_or_none(f"reading PodDisruptionBudget {namespace}/{name}",
                                self._policy.read_namespaced_pod_disruption_budget, name,
                                namespace)
        return None if out is None else self._dict(out)

    def ensure_pdb(self, manifest: KubeObject) -> None:
        """Create the sandbox's PodDisruptionBudget; one that exists (409) is left as it is,
        except that the spec of one owned by the same sandbox is brought up to date. One
        of that name that is not the sandbox's is not touched."""
        meta = manifest["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        try:
            self._call(f"creating PodDisruptionBudget {namespace}/{name}",
                       self._policy.create_namespaced_pod_disruption_budget, namespace,
                       manifest)
            return
        except KubeConflict:
            pass
        existing = self.get_pdb(namespace, name)
        if existing is None or not _owned_by(existing, meta["ownerReferences"][0]["uid"]):
            return
        if {k: existing.get("spec", {}).get(k) for k in manifest["spec"]} == manifest["spec"]:
            return
        with contextlib.suppress(KubeNotFound):
            self._call(f"patching PodDisruptionBudget {namespace}/{name}",
                       self._policy.patch_namespaced_pod_disruption_budget, name, namespace,
                       {"spec": manifest["spec"]}, _content_type=MERGE_PATCH)

    def delete_pdb(self, namespace: str, name: str, owner_uid: str | None) -> None:
        """Delete the PodDisruptionBudget ``name`` when the sandbox ``owner_uid`` controls it."""
        existing = self.get_pdb(namespace, name)
        if existing is None or not _owned_by(existing, owner_uid):
            return
        uid = (existing.get("metadata") or {}).get("uid")
        # Gone, or replaced by another of that name (409: the uid precondition).
        with contextlib.suppress(KubeNotFound, KubeConflict):
            self._call(f"deleting PodDisruptionBudget {namespace}/{name}",
                       self._policy.delete_namespaced_pod_disruption_budget, name, namespace,
                       body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)))


def _owned_by(obj: KubeObject, uid: str | None) -> bool:
    """Whether ``uid`` is the controller owner of ``obj``."""
    return bool(uid) and any(
        o.get("uid") == uid and o.get("controller")
        for o in (obj.get("metadata") or {}).get("ownerReferences") or [])
