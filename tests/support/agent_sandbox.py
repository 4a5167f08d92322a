"""The Kubernetes SIG's agent-sandbox controller (hack/install-agent-sandbox) against the
throwaway control plane (tests/support/controlplane.py): its CRDs applied with kubectl as
`hack/cluster agent-sandbox` applies them, the controller started with the same flags, a
namespace with its default ServiceAccount (no controller-manager runs to make it)."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from hermit_testbed.controlplane import ControlPlane, Processes
from hermit_testbed.minio import free_port
from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
BINARY = CACHE / "bin" / "agent-sandbox-controller"
GROUP, VERSION, PLURAL = "agents.x-k8s.io", "v1beta1", "sandboxes"
Obj = dict[str, Any]


@dataclass
class Sig:
    core: client.CoreV1Api
    custom: Any
    api_client: client.ApiClient
    log: Path
    namespace: str


def kubectl(plane: ControlPlane, *args: str) -> str:
    binary = CACHE / "bin" / "kubectl"
    if not binary.exists():
        pytest.fail(f"{binary} not found: run hack/install-k8s", pytrace=False)
    proc = subprocess.run([str(binary), "--kubeconfig", str(plane.kubeconfig), *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def _probe_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def configuration(plane: ControlPlane) -> client.Configuration:
    from hermit_common.kubeclient import load_configuration

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(plane.kubeconfig))
        return load_configuration()


@contextmanager
def sig_controller(plane: ControlPlane, workdir: Path, namespace: str) -> Iterator[Sig]:
    """The controller running against ``plane`` (its CRDs applied, ``namespace`` made)."""
    if not BINARY.exists():
        pytest.fail(f"{BINARY} not found: run hack/install-agent-sandbox (hack/bootstrap "
                    "builds it)", pytrace=False)
    # The CRDs of the pinned version (a warm run of the script only prints their place).
    crds = subprocess.run([str(REPO / "hack/install-agent-sandbox"), "crds"],
                          capture_output=True, text=True, timeout=60, check=True
                          ).stdout.strip()
    kubectl(plane, "apply", "--server-side", "-f", crds)
    kubectl(plane, "wait", "--for", "condition=Established", "--timeout", "60s", "-f", crds)
    procs = Processes(workdir)
    probe = free_port()
    # hack/cluster.d/agent-sandbox.sh's flags, on free ports.
    procs.start("agent-sandbox-controller", [
        str(BINARY), "--kubeconfig", str(plane.kubeconfig),
        "--leader-elect=false", "--extensions=true",
        "--metrics-bind-address", f"127.0.0.1:{free_port()}",
        "--health-probe-bind-address", f"127.0.0.1:{probe}"])
    log = procs.dir / "agent-sandbox-controller.log"
    try:
        def up() -> bool:
            procs.check()
            return _probe_ok(f"http://127.0.0.1:{probe}/readyz")

        wait_until("agent-sandbox-controller /readyz", 60, up, 0.2)
        api_client = client.ApiClient(configuration(plane))
        core = client.CoreV1Api(api_client)
        core.create_namespace({"metadata": {"name": namespace}})
        # No controller-manager runs: the pods' ServiceAccount is made here.
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
        yield Sig(core, client.CustomObjectsApi(api_client), api_client, log, namespace)
    finally:
        procs.stop()


def owned_pods(sig: Sig, uid: str) -> list[Obj]:
    pods: list[Obj] = json.loads(
        sig.core.list_namespaced_pod(sig.namespace, _preload_content=False).data)["items"]
    return [p for p in pods
            if any(ref.get("controller") and ref.get("uid") == uid
                   for ref in p["metadata"].get("ownerReferences") or [])]


def condition(sig: Sig, name: str, kind: str) -> Obj | None:
    obj: Any = sig.custom.get_namespaced_custom_object(GROUP, VERSION, sig.namespace, PLURAL,
                                                       name)
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            found: Obj = cond
            return found
    return None
