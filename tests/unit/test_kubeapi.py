"""hermit_common.kubeapi: API errors classified by HTTP meaning, and the shared AgentSandbox
and Checkpoint calls, against fake functions and a fake custom-objects API (no cluster)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

import hermit_node.control.kube
import hermit_operator.kube
from hermit_common import protocol
from hermit_common.errors import HermitError
from hermit_common.kubeapi import (
    KubeApi,
    KubeApiError,
    KubeConflict,
    KubeForbidden,
    KubeInvalid,
    KubeNamespaceTerminating,
    KubeNotFound,
    KubeTransient,
    api_error,
)
from hermit_common.kubeclient import DETAIL_LIMIT, REQUEST_TIMEOUT

WHAT = "reading AgentSandbox ns/box"


def api_exception(status: int, message: str | None = None, reason: str = "Reason") -> ApiException:
    exc = ApiException(status=status, reason=reason)
    if message is not None:
        exc.body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                               "message": message, "code": status})
    return exc


def kube_api() -> KubeApi:
    return KubeApi(client.ApiClient(client.Configuration()))


def max_retry(reason: Exception) -> urllib3.exceptions.MaxRetryError:
    """What urllib3 raises when its retries are spent (no pool needed for the message)."""
    return urllib3.exceptions.MaxRetryError(None, "/apis", reason)  # type: ignore[arg-type]


def raising(exc: BaseException) -> Any:
    def fn(*_: Any, **__: Any) -> Any:
        raise exc
    return fn


# -- the taxonomy -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, KubeInvalid), (422, KubeInvalid),
        (401, KubeForbidden), (403, KubeForbidden),
        (404, KubeNotFound),
        (409, KubeConflict),
        (408, KubeTransient), (429, KubeTransient),
        (500, KubeTransient), (502, KubeTransient), (503, KubeTransient), (504, KubeTransient),
        (405, KubeApiError), (410, KubeApiError), (413, KubeApiError),
    ],
)
def test_api_exceptions_are_classified_by_status(status: int, cls: type[KubeApiError]) -> None:
    err = api_error(WHAT, api_exception(status, "the server says no"))
    assert type(err) is cls
    assert isinstance(err, KubeApiError) and isinstance(err, HermitError)
    assert err.status == status
    assert str(err) == f"{WHAT} failed: the server says no"
    assert err.detail == "the server says no"


def test_a_create_in_a_namespace_being_deleted_is_told_by_its_cause() -> None:
    """The API server's 403 for it carries details.causes[].reason NamespaceTerminating
    (the operator then ends the termination holds there); any other 403 is RBAC's."""
    exc = api_exception(403, 'pods "box-2" is forbidden: unable to create new content in '
                        "namespace ns because it is being terminated")
    body = json.loads(exc.body)
    exc.body = json.dumps({**body, "reason": "Forbidden", "details": {
        "name": "box-2", "kind": "pods", "causes": [
            {"reason": "NamespaceTerminating", "message": "namespace ns is being terminated",
             "field": "metadata.namespace"}]}})
    err = api_error(WHAT, exc)
    assert type(err) is KubeNamespaceTerminating and isinstance(err, KubeForbidden)
    assert err.status == 403 and "being terminated" in str(err)
    assert type(api_error(WHAT, api_exception(403, "RBAC says no"))) is KubeForbidden
    assert type(api_error(WHAT, api_exception(403, reason="Forbidden"))) is KubeForbidden


def test_without_a_status_body_the_message_is_the_http_status() -> None:
    err = api_error(WHAT, api_exception(503, reason="Service Unavailable"))
    assert str(err) == f"{WHAT} failed: HTTP 503 Service Unavailable"
    assert isinstance(err, KubeTransient)


def test_the_client_s_status_0_no_response_is_transient() -> None:
    # kubernetes.client.rest raises ApiException(status=0) for a TLS failure.
    err = api_error(WHAT, ApiException(status=0, reason="SSLError\ncertificate verify failed"))
    assert isinstance(err, KubeTransient) and err.status is None
    assert "\n" not in str(err) and "certificate verify failed" in str(err)


@pytest.mark.parametrize(
    ("exc", "shown"),
    [
        (max_retry(urllib3.exceptions.NewConnectionError(
            None,  # type: ignore[arg-type]
            "Failed to establish a new connection: [Errno 111] Connection refused")),
         "Connection refused"),
        (urllib3.exceptions.ReadTimeoutError(
            None, "/apis", "Read timed out."),  # type: ignore[arg-type]
         "Read timed out"),
        (urllib3.exceptions.ProtocolError("Connection aborted."), "Connection aborted"),
        (ConnectionResetError(104, "Connection reset by peer"), "Connection reset by peer"),
        (TimeoutError("timed out"), "timed out"),
        (ConfigException("exec: process returned 1"), "exec: process returned 1"),
    ],
)
def test_network_errors_are_transient(exc: BaseException, shown: str) -> None:
    with pytest.raises(KubeTransient) as info:
        kube_api()._call(WHAT, raising(exc))
    assert str(info.value).startswith(f"{WHAT} failed: ") and shown in str(info.value)
    assert "\n" not in str(info.value)
    assert info.value.status is None


