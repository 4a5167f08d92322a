"""What the cluster looked like when an e2e test failed, kept outside the repository.

A failing e2e test (often in CI, after the cluster is gone) is diagnosed from this file:
nodes (readiness, cordon, spot labels, taints), the test namespace's sandboxes,
checkpoints, pods and events, and the tails of the operator's and node-agents' logs.
It is written to ``~/.cache/hermit/logs/e2e-failures/<test>.txt`` (the newest of each
test replaces the older) and its path is added to the test's report. Reading never
raises: a diagnostic that fails to read says so in the file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kubernetes import client

from hermit_common import api

Obj = dict[str, Any]

LOG_DIR = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit")) \
    / "logs/e2e-failures"
OPERATOR_LOG_LINES = 400
NODE_AGENT_LOG_LINES = 200
_SPOT_LABEL = re.compile(r"(capacity|spot|preemptible|priority|zone)", re.IGNORECASE)


def _section(title: str, read: Callable[[], Iterable[str]]) -> list[str]:
    lines = [f"===== {title}"]
    try:
        lines.extend(read())
    except Exception as exc:  # a diagnostic must not hide the test's own failure
        lines.append(f"(could not read: {type(exc).__name__}: {str(exc)[:300]})")
    return [*lines, ""]


def _json(obj: Any) -> Obj:
    return dict(client.ApiClient().sanitize_for_serialization(obj))


def _nodes(core: client.CoreV1Api) -> list[str]:
    out = []
    for node in core.list_node().items:
        n = _json(node)
        ready = next((c["status"] for c in n["status"].get("conditions") or []
                      if c["type"] == "Ready"), "?")
        labels = {k: v for k, v in (n["metadata"].get("labels") or {}).items()
                  if _SPOT_LABEL.search(k)}
        taints = [f"{t['key']}={t.get('value', '')}:{t['effect']}"
                  for t in n["spec"].get("taints") or []]
        out.append(f"{n['metadata']['name']}: Ready={ready} "
                   f"unschedulable={bool(n['spec'].get('unschedulable'))} "
                   f"labels={labels} taints={taints}")
    return out


def _custom(namespace: str, plural: str) -> list[str]:
    items = client.CustomObjectsApi().list_namespaced_custom_object(
        api.GROUP, api.VERSION, namespace, plural)["items"]
    return [json.dumps({"name": i["metadata"]["name"], "labels": i["metadata"].get("labels"),
                        "spec": i.get("spec"), "status": i.get("status")}, sort_keys=True)
            for i in items]


def _pods(core: client.CoreV1Api, namespace: str) -> list[str]:
    out = []
    for pod in core.list_namespaced_pod(namespace).items:
        p = _json(pod)
        conds = {c["type"]: c["status"] for c in p["status"].get("conditions") or []}
        hermit = {k: v for k, v in (p["metadata"].get("annotations") or {}).items()
                  if "hermit" in k}
        out.append(f"{p['metadata']['name']}: phase={p['status'].get('phase')} "
                   f"node={p['spec'].get('nodeName')} deleting="
                   f"{bool(p['metadata'].get('deletionTimestamp'))} conditions={conds} "
                   f"annotations={hermit}")
    return out


def _events(core: client.CoreV1Api, namespace: str) -> list[str]:
    events = [_json(e) for e in core.list_namespaced_event(namespace).items]
    events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [f"{e.get('lastTimestamp') or e.get('eventTime')} {e.get('type')} "
            f"{e['involvedObject'].get('kind')}/{e['involvedObject'].get('name')} "
            f"{e.get('reason')}: {e.get('message')}" for e in events]


def _logs(core: client.CoreV1Api, namespace: str, selector: str, lines: int) -> list[str]:
    out = []
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        name, node = pod.metadata.name, pod.spec.node_name
        out.append(f"----- {name} on {node}")
        try:
            text = core.read_namespaced_pod_log(name, namespace, tail_lines=lines) or ""
        except client.ApiException as exc:
            text = f"(no log: {exc.status} {exc.reason})"
        out.extend(text.splitlines())
    return out


def dump(test_id: str, namespace: str | None, release_namespace: str) -> Path:
    """Writes the diagnostics of a failed test; returns the file's path."""
    core = client.CoreV1Api()
    lines = [f"test: {test_id}", f"namespace: {namespace}", ""]
    lines += _section("nodes", lambda: _nodes(core))
    if namespace:
        lines += _section("agentsandboxes", lambda: _custom(namespace, api.SANDBOX_PLURAL))
        lines += _section("checkpoints", lambda: _custom(namespace, api.CHECKPOINT_PLURAL))
        lines += _section("pods", lambda: _pods(core, namespace))
        lines += _section("events", lambda: _events(core, namespace))
    lines += _section("release pods", lambda: _pods(core, release_namespace))
    lines += _section("operator log", lambda: _logs(
        core, release_namespace, "app.kubernetes.io/component=operator", OPERATOR_LOG_LINES))
    lines += _section("node-agent logs", lambda: _logs(
        core, release_namespace, "app.kubernetes.io/component=node-agent",
        NODE_AGENT_LOG_LINES))
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    path = LOG_DIR / (re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id)[-150:] + ".txt")
    path.write_text("\n".join(lines) + "\n")
    return path
