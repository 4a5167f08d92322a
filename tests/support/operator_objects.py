"""The objects the operator's pure-function tests build: AgentSandboxes, their pods and
Checkpoints, conditions and times, with the operator settings they are planned with."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from hermit_common import api, protocol
from hermit_common.settings import OperatorSettings
from hermit_operator.conditions import get_condition
from hermit_operator.reconcile import Plan

SAMPLES = Path(__file__).resolve().parents[2] / "crds" / "samples"

SETTINGS = OperatorSettings()

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)

UID = "u-1"


def sandbox(status: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((SAMPLES / "agentsandbox-minimal.yaml").read_text())
    obj["metadata"].update(namespace="ns", uid=UID, generation=1,
                           creationTimestamp="2026-01-01T10:00:00Z")
    obj["spec"].update(spec)
    if status is not None:
        obj["status"] = status
    return obj


def ckpt(name: str, reason: str = "Interval", phase: str | None = "Completed", *,
         created: str = "11:00:00", done: str | None = None, node: str | None = "spot-1",
         owned: bool = True, sandbox_name: str = "minimal", message: str | None = None,
         rv: str = "7") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "resourceVersion": rv,
                            "creationTimestamp": f"2026-01-01T{created}Z"}
    if owned:
        meta["ownerReferences"] = [{"kind": api.SANDBOX_KIND, "uid": UID, "name": sandbox_name}]
        meta["labels"] = {protocol.LABEL_SANDBOX: sandbox_name}
        if node:
            meta["labels"][protocol.LABEL_NODE] = node
            # the operator checked it while its incarnation ran (see test_node_trust)
            meta["annotations"] = {protocol.ANNOTATION_NODE_VERIFIED: "true"}
    status: dict[str, Any] = {}
    if phase is not None:
        status["phase"] = phase
        if node:
            status["nodeName"] = node
        if phase in ("Completed", "Failed"):
            status["completedAt"] = f"2026-01-01T{done or created}Z"
        if message:
            status["message"] = message
    return {"apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND, "metadata": meta,
            "spec": {"sandboxRef": {"name": sandbox_name}, "reason": reason}, "status": status}


def pod(name: str = "minimal-1", phase: str = "Running", *, node: str = "spot-1",
        created: str = "10:30:00", incarnation: int = 1, restore_from: str | None = None,
        outcome: str | None = None, message: str | None = None) -> dict[str, Any]:
    annotations = {protocol.ANNOTATION_WORKSPACE_PATH: "/workspace"}
    if restore_from:
        annotations[protocol.ANNOTATION_RESTORE_FROM] = restore_from
    if outcome:
        annotations[protocol.ANNOTATION_RESTORE_PHASE] = outcome
    if message:
        annotations[protocol.ANNOTATION_RESTORE_MESSAGE] = message
    st: dict[str, Any] = {"phase": phase}
    if phase == "Running":
        st["conditions"] = [{"type": "Ready", "status": "True"}]
    return {"metadata": {"name": name, "namespace": "ns",
                         "creationTimestamp": f"2026-01-01T{created}Z",
                         "labels": {protocol.LABEL_SANDBOX: "minimal",
                                    protocol.LABEL_INCARNATION: str(incarnation)},
                         "annotations": annotations},
            "spec": {"nodeName": node}, "status": st}


RUNNING = {"incarnation": 1, "podName": "minimal-1", "restores": 0}


def cond(p: Plan, type_: str) -> dict[str, Any]:
    c = get_condition(p.status_patch["conditions"], type_)
    assert c is not None, type_
    return c


def after(p: Plan, sb: dict[str, Any]) -> dict[str, Any]:
    status = {**(sb.get("status") or {}), **p.status_patch}
    return {**sb, "status": {k: v for k, v in status.items() if v is not None}}


READY_SINCE = "2026-01-01T10:31:00Z"


def ready_pod(since: str = READY_SINCE, **kwargs: Any) -> dict[str, Any]:
    p = pod(**kwargs)
    p["status"]["conditions"] = [{"type": "Ready", "status": "True",
                                  "lastTransitionTime": since}]
    return p


def interval_sandbox(seconds: int = 300, status: dict[str, Any] | None = None,
                     **spec: Any) -> dict[str, Any]:
    return sandbox(dict(status if status is not None else RUNNING),
                   checkpoint={"intervalSeconds": seconds}, **spec)