def test_call_passes_the_request_timeout_and_returns_the_result() -> None:
    seen: list[Any] = []

    def fn(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        return {"ok": True}

    assert kube_api()._call(WHAT, fn, "a", field_selector="x=y") == {"ok": True}
    assert seen == [(("a",), {"_request_timeout": REQUEST_TIMEOUT, "field_selector": "x=y"})]


@pytest.mark.parametrize("status", [403, 404, 409, 422, 500])
def test_call_raises_the_classified_error(status: int) -> None:
    with pytest.raises(KubeApiError) as info:
        kube_api()._call(WHAT, raising(api_exception(status, "no")))
    assert type(info.value) is type(api_error(WHAT, api_exception(status)))
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_call_does_not_hide_bugs() -> None:
    with pytest.raises(TypeError):
        kube_api()._call(WHAT, raising(TypeError("unexpected keyword argument 'nme'")))


def test_get_or_none() -> None:
    assert kube_api()._get_or_none(WHAT, raising(api_exception(404))) is None
    with pytest.raises(KubeForbidden):
        kube_api()._get_or_none(WHAT, raising(api_exception(403)))


def test_the_components_export_the_common_errors() -> None:
    assert hermit_node.control.kube.KubeError is KubeApiError  # catching it catches every failure
    assert hermit_node.control.kube.KubeTransient is KubeTransient
    assert hermit_operator.kube.KubeTransient is KubeTransient
    assert hermit_operator.kube.KubeError is KubeApiError
    for cls in (KubeNotFound, KubeConflict, KubeInvalid, KubeForbidden, KubeTransient):
        assert issubclass(cls, hermit_node.control.kube.KubeError)
    # The node-agent's tests raise it with a message alone.
    assert str(hermit_node.control.kube.KubeError("HTTP 503")) == "HTTP 503"


# -- the shared calls ---------------------------------------------------------------

CKPT = {"apiVersion": "hermit.dev/v1alpha1", "kind": "Checkpoint",
        "metadata": {"name": "c1", "namespace": "ns"}, "spec": {"sandboxRef": {"name": "box"}}}


class FakeCustom:
    """Just enough of CustomObjectsApi: objects by (namespace, plural, name)."""

    def __init__(self, *, fail: dict[str, int] | None = None) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.fail = fail or {}
        self.calls: list[str] = []

    def _maybe_fail(self, call: str) -> None:
        self.calls.append(call)
        if call in self.fail:
            raise api_exception(self.fail[call], f"{call} refused")

    def get_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                     plural: str, name: str, **_: Any) -> Any:
        self._maybe_fail("get")
        try:
            return self.objects[namespace, plural, name]
        except KeyError:
            raise api_exception(404, f'{plural} "{name}" not found') from None

    def create_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                        plural: str, body: Any, **_: Any) -> Any:
        self._maybe_fail("create")
        key = (namespace, plural, body["metadata"]["name"])
        if key in self.objects:
            raise api_exception(409, "already exists")
        self.objects[key] = {**body, "metadata": {**body["metadata"], "namespace": namespace}}
        return self.objects[key]

    def list_namespaced_custom_object(self, group: str, version: str, namespace: str,
                                      plural: str, **_: Any) -> Any:
        self._maybe_fail("list")
        return {"items": [o for (ns, p, _n), o in self.objects.items()
                          if ns == namespace and p == plural]}

    def list_cluster_custom_object(self, group: str, version: str, plural: str,
                                   **_: Any) -> Any:
        self._maybe_fail("list")
        return {"items": [o for (_ns, p, _n), o in self.objects.items() if p == plural]}

    def patch_namespaced_custom_object_status(self, group: str, version: str, namespace: str,
                                              plural: str, name: str, body: Any,
                                              **kwargs: Any) -> Any:
        self._maybe_fail("patch status")
        obj = self.objects.get((namespace, plural, name))
        if obj is None:
            raise api_exception(404, "not found")
        self.calls[-1] += f" {kwargs.get('_content_type')}"
        obj.setdefault("status", {}).update(body["status"])
        return obj


def with_custom(kube: KubeApi, custom: FakeCustom) -> Any:
    kube._custom = custom  # type: ignore[assignment]
    return kube


