"""The node-agent's narrow window onto the Kubernetes API (the official ``kubernetes`` client).

Built once at start-up from the pod's service account, else $KUBECONFIG (or
~/.kube/config). Objects go in and out as plain dicts in API (camelCase) form. Every
API failure is a ``KubeError`` (``hermit_common.kubeapi.KubeApiError``) with a one-line
message; its subclasses say what it means (``KubeTransient``: retry later;
``KubeNotFound``, ``KubeConflict``, ``KubeInvalid``, ``KubeForbidden``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from kubernetes import client, watch

from hermit_common import api, protocol
from hermit_common.kubeapi import (
    CALL_ERRORS,
    KubeApi,
    KubeApiError,
    KubeConflict,
    KubeForbidden,
    KubeInvalid,
    KubeNotFound,
    KubeTransient,
    api_error,
)
from hermit_common.kubeclient import MERGE_PATCH, REQUEST_TIMEOUT
from hermit_common.protocol import KubeObject

KubeError = KubeApiError  # catching it catches every API failure

COMPONENT = "hermit-node"

__all__ = [
    "COMPONENT",
    "Kube",
    "KubeConflict",
    "KubeError",
    "KubeForbidden",
    "KubeInvalid",
    "KubeNotFound",
    "KubeObject",
    "KubeTransient",
    "Selected",
]


# A cut or garbled answer (ValueError: not JSON) is network trouble too: retried.
_LIST_ERRORS: tuple[type[BaseException], ...] = (*CALL_ERRORS, ValueError)


class Selected:
    """One kind of object restricted by a selector, listed and watched with the official
    client (``kubernetes.watch.Watch``): ``hermit_node.control.informer.ListWatch``. Objects are
    the API's JSON, as plain dicts."""

    def __init__(self, what: str, fn: Callable[..., Any], *args: Any, **selectors: str) -> None:
        self.what = what
        self._fn, self._args, self._selectors = fn, args, selectors

    def list(self) -> tuple[list[KubeObject], str]:
        try:
            resp = self._fn(*self._args, _preload_content=False,
                            _request_timeout=REQUEST_TIMEOUT, **self._selectors)
            body = json.loads(resp.data)
        except _LIST_ERRORS as exc:
            raise api_error(f"listing {self.what}", exc) from None
        items = [i for i in body.get("items") or [] if isinstance(i, dict)]
        for item in items:  # a list's items carry no kind
            item.setdefault("kind", str(body.get("kind") or "").removesuffix("List"))
        return items, str((body.get("metadata") or {}).get("resourceVersion") or "")

    def watch(self, resource_version: str, timeout_seconds: int
              ) -> Iterator[tuple[str, KubeObject]]:
        w = watch.Watch()  # type: ignore[no-untyped-call]
        stream = w.stream(  # type: ignore[no-untyped-call]
            self._fn, *self._args, resource_version=resource_version,
            timeout_seconds=timeout_seconds, allow_watch_bookmarks=True,
            _request_timeout=(REQUEST_TIMEOUT[0], timeout_seconds + 30), **self._selectors)
        try:
            # An ERROR event (410 Gone: the resourceVersion is too old) is raised by the
            # client as an ApiException with its code. (Not deserialize=False: the client
            # then fails on ERROR events.)
            for event in stream:
                obj = event.get("raw_object")
                if isinstance(obj, dict):
                    yield str(event.get("type")), obj
        except _LIST_ERRORS as exc:
            raise api_error(f"watching {self.what}", exc) from None
        finally:
            w.stop()  # type: ignore[no-untyped-call]


