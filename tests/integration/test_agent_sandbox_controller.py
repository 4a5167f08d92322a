"""The Kubernetes SIG's agent-sandbox controller (hack/install-agent-sandbox) against a real
kube-apiserver (a throwaway control plane, no kubelet): its CRDs apply with kubectl as
`hack/cluster agent-sandbox` applies them, it starts with the same flags and logs the line
that command waits for, and it drives a Sandbox's pod: created, deleted on
``operatingMode: Suspended``, created anew on ``Running``. The e2e test
(tests/e2e/test_agent_sandbox.py) shows the pod running on real nodes."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from hermit_testbed.controlplane import Processes
from hermit_testbed.minio import free_port
from tests.support.controlplane import ControlPlane, control_plane
from tests.support.wait import wait_until

__all__ = ["control_plane"]

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
BINARY = CACHE / "bin" / "agent-sandbox-controller"
GROUP, VERSION, PLURAL = "agents.x-k8s.io", "v1beta1", "sandboxes"
NS = "sig"
Obj = dict[str, Any]


@dataclass
class Sig:
    core: client.CoreV1Api
    custom: Any
    log: Path


def _kubectl(plane: ControlPlane, *args: str) -> str:
    kubectl = CACHE / "bin" / "kubectl"
    if not kubectl.exists():
        pytest.fail(f"{kubectl} not found: run hack/install-k8s", pytrace=False)
    proc = subprocess.run([str(kubectl), "--kubeconfig", str(plane.kubeconfig), *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def _probe_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def sig(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Sig]:
    if not BINARY.exists():
        pytest.fail(f"{BINARY} not found: run hack/install-agent-sandbox (hack/bootstrap "
                    "builds it)", pytrace=False)
    # The CRDs of the pinned version (a warm run of the script only prints their place).
    crds = subprocess.run([str(REPO / "hack/install-agent-sandbox"), "crds"],
                          capture_output=True, text=True, timeout=60, check=True
                          ).stdout.strip()
    _kubectl(control_plane, "apply", "--server-side", "-f", crds)
    _kubectl(control_plane, "wait", "--for", "condition=Established", "--timeout", "60s",
             "-f", crds)
    procs = Processes(tmp_path_factory.mktemp("agent-sandbox"))
    probe = free_port()
    # hack/cluster.d/agent-sandbox.sh's flags, on free ports.
    procs.start("agent-sandbox-controller", [
        str(BINARY), "--kubeconfig", str(control_plane.kubeconfig),
        "--leader-elect=false", "--extensions=true",
        "--metrics-bind-address", f"127.0.0.1:{free_port()}",
        "--health-probe-bind-address", f"127.0.0.1:{probe}"])
    log = procs.dir / "agent-sandbox-controller.log"
    try:
        def up() -> bool:
            procs.check()
            return _probe_ok(f"http://127.0.0.1:{probe}/readyz")

        wait_until("agent-sandbox-controller /readyz", 60, up, 0.2)
        api_client = client.ApiClient(_configuration(control_plane))
        core = client.CoreV1Api(api_client)
        core.create_namespace({"metadata": {"name": NS}})
        # No controller-manager runs: the pods' ServiceAccount is made here.
        core.create_namespaced_service_account(NS, {"metadata": {"name": "default"}})
        yield Sig(core, client.CustomObjectsApi(api_client), log)
    finally:
        procs.stop()


def _configuration(plane: ControlPlane) -> client.Configuration:
    from hermit_common.kubeclient import load_configuration

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(plane.kubeconfig))
        return load_configuration()


def _owned_pods(sig: Sig, uid: str) -> list[Obj]:
    pods: list[Obj] = json.loads(
        sig.core.list_namespaced_pod(NS, _preload_content=False).data)["items"]
    return [p for p in pods
            if any(ref.get("controller") and ref.get("uid") == uid
                   for ref in p["metadata"].get("ownerReferences") or [])]


def _condition(sig: Sig, name: str, kind: str) -> Obj | None:
    obj: Any = sig.custom.get_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            found: Obj = cond
            return found
    return None


def test_the_controller_logs_what_hack_cluster_waits_for(sig: Sig) -> None:
    # hack/cluster.d/agent-sandbox.sh agent_sandbox_workers_started greps these.
    def started() -> bool:
        return any('"Starting workers"' in line and '"controller":"sandbox"' in line
                   for line in sig.log.read_text(errors="replace").splitlines())

    wait_until(f"the Sandbox controller's workers in {sig.log}", 60, started, 0.2)


def test_a_sandbox_pod_goes_on_suspend_and_a_new_one_comes_on_resume(sig: Sig) -> None:
    name = "smoke"
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Sandbox", "metadata": {"name": name},
            "spec": {"podTemplate": {"spec": {"containers": [
                {"name": "agent", "image": "hermit.local/sandbox:v1",
                 "command": ["sleep", "3600"]}]}}}}
    created: Any = sig.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)
    uid: str = created["metadata"]["uid"]
    assert created["spec"]["operatingMode"] == "Running", created["spec"]

    first = wait_until("the Sandbox's pod", 60, lambda: _owned_pods(sig, uid) or None, 0.2)
    assert [p["metadata"]["name"] for p in first] == [name]
    # No kubelet: the pod stays Pending and the Sandbox not Ready.
    ready = wait_until("a Ready condition", 30, lambda: _condition(sig, name, "Ready"), 0.2)
    assert ready["status"] == "False", ready

    sig.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name,
                                              {"spec": {"operatingMode": "Suspended"}})

    def suspended() -> bool:
        cond = _condition(sig, name, "Suspended")
        return not _owned_pods(sig, uid) and cond is not None and cond["status"] == "True"

    wait_until("the pod gone and Suspended=True", 60, suspended, 0.2)
    ready = _condition(sig, name, "Ready")
    assert ready is not None and ready["reason"] == "SandboxSuspended", ready

    sig.custom.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name,
                                              {"spec": {"operatingMode": "Running"}})
    second = wait_until("a new pod", 60, lambda: _owned_pods(sig, uid) or None, 0.2)
    assert len(second) == 1
    assert second[0]["metadata"]["uid"] != first[0]["metadata"]["uid"]
    # The controller writes the condition after it created the pod: waited for, not read
    # at once (a read right after the pod appeared still saw True).
    wait_until("Suspended=False", 30, lambda: (
        (cond := _condition(sig, name, "Suspended")) is not None and cond["status"] == "False"),
        0.2)