def test_get_sandbox_and_checkpoint_are_none_when_missing() -> None:
    custom = FakeCustom()
    kube = with_custom(kube_api(), custom)
    custom.objects["ns", "agentsandboxes", "box"] = {"metadata": {"name": "box"}}
    assert kube.get_sandbox("ns", "box") == {"metadata": {"name": "box"}}
    assert kube.get_sandbox("ns", "gone") is None
    assert kube.get_checkpoint("ns", "gone") is None
    kube._custom = FakeCustom(fail={"get": 403})
    with pytest.raises(KubeForbidden, match=r"^reading Checkpoint ns/c1 failed: get refused$"):
        kube.get_checkpoint("ns", "c1")


def test_list_checkpoints_in_a_namespace_or_the_cluster() -> None:
    custom = FakeCustom()
    kube = with_custom(kube_api(), custom)
    kube.create_checkpoint(CKPT)
    kube.create_checkpoint(CKPT, "other")
    assert [c["metadata"]["namespace"] for c in kube.list_checkpoints("ns")] == ["ns"]
    assert sorted(c["metadata"]["namespace"] for c in kube.list_checkpoints()) == [
        "ns", "other"]
    kube._custom = FakeCustom(fail={"list": 503})
    with pytest.raises(KubeTransient, match=r"^listing Checkpoints in ns failed: "):
        kube.list_checkpoints("ns")


def test_create_checkpoint_returns_the_existing_one_on_409() -> None:
    custom = FakeCustom()
    kube = with_custom(kube_api(), custom)
    made = kube.create_checkpoint(CKPT)
    assert made["metadata"] == {"name": "c1", "namespace": "ns"}
    custom.objects["ns", "checkpoints", "c1"]["status"] = {"phase": "Dumping"}
    again = kube.create_checkpoint({**CKPT, "spec": {"reason": "Manual"}})
    assert again["status"] == {"phase": "Dumping"}  # the one that exists, untouched
    assert custom.calls == ["create", "create", "get"]


def test_create_checkpoint_of_one_that_vanished_after_the_409_is_transient() -> None:
    kube = with_custom(kube_api(), FakeCustom(fail={"create": 409}))
    with pytest.raises(KubeTransient, match=r"^creating Checkpoint ns/c1: it existed and "
                                            r"vanished"):
        kube.create_checkpoint(CKPT)


@pytest.mark.parametrize(("status", "cls"), [(403, KubeForbidden), (422, KubeInvalid),
                                             (500, KubeTransient)])
def test_create_checkpoint_errors(status: int, cls: type[KubeApiError]) -> None:
    kube = with_custom(kube_api(), FakeCustom(fail={"create": status}))
    with pytest.raises(cls, match=r"^creating Checkpoint ns/c1 failed: create refused$"):
        kube.create_checkpoint(CKPT)


def test_patch_checkpoint_status_is_a_merge_patch_and_404_is_not_found() -> None:
    custom = FakeCustom()
    kube = with_custom(kube_api(), custom)
    kube.create_checkpoint(CKPT)
    kube.patch_checkpoint_status("ns", "c1", {"phase": "Failed"})
    assert custom.objects["ns", "checkpoints", "c1"]["status"] == {"phase": "Failed"}
    assert custom.calls[-1] == "patch status application/merge-patch+json"
    with pytest.raises(KubeNotFound):
        kube.patch_checkpoint_status("ns", "gone", {"phase": "Failed"})


def test_the_node_agent_creates_checkpoints_in_the_pods_namespace() -> None:
    custom = FakeCustom()
    kube = hermit_node.control.kube.Kube(client.ApiClient(client.Configuration()), "node-a")
    kube._custom = custom  # type: ignore[assignment]
    body = {k: v for k, v in CKPT.items() if k != "metadata"} | {"metadata": {"name": "c1"}}
    assert kube.create_checkpoint(body, "ns")["metadata"]["namespace"] == "ns"
    assert kube.create_checkpoint(body, "ns")["metadata"]["name"] == "c1"  # 409: existing
    assert [c["metadata"]["name"] for c in kube.list_checkpoints()] == ["c1"]  # cluster-wide
    with pytest.raises(hermit_node.control.kube.KubeError):  # the node-agent wants 404 to raise
        kube.patch_checkpoint_status("ns", "gone", {"phase": "Dumping"})


def test_one_line_keeps_each_former_helper_s_behaviour() -> None:
    # protocol.one_line is the one message folder: statuses and annotations end a cut
    # message with "..."; API error details are cut at DETAIL_LIMIT, with no mark.
    assert protocol.one_line("a\n  b\tc") == "a b c"
    assert protocol.one_line("x" * 2000) == "x" * (protocol.MESSAGE_LIMIT - 3) + "..."
    assert protocol.one_line("y" * 400, DETAIL_LIMIT, mark="") == "y" * DETAIL_LIMIT
    assert protocol.one_line(TimeoutError()) == "TimeoutError"
    assert protocol.one_line(OSError("disk\nfull")) == "disk full"
    assert protocol.one_line("") == ""
