"""Turn boundaries on the cluster (docs/turns.md): a sandbox with ``onTurn: true`` driven
through turns by ``TurnClient`` is checkpointed only on the turns that changed something,
and a node lost without notice loses nothing of its last completed turn."""

from __future__ import annotations

import subprocess
import time
import uuid
from typing import Any

import requests
from kubernetes import client
from kubernetes.stream import stream

from hermit_common import protocol
from hermit_common.kubeapi import KubeApi
from hermit_common.settings import TURN_AUDIENCE
from hermit_common.turns import TurnClient, TurnResult
from tests.e2e import sandboxes as sb
from tests.e2e.conftest import RELEASE, REPO, E2EConfig, Kube, wait_until

HARNESS = "harness"
STRANGER = "stranger"
API_ONLY = "api-only"


def _exec(ns: str, pod: str, script: str) -> str:
    return str(stream(client.CoreV1Api().connect_get_namespaced_pod_exec, pod, ns,
                      command=["sh", "-c", script], stderr=True, stdin=False, stdout=True,
                      tty=False))


def _token(ns: str, account: str, audiences: list[str] | None = None) -> str:
    """A token of a new service account for the turn endpoint's audience (the chart's
    default), or for ``audiences`` ([]: the API server's own)."""
    core = client.CoreV1Api()
    core.create_namespaced_service_account(ns, {"metadata": {"name": account}})
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    wanted = [TURN_AUDIENCE] if audiences is None else audiences
    if wanted:
        spec["audiences"] = wanted
    out = core.create_namespaced_service_account_token(account, ns, {"spec": spec})
    return str(out.status.token)


def _harness_token(ns: str) -> str:
    """A service account bound to the chart's turn-client role in the namespace."""
    token = _token(ns, HARNESS)
    client.RbacAuthorizationV1Api().create_namespaced_role_binding(ns, {
        "metadata": {"name": HARNESS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": f"{RELEASE}-turn-client"},
        "subjects": [{"kind": "ServiceAccount", "name": HARNESS, "namespace": ns}]})
    return token


def _idle_spec(image: str) -> dict[str, Any]:
    """An agent that sleeps between turns; the turns are kubectl execs."""
    return {"podTemplate": {"spec": {"containers": [{
                "name": "agent", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sleep", "1000000"]}]}},
            "checkpoint": {"onTurn": True}}


def _running(ns: str, name: str, *, restores: int = 0, avoid: str = "") -> tuple[str, str]:
    """(node, pod) once the sandbox is Running with ``restores`` restores off ``avoid``
    (the idle agent prints no ticks for sandboxes.wait_running to count)."""
    def probe() -> tuple[str, str] | None:
        s = sb.status(ns, name)
        assert s.get("phase") != "Failed", f"sandbox {name} Failed: {s.get('conditions')}"
        if (s.get("phase") == "Running" and int(s.get("restores") or 0) >= restores
                and s.get("nodeName") and s.get("nodeName") != avoid):
            return str(s["nodeName"]), str(s["podName"])
        return None

    return wait_until(f"sandbox {name} Running (restores >= {restores})", 240, probe)


def _turn_checkpoints(ns: str, name: str) -> list[str]:
    return sorted(c["metadata"]["name"] for c in sb.checkpoints(ns)
                  if c["spec"]["sandboxRef"]["name"] == name)


def _refusals(turns: TurnClient, ns: str, name: str, stranger: str, api_only: str) -> None:
    url = turns.endpoint(ns, name)
    anonymous = requests.post(url, json={"turn": 0}, timeout=30)
    assert anonymous.status_code == 401, anonymous.text
    # A token the API server accepts (its own audience) is not one for the endpoint.
    api = requests.post(url, json={"turn": 0}, timeout=30,
                        headers={"Authorization": f"Bearer {api_only}"})
    assert api.status_code == 401 and TURN_AUDIENCE in api.json()["error"], api.text
    foreign = requests.post(url, json={"turn": 0}, timeout=30,
                            headers={"Authorization": f"Bearer {stranger}"})
    assert foreign.status_code == 403, foreign.text
    assert "may not create agentsandboxes/turns" in foreign.json()["error"]


def _drive(turns: TurnClient, ns: str, name: str, pod: str) -> list[TurnResult]:
    """Six turns: file writes, nothing, a read, a process started."""
    steps = [
        "echo one > /workspace/t1",                             # 1: first turn: full
        "",                                                     # 2: nothing: skip
        "cat /workspace/t1 >/dev/null",                         # 3: a read: skip
        # the writable layer: /tmp, the one directory of the image a non-root user (the
        # restricted pod policy's default, 65532) may write
        "echo four > /workspace/t4; echo note > /tmp/agent-note",  # 4: files-only
        "",                                                     # 5: skip
        "echo six > /workspace/t6; setsid sleep 4242 </dev/null >/dev/null 2>&1 &",  # 6: full
    ]
    results = []
    for number, script in enumerate(steps, start=1):
        if script:
            _exec(ns, pod, script)
        result = turns.turn_ended(ns, name, number, wait_seconds=120)
        print(f"turn {number}: {result.decision} -> {result.checkpoint} ({result.phase}); "
              f"{'; '.join(result.reasons)}")
        results.append(result)
    again = turns.turn_ended(ns, name, 5)
    assert again.repeated and again.decision == results[4].decision
    return results


def test_turns_checkpoint_only_changes_and_a_loss_keeps_the_last_turn(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    sb.ensure_spot_nodes(kube, e2e_config, 2)
    name = f"turns-{uuid.uuid4().hex[:6]}"
    sb.create_sandbox(namespace, name, _idle_spec(e2e_config.sandbox_image))
    node, pod = _running(namespace, name)
    sb.wait_agent_ready(kube, hermit_release, node)
    turns = TurnClient(token=_harness_token(namespace), kube=KubeApi(client.ApiClient()))
    _refusals(turns, namespace, name, _token(namespace, STRANGER),
              _token(namespace, API_ONLY, audiences=[]))

    results = _drive(turns, namespace, name, pod)
    decisions = [r.decision for r in results]
    assert decisions == ["full", "skip", "skip", "files-only", "skip", "full"], decisions
    for r in results:
        if r.decision != protocol.TURN_SKIP:
            assert r.phase == protocol.COMPLETED, r
    made = {r.checkpoint for r in results if r.decision != protocol.TURN_SKIP}
    assert _turn_checkpoints(namespace, name) == sorted(made), "a skipped turn made a checkpoint"
    last = str(results[-1].checkpoint)

    lost_at = time.monotonic()
    kill = subprocess.run([str(REPO / "hack/cluster"), "preempt-node", node,
                           "--no-notice"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert kill.returncode == 0, kill.stdout + kill.stderr
    new_node, new_pod = _running(namespace, name, restores=1, avoid=node)
    restored = sb.status(namespace, name).get("restoredFrom") or {}
    assert restored.get("name") == last, f"expected a restore of {last}: {restored}"
    files = _exec(namespace, new_pod, "cat /workspace/t1 /workspace/t4 /workspace/t6 "
                                        "/tmp/agent-note")
    assert files.split() == ["one", "four", "six", "note"], files
    wait_until("the process turn 6 started, restored", 30,
               lambda: "sleep 4242" in _exec(namespace, new_pod, "ps -o args"))
    print(f"turns: {decisions}; checkpoints {sorted(made)}; node {node} lost without "
          f"notice, restored from {last} on {new_node} {sb.since(lost_at)} s later with "
          "every file and process of turn 6")