class Kube(KubeApi):
    """Exactly the calls the node-agent makes: its node, the pods on it and the
    Checkpoints labelled with it (each listed and watched: ``Selected``), Checkpoints (get,
    create, patch status: KubeApi), Events on them, and the one Secret a sandbox's
    per-sandbox storage names (get only)."""

    def __init__(self, api_client: client.ApiClient, node_name: str) -> None:
        super().__init__(api_client)
        self.node_name = node_name

    # -- what the node-agent watches ------------------------------------------------

    def node_pods(self) -> Selected:
        """Every pod bound to this node (all namespaces)."""
        return Selected(f"pods on node {self.node_name}", self._core.list_pod_for_all_namespaces,
                        field_selector=f"spec.nodeName={self.node_name}")

    def list_node_pods(self) -> list[KubeObject]:
        """Every pod bound to this node, read now rather than from the watched copy (a
        check right before an irreversible step: garbage collection, a turn's decision)."""
        return self.node_pods().list()[0]

    def node_checkpoints(self) -> Selected:
        """The Checkpoints labelled with this node (all namespaces): the only ones it may
        serve or report on."""
        return Selected(f"Checkpoints of node {self.node_name}",
                        self._custom.list_cluster_custom_object, api.GROUP, api.VERSION,
                        api.CHECKPOINT_PLURAL,
                        label_selector=protocol.node_selector(self.node_name))

    def this_node(self) -> Selected:
        """This node's Node object."""
        return Selected(f"node {self.node_name}", self._core.list_node,
                        field_selector=f"metadata.name={self.node_name}")

    def list_node_checkpoints(self) -> list[KubeObject]:
        """The Checkpoints labelled with this node, read now (not from a watch)."""
        return self.node_checkpoints().list()[0]

    def list_sandbox_checkpoints(self, namespace: str, sandbox: str) -> list[KubeObject]:
        """The Checkpoints of one sandbox (label ``hermit.dev/sandbox``), any node's: what
        a prefetch chooses from (planner.prefetch_source)."""
        out = self._call(f"listing the Checkpoints of AgentSandbox {namespace}/{sandbox}",
                         self._custom.list_namespaced_custom_object, api.GROUP, api.VERSION,
                         namespace, api.CHECKPOINT_PLURAL,
                         label_selector=f"{protocol.LABEL_SANDBOX}={sandbox}")
        items = out.get("items") if isinstance(out, dict) else None
        return [i for i in items or [] if isinstance(i, dict)]

    # -- pods -----------------------------------------------------------------------

    def list_sandbox_pods(self, namespace: str, sandbox: str) -> list[KubeObject]:
        """Every pod of one sandbox (label ``hermit.dev/sandbox``), on any node."""
        out = self._call(f"listing the pods of AgentSandbox {namespace}/{sandbox}",
                         self._core.list_namespaced_pod, namespace,
                         label_selector=f"{protocol.LABEL_SANDBOX}={sandbox}")
        return [self._dict(p) for p in out.items or []]

    def annotate_pod(self, namespace: str, name: str,
                     annotations: dict[str, str | None]) -> None:
        """Merge ``annotations`` into the pod's (a None value removes one)."""
        self._call(f"annotating pod {namespace}/{name}", self._core.patch_namespaced_pod,
                   name, namespace, {"metadata": {"annotations": annotations}},
                   _content_type=MERGE_PATCH)

    # -- node -----------------------------------------------------------------------

    def patch_node(self, patch: KubeObject) -> None:
        self._call(f"patching node {self.node_name}", self._core.patch_node, self.node_name,
                   patch, _content_type=MERGE_PATCH)

    # -- Checkpoints ----------------------------------------------------------------

    def claim_checkpoint(self, namespace: str, name: str, status: KubeObject,
                         resource_version: str | None) -> None:
        """Take a Pending Checkpoint: its first status write (a JSON merge patch of the
        status subresource), applied only to ``resource_version`` of the object.
        KubeConflict when it changed since (another node-agent may have taken it)."""
        body: KubeObject = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        self._call(f"claiming Checkpoint {namespace}/{name}",
                   self._custom.patch_namespaced_custom_object_status, api.GROUP, api.VERSION,
                   namespace, api.CHECKPOINT_PLURAL, name, body, _content_type=MERGE_PATCH)

    # -- secrets --------------------------------------------------------------------

    # -- turn requests: who is calling, and may they (docs/turns.md) ------------------

    def review_access(self, user: KubeObject, attributes: KubeObject) -> KubeObject:
        """The status of a SubjectAccessReview (``allowed``, ``denied``, ``reason``) of
        ``user`` (a TokenReview's ``status.user``) for ``attributes`` (resourceAttributes)."""
        spec: KubeObject = {"user": user.get("username"), "groups": user.get("groups") or [],
                            "resourceAttributes": attributes}
        if user.get("uid"):
            spec["uid"] = user["uid"]
        if user.get("extra"):
            spec["extra"] = user["extra"]
        out = self._call("reviewing a caller's access",
                         client.AuthorizationV1Api(self._client).create_subject_access_review,
                         {"apiVersion": "authorization.k8s.io/v1",
                          "kind": "SubjectAccessReview", "spec": spec})
        return dict(self._dict(out).get("status") or {})

    # -- events ---------------------------------------------------------------------

    def checkpoint_event(self, ckpt: KubeObject, event_type: str, reason: str,
                         message: str) -> None:
        """Record an Event on a Checkpoint."""
        meta = ckpt.get("metadata") or {}
        self._event({"apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
                     "name": str(meta.get("name")), "namespace": str(meta.get("namespace")),
                     "uid": meta.get("uid")}, event_type, reason, message)

    def pod_event(self, namespace: str, name: str, uid: str, event_type: str, reason: str,
                  message: str) -> None:
        """Record an Event on a pod (a restore it asked for and was refused)."""
        self._event({"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": namespace,
                     "uid": uid}, event_type, reason, message)

    def _event(self, involved: KubeObject, event_type: str, reason: str,
               message: str) -> None:
        namespace, name = str(involved["namespace"]), str(involved["name"])
        now = protocol.rfc3339(datetime.now(UTC))
        body = {
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": involved,
            "type": event_type, "reason": reason, "message": message,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT, "reportingInstance": self.node_name,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self._call(f"recording an Event on {involved['kind']} {namespace}/{name}",
                   self._core.create_namespaced_event, namespace, body)
