"""The driver applies plans through the Kube adapter; here the adapter is an in-memory fake."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from hermit_common import api
from hermit_common.settings import OperatorSettings
from hermit_operator import driver
from hermit_operator.podspec import InvalidSpec
from hermit_operator.reconcile import Event

SAMPLE = Path(__file__).resolve().parents[2] / "crds" / "samples" / "agentsandbox-minimal.yaml"
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


class FakeKube:
    def __init__(self, sandbox: dict[str, Any]) -> None:
        self.sandbox = sandbox
        self.pods: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.sandbox)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.pods.get(name))

    def create_pod(self, manifest: dict[str, Any]) -> dict[str, Any]:
        name = manifest["metadata"]["name"]
        self.calls.append(f"create {name}")
        return self.pods.setdefault(name, copy.deepcopy(manifest))

    def delete_pod(self, namespace: str, name: str) -> None:
        self.calls.append(f"delete {name}")
        self.pods.pop(name, None)

    def patch_sandbox_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.sandbox.setdefault("status", {})
        _merge(self.sandbox["status"], status)


@pytest.fixture
def sandbox() -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    obj["metadata"].update(namespace="ns", uid="u-1", generation=1)
    return obj


def run(kube: FakeKube, events: list[Event]) -> Any:
    return driver.reconcile_sandbox(kube, OperatorSettings(), "ns", "minimal",  # type: ignore[arg-type]
                                    lambda _sb, e: events.append(e), now=lambda: NOW)


def test_lifecycle_create_run_and_pod_loss(sandbox: dict[str, Any]) -> None:
    kube, events = FakeKube(sandbox), list[Event]()
    run(kube, events)
    assert kube.calls == ["create minimal-1"]
    assert kube.sandbox["status"]["podName"] == "minimal-1"
    run(kube, events)  # nothing new happened: no second pod
    assert kube.calls == ["create minimal-1"]
    kube.pods["minimal-1"]["spec"]["nodeName"] = "spot-1"
    kube.pods["minimal-1"]["status"] = {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True"}]}
    run(kube, events)
    assert (kube.sandbox["status"]["phase"], kube.sandbox["status"]["nodeName"]) == (
        "Running", "spot-1")
    del kube.pods["minimal-1"]  # the node vanished with the pod
    run(kube, events)
    assert kube.calls[-1] == "create minimal-2"
    assert kube.sandbox["status"]["incarnation"] == 2
    assert [e.reason for e in events] == ["PodCreating", "PodRunning", "PodLost", "PodCreating"]


def test_invalid_spec_is_recorded_then_raised(sandbox: dict[str, Any]) -> None:
    del sandbox["spec"]["podTemplate"]["spec"]["containers"][0]["command"]
    kube, events = FakeKube(sandbox), list[Event]()
    with pytest.raises(InvalidSpec, match="command is required"):
        run(kube, events)
    assert kube.calls == [] and kube.sandbox["status"]["phase"] == "Failed"
    assert [(e.type, e.reason) for e in events] == [("Warning", api.REASON_INVALID_SPEC)]


def test_deleted_sandbox_is_a_no_op(sandbox: dict[str, Any]) -> None:
    kube = FakeKube(sandbox)
    kube.get_sandbox = lambda namespace, name: None  # type: ignore[method-assign]
    assert run(kube, []) is None and kube.calls == []


def test_owner_sandbox_reads_the_controller_reference() -> None:
    ref = {"apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND, "name": "s",
           "controller": True}
    assert driver.owner_sandbox({"metadata": {"ownerReferences": [ref]}}) == "s"
    assert driver.owner_sandbox({"metadata": {"ownerReferences": [
        {**ref, "controller": False}]}}) is None
    assert driver.owner_sandbox({"metadata": {}}) is None


def test_handlers_register_with_kopf() -> None:
    import kopf

    import hermit_operator.handlers  # noqa: F401

    registry = kopf.get_default_registry()
    names = {h.id for h in registry._changing.get_all_handlers()}
    assert any("sandbox_changed" in n for n in names)
    assert any("pod_event" in h.id for h in registry._watching.get_all_handlers())
    assert any("startup" in h.id for h in registry._activities.get_all_handlers())
