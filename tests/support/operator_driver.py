"""The operator's driver against a fake API: ``FakeKube``, the sample sandbox (a
fixture), and ``run`` to drive a list of events."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from hermit_common import protocol
from hermit_common.settings import OperatorSettings
from hermit_operator import driver
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
        self.checkpoints: dict[str, dict[str, Any]] = {}
        self.pdbs: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.graces: list[int | None] = []  # the grace period of each pod delete
        self.terminating = False  # the namespace is being deleted

    def namespace_terminating(self, namespace: str) -> bool:
        return self.terminating

    def list_checkpoints(self, namespace: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(c) for c in self.checkpoints.values()]

    def create_checkpoint(self, manifest: dict[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        self.calls.append(f"create checkpoint {name}")
        self.checkpoints.setdefault(name, copy.deepcopy(manifest))

    def patch_checkpoint(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.calls.append(f"patch checkpoint {name}")
        _merge(self.checkpoints[name], patch)

    def delete_checkpoint(self, namespace: str, name: str) -> None:
        self.calls.append(f"delete checkpoint {name}")
        self.checkpoints.pop(name, None)

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.sandbox)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.pods.get(name))

    def create_pod(self, manifest: dict[str, Any]) -> dict[str, Any]:
        name = manifest["metadata"]["name"]
        self.calls.append(f"create {name}")
        return self.pods.setdefault(name, copy.deepcopy(manifest))

    def list_sandbox_pods(self, namespace: str, sandbox: str) -> list[dict[str, Any]]:
        return [copy.deepcopy(p) for p in self.pods.values()
                if ((p.get("metadata") or {}).get("labels") or {}).get(
                    protocol.LABEL_SANDBOX) == sandbox]

    def delete_pod(self, namespace: str, name: str, grace_seconds: int | None = None,
                   uid: str | None = None) -> None:
        self.calls.append(f"delete {name}")
        self.graces.append(grace_seconds)
        self.pods.pop(name, None)

    def patch_sandbox_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.sandbox.setdefault("status", {})
        _merge(self.sandbox["status"], status)

    def patch_checkpoint_status(self, namespace: str, name: str,
                                status: dict[str, Any]) -> None:
        self.calls.append(f"patch checkpoint status {name}")
        self.checkpoints.setdefault(name, {"metadata": {"name": name}})
        self.checkpoints[name].setdefault("status", {})
        _merge(self.checkpoints[name]["status"], status)

    def ensure_pdb(self, manifest: dict[str, Any]) -> None:
        name = manifest["metadata"]["name"]
        self.calls.append(f"ensure pdb {name}")
        self.pdbs.setdefault(name, copy.deepcopy(manifest))

    def delete_pdb(self, namespace: str, name: str, owner_uid: str | None) -> None:
        self.calls.append(f"delete pdb {name}")
        self.pdbs.pop(name, None)


@pytest.fixture
def sandbox() -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load(SAMPLE.read_text())
    obj["metadata"].update(namespace="ns", uid="u-1", generation=1)
    return obj


def run(kube: FakeKube, events: list[Event],
        settings: OperatorSettings | None = None) -> Any:
    return driver.reconcile_sandbox(kube, settings or OperatorSettings(),  # type: ignore[arg-type]
                                    "ns", "minimal", lambda _sb, e: events.append(e),
                                    now=lambda: NOW)
