"""The Kubernetes adapter both components build on, and the errors its calls raise.

``KubeApi`` holds what the operator's and the node-agent's adapters share: the
connection, one ``_call`` that turns every failure into a ``KubeApiError``, and the
AgentSandbox and Checkpoint calls both make. Each component subclasses it with only the
calls it makes (``hermit_operator.kube.Kube``, ``hermit_node.control.kube.Kube``).

Errors are classified by what the HTTP status means, as kopf classifies its own API
errors (``kopf._cogs.clients.errors``):

============== ======================================== ==================================
error          when                                     what a caller does
============== ======================================== ==================================
KubeNotFound   404                                      the object is gone (getters: None)
KubeConflict   409                                      it exists already, or a precondition
                                                        no longer holds
KubeInvalid    400, 422                                 the request or object is wrong:
                                                        retrying the same one will not help
KubeForbidden  401, 403                                 credentials or RBAC
KubeTransient  408, 429, 5xx; network errors, timeouts, retry later
               TLS errors, credentials that cannot be
               refreshed right now
KubeApiError   the base class; alone for any other
               status (405, 410, 413, ...)
============== ======================================== ==================================

Every message is one line: ``"<what> failed: <the API server's message>"``. Exceptions
that are not API or network trouble (a wrong argument: a bug) are not caught.
"""

from __future__ import annotations

import http.client
from typing import Any, Self

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from hermit_common import api
from hermit_common.errors import HermitError, Retryable
from hermit_common.kubeclient import (
    DETAIL_LIMIT,
    MERGE_PATCH,
    REQUEST_TIMEOUT,
    KubeUnavailable,
    api_causes,
    api_message,
    load_configuration,
)
from hermit_common.protocol import KubeObject, one_line

# Failures on the way to or from the API server (urllib3 wraps most of them in
# MaxRetryError; sockets and TLS raise OSError; a cut response, HTTPException).
NETWORK_ERRORS: tuple[type[BaseException], ...] = (
    urllib3.exceptions.HTTPError, OSError, http.client.HTTPException)
# What ``_call`` turns into a KubeApiError: error responses, the network, and credentials
# that cannot be refreshed (an exec plugin or a token file failing at request time).
CALL_ERRORS: tuple[type[BaseException], ...] = (ApiException, ConfigException, *NETWORK_ERRORS)


# The cause (details.causes[].reason) of a 403 for a create in a namespace being deleted.
NAMESPACE_TERMINATING = "NamespaceTerminating"


