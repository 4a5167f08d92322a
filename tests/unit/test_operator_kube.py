"""The operator's Kube adapter for PodDisruptionBudgets and orphaned Checkpoints, against a
fake policy/v1 and custom-objects API (no cluster)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hermit_operator.kube import Kube, KubeForbidden, KubeTransient
from hermit_operator.podspec import InvalidSpec

OWNER = {"apiVersion": "hermit.dev/v1alpha1", "kind": "AgentSandbox", "name": "box",
         "uid": "u-1", "controller": True, "blockOwnerDeletion": True}
SPEC = {"maxUnavailable": 0, "selector": {"matchLabels": {"hermit.dev/sandbox": "box"}}}
PDB = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
       "metadata": {"name": "box", "namespace": "ns", "ownerReferences": [OWNER]},
       "spec": SPEC}


class FakePolicy:
    def __init__(self, existing: dict[str, Any] | None = None, create_status: int = 0) -> None:
        self.existing = existing
        self.create_status = create_status
        self.calls: list[str] = []

    def create_namespaced_pod_disruption_budget(self, namespace: str, body: Any,
                                                **_: Any) -> Any:
        self.calls.append("create")
        if self.create_status:
            raise ApiException(status=self.create_status)
        self.existing = copy.deepcopy(body)
        return body

    def read_namespaced_pod_disruption_budget(self, name: str, namespace: str,
                                              **_: Any) -> Any:
        if self.existing is None:
            raise ApiException(status=404)
        return copy.deepcopy(self.existing)

    def patch_namespaced_pod_disruption_budget(self, name: str, namespace: str, body: Any,
                                               **kwargs: Any) -> Any:
        self.calls.append(f"patch {body} {kwargs.get('_content_type')}")
        return body

    def delete_namespaced_pod_disruption_budget(self, name: str, namespace: str,
                                                **kwargs: Any) -> Any:
        self.calls.append(f"delete {kwargs['body'].preconditions.uid}")
        return {}


def kube_with(policy: FakePolicy) -> Kube:
    kube = Kube(client.ApiClient(client.Configuration()))
    kube._policy = policy
    return kube


def existing(spec: dict[str, Any] = SPEC, owner: dict[str, Any] = OWNER) -> dict[str, Any]:
    return {"metadata": {"name": "box", "uid": "pdb-1", "ownerReferences": [owner]},
            "spec": spec}


def test_ensure_pdb_creates_it() -> None:
    policy = FakePolicy()
    kube_with(policy).ensure_pdb(PDB)
    assert policy.calls == ["create"]


@pytest.mark.parametrize(
    ("found", "calls"),
    [
        (existing(), ["create"]),  # ours and up to date
        (existing({**SPEC, "maxUnavailable": 1}),
         ["create", f"patch {{'spec': {SPEC}}} application/merge-patch+json"]),
        (existing({"minAvailable": 1}, {**OWNER, "uid": "someone"}), ["create"]),  # not ours
        (None, ["create"]),  # vanished in between
    ],
)
def test_ensure_pdb_of_an_existing_budget(found: dict[str, Any] | None, calls: list[str]
                                          ) -> None:
    policy = FakePolicy(found, create_status=409)
    kube_with(policy).ensure_pdb(PDB)
    assert policy.calls == calls


def test_ensure_pdb_api_errors_are_transient() -> None:
    with pytest.raises(KubeTransient, match="creating PodDisruptionBudget ns/box"):
        kube_with(FakePolicy(create_status=500)).ensure_pdb(PDB)


@pytest.mark.parametrize(
    ("found", "calls"),
    [
        (existing(), ["delete pdb-1"]),
        (existing(owner={**OWNER, "uid": "someone"}), []),  # a budget of the same name
        (None, []),
    ],
)
def test_delete_pdb_only_deletes_the_sandbox_s_own(found: dict[str, Any] | None,
                                                   calls: list[str]) -> None:
    policy = FakePolicy(found)
    kube_with(policy).delete_pdb("ns", "box", "u-1")
    assert policy.calls == calls


class FakeCustom:
    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.patches: list[Any] = []

    def patch_namespaced_custom_object_status(self, *args: Any, **kwargs: Any) -> Any:
        if self.status:
            raise ApiException(status=self.status)
        self.patches.append((args, kwargs.get("_content_type")))
        return {}


def test_patch_checkpoint_status() -> None:
    kube = kube_with(FakePolicy())
    custom = FakeCustom()
    kube._custom = custom  # type: ignore[assignment]
    kube.patch_checkpoint_status("ns", "c1", {"phase": "Failed"})
    (args, content_type), = custom.patches
    assert args[-2:] == ("c1", {"status": {"phase": "Failed"}})
    assert content_type == "application/merge-patch+json"
    kube._custom = FakeCustom(404)  # type: ignore[assignment]
    kube.patch_checkpoint_status("ns", "gone", {"phase": "Failed"})  # nothing to fail
    kube._custom = FakeCustom(503)  # type: ignore[assignment]
    with pytest.raises(KubeTransient):
        kube.patch_checkpoint_status("ns", "c1", {"phase": "Failed"})


POD = {"apiVersion": "v1", "kind": "Pod",
       "metadata": {"name": "box-1", "namespace": "ns", "ownerReferences": [OWNER]},
       "spec": {"containers": [{"name": "sandbox", "image": "busybox"}]}}


class FakeCore:
    def __init__(self, existing: dict[str, Any] | None = None, create_status: int = 0,
                 message: str = "") -> None:
        self.existing = existing
        self.create_status = create_status
        self.message = message
        self.calls: list[str] = []

    def create_namespaced_pod(self, namespace: str, body: Any, **_: Any) -> Any:
        self.calls.append("create")
        if self.create_status:
            exc = ApiException(status=self.create_status, reason="Unprocessable Entity")
            if self.message:
                exc.body = json.dumps({"kind": "Status", "message": self.message})
            raise exc
        return body

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> Any:
        self.calls.append("read")
        if self.existing is None:
            raise ApiException(status=404)
        return copy.deepcopy(self.existing)

    def delete_namespaced_pod(self, name: str, namespace: str, **_: Any) -> Any:
        self.calls.append("delete")
        raise ApiException(status=404)

    def list_namespaced_pod(self, namespace: str, **kwargs: Any) -> Any:
        self.calls.append(f"list {namespace} {kwargs['field_selector']} "
                          f"{kwargs['label_selector']}")
        return client.V1PodList(items=[])


def kube_with_core(core: FakeCore, namespaces: tuple[str, ...] = ()) -> Kube:
    kube = Kube(client.ApiClient(client.Configuration()), namespaces)
    kube._core = core  # type: ignore[assignment]
    return kube


def test_create_pod() -> None:
    assert kube_with_core(FakeCore()).create_pod(POD) == POD


@pytest.mark.parametrize("status", [400, 422])
def test_create_pod_rejected_by_the_api_is_an_invalid_spec(status: int) -> None:
    core = FakeCore(create_status=status, message='Pod "box-1" is invalid: spec.containers')
    with pytest.raises(InvalidSpec, match=r'^the API rejected pod box-1: Pod "box-1" is '
                                          r"invalid: spec\.containers$"):
        kube_with_core(core).create_pod(POD)


def test_create_pod_that_exists() -> None:
    mine = {"metadata": {"name": "box-1", "ownerReferences": [OWNER]}}
    assert kube_with_core(FakeCore(mine, create_status=409)).create_pod(POD) == mine
    theirs = {"metadata": {"name": "box-1", "ownerReferences": [{**OWNER, "uid": "x"}]}}
    with pytest.raises(InvalidSpec, match="already exists and is not owned by this sandbox"):
        kube_with_core(FakeCore(theirs, create_status=409)).create_pod(POD)
    with pytest.raises(KubeTransient, match="it exists and vanished"):
        kube_with_core(FakeCore(None, create_status=409)).create_pod(POD)


@pytest.mark.parametrize(("status", "cls"), [(500, KubeTransient), (429, KubeTransient),
                                             (403, KubeForbidden)])
def test_create_pod_api_errors(status: int, cls: type[Exception]) -> None:
    with pytest.raises(cls, match=r"^creating pod ns/box-1 failed: "):
        kube_with_core(FakeCore(create_status=status)).create_pod(POD)


def test_a_missing_pod_is_none_and_deleting_it_is_done() -> None:
    kube = kube_with_core(FakeCore())
    assert kube.get_pod("ns", "box-1") is None
    kube.delete_pod("ns", "box-1")


def test_the_key_service_reads_a_node_s_pods_in_the_sandbox_s_namespace_only() -> None:
    core = FakeCore()
    assert kube_with_core(core).list_node_sandbox_pods("node-a", "team-a") == []
    assert core.calls == ["list team-a spec.nodeName=node-a hermit.dev/sandbox"]


def test_outside_the_watched_namespaces_no_pod_is_read() -> None:
    """operator.watchNamespaces: the operator may not list pods elsewhere, and no sandbox
    there is its own (the key service then refuses, 403)."""
    core = FakeCore()
    kube = kube_with_core(core, ("team-a", "team-b"))
    assert kube.list_node_sandbox_pods("node-a", "team-c") == []
    assert core.calls == []
    kube.list_node_sandbox_pods("node-a", "team-b")
    assert core.calls == ["list team-b spec.nodeName=node-a hermit.dev/sandbox"]
    kube._custom = None  # type: ignore[assignment]  # no sandbox is read either
    assert kube.get_sandbox("team-c", "box") is None