class KubeApiError(HermitError):
    """A Kubernetes API call failed. ``status`` is the HTTP status (None when no response
    came back); ``detail`` is the reason without the ``"<what> failed: "`` prefix."""

    def __init__(self, message: str, *, status: int | None = None,
                 detail: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = message if detail is None else detail


class KubeNotFound(KubeApiError):
    """404: the object (or its namespace) does not exist."""


class KubeConflict(KubeApiError):
    """409: an object of that name exists already, or a precondition no longer holds."""


class KubeInvalid(KubeApiError):
    """400 or 422: the request or the object is wrong; the same request will fail again."""


class KubeForbidden(KubeApiError):
    """401 or 403: the credentials are not accepted, or RBAC does not allow the call."""


class KubeNamespaceTerminating(KubeForbidden):
    """403 with the cause NamespaceTerminating: nothing new can be created in a namespace
    being deleted (everything in it goes with it)."""


class KubeTransient(KubeApiError, Retryable):
    """429, 408 or 5xx, or no answer at all (network, timeout, TLS): retry later."""


def error_class(status: int | None) -> type[KubeApiError]:
    """The error class for an HTTP status (kopf's classification, coarser)."""
    if status in (400, 422):
        return KubeInvalid
    if status in (401, 403):
        return KubeForbidden
    if status == 404:
        return KubeNotFound
    if status == 409:
        return KubeConflict
    if status in (408, 429) or (status is not None and 500 <= status < 600):
        return KubeTransient
    return KubeApiError


def api_error(what: str, exc: BaseException) -> KubeApiError:
    """The KubeApiError for a failed call described by ``what`` ("reading pod ns/x").

    ApiException by its status; network errors (and credentials that cannot be refreshed)
    become KubeTransient. A KubeApiError passes through unchanged."""
    if isinstance(exc, KubeApiError):
        return exc
    if isinstance(exc, ApiException):
        if isinstance(exc.status, int) and exc.status > 0:
            detail = api_message(exc)
            kind = error_class(exc.status)
            if kind is KubeForbidden and NAMESPACE_TERMINATING in api_causes(exc):
                kind = KubeNamespaceTerminating
            return kind(f"{what} failed: {detail}", status=exc.status, detail=detail)
        # The client's own ApiException(status=0): a TLS failure, no response at all.
        detail = one_line(exc, DETAIL_LIMIT, mark="")
        return KubeTransient(f"{what} failed: {detail}", detail=detail)
    cause = getattr(exc, "reason", None)  # urllib3's MaxRetryError wraps the real one
    detail = one_line(cause if isinstance(cause, BaseException) else exc, DETAIL_LIMIT,
                      mark="")
    return KubeTransient(f"{what} failed: {detail}", detail=detail)


class KubeApi:
    """The calls both components make; objects go in and out as plain dicts in API
    (camelCase) form. Subclasses add their own calls, each through ``_call``."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._client = api_client
        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    @classmethod
    def connect(cls, *args: Any, **kwargs: Any) -> Self:
        """Connect with the pod's service account, else $KUBECONFIG (or ~/.kube/config);
        KubeUnavailable without credentials. Other arguments go to the constructor."""
        return cls(client.ApiClient(load_configuration()), *args, **kwargs)

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
            detail = one_line(cause, DETAIL_LIMIT, mark="")
            raise KubeUnavailable(
                f"cannot reach the Kubernetes API at {self.host}: {detail}") from None
        return str(info.git_version)

    # -- plumbing -------------------------------------------------------------------

    def _dict(self, obj: object) -> KubeObject:
        """A client model (or a dict) as a plain dict in API form."""
        out = self._client.sanitize_for_serialization(obj)  # type: ignore[no-untyped-call]
        return out if isinstance(out, dict) else {}

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with the request timeout; any API or network failure
        becomes the KubeApiError for its meaning, with the message ``"<what> failed: ..."``."""
        try:
            return fn(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except CALL_ERRORS as exc:
            raise api_error(what, exc) from None

    def _get_or_none(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``_call``, but None when the object does not exist (404)."""
        try:
            return self._call(what, fn, *args, **kwargs)
        except KubeNotFound:
            return None

    # -- callers ----------------------------------------------------------------------

    def review_token(self, token: str, audiences: list[str]) -> KubeObject:
        """The status of a TokenReview of a caller's bearer token (``authenticated``,
        ``user``, ``audiences``, ``error``); ``audiences`` empty: the API server's own."""
        spec: KubeObject = {"token": token}
        if audiences:
            spec["audiences"] = audiences
        out = self._call("reviewing a caller's token",
                         client.AuthenticationV1Api(self._client).create_token_review,
                         {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                          "spec": spec})
        return dict(self._dict(out).get("status") or {})

    # -- AgentSandboxes -------------------------------------------------------------

    def get_sandbox(self, namespace: str, name: str) -> KubeObject | None:
        """The AgentSandbox, or None when it does not exist."""
        out = self._get_or_none(f"reading AgentSandbox {namespace}/{name}",
                                self._custom.get_namespaced_custom_object, api.GROUP,
                                api.VERSION, namespace, api.SANDBOX_PLURAL, name)
        return out if isinstance(out, dict) else None

    # -- Checkpoints ----------------------------------------------------------------

    def get_checkpoint(self, namespace: str, name: str) -> KubeObject | None:
        """The Checkpoint, or None when it does not exist."""
        out = self._get_or_none(f"reading Checkpoint {namespace}/{name}",
                                self._custom.get_namespaced_custom_object, api.GROUP,
                                api.VERSION, namespace, api.CHECKPOINT_PLURAL, name)
        return out if isinstance(out, dict) else None

    def list_checkpoints(self, namespace: str | None = None) -> list[KubeObject]:
        """Every Checkpoint in ``namespace``, or in the cluster when it is None."""
        if namespace is None:
            out = self._call("listing Checkpoints", self._custom.list_cluster_custom_object,
                             api.GROUP, api.VERSION, api.CHECKPOINT_PLURAL)
        else:
            out = self._call(f"listing Checkpoints in {namespace}",
                             self._custom.list_namespaced_custom_object, api.GROUP,
                             api.VERSION, namespace, api.CHECKPOINT_PLURAL)
        items = out.get("items") if isinstance(out, dict) else None
        return [i for i in items or [] if isinstance(i, dict)]

    def create_checkpoint(self, manifest: KubeObject, namespace: str | None = None) -> KubeObject:
        """Create a Checkpoint in ``namespace`` (default: the manifest's own); when one of
        that name exists already (409), return that one as it is."""
        name = manifest["metadata"]["name"]
        ns = namespace if namespace is not None else manifest["metadata"]["namespace"]
        what = f"creating Checkpoint {ns}/{name}"
        try:
            out = self._call(what, self._custom.create_namespaced_custom_object, api.GROUP,
                             api.VERSION, ns, api.CHECKPOINT_PLURAL, manifest)
        except KubeConflict:
            out = self.get_checkpoint(ns, name)
            if out is None:
                raise KubeTransient(f"{what}: it existed and vanished; retrying") from None
        return out if isinstance(out, dict) else {}

    def patch_checkpoint_status(self, namespace: str, name: str, status: KubeObject) -> None:
        """A JSON merge patch of the Checkpoint's status subresource (None values remove
        fields); KubeNotFound when the Checkpoint does not exist."""
        self._call(f"patching the status of Checkpoint {namespace}/{name}",
                   self._custom.patch_namespaced_custom_object_status, api.GROUP, api.VERSION,
                   namespace, api.CHECKPOINT_PLURAL, name, {"status": status},
                   _content_type=MERGE_PATCH)
