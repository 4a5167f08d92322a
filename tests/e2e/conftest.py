"""Fixtures for end-to-end tests against any Kubernetes cluster named by KUBECONFIG.

Nothing here knows how the cluster was made (hack/cluster, kind, a cloud): the
cluster is found through KUBECONFIG only. Cluster-specific actions that have no
Kubernetes API (preempting a spot node, adding one) are commands given in
environment variables; defaults drive hack/cluster. See docs/cluster.md.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")

SPOT_LABEL = "karpenter.sh/capacity-type"
IMDS_ANNOTATION = "hermit.dev/imds-url"


@dataclass(frozen=True)
class E2EConfig:
    kubeconfig: str
    sandbox_image: str
    preempt_cmd: str
    add_node_cmd: str


def _e2e_config() -> E2EConfig:
    env = os.environ
    return E2EConfig(
        kubeconfig=env.get("KUBECONFIG", ""),
        sandbox_image=env.get("HERMIT_E2E_SANDBOX_IMAGE", "hermit.local/sandbox:v1"),
        preempt_cmd=env.get(
            "HERMIT_E2E_PREEMPT_CMD",
            f"{REPO}/hack/cluster preempt-node {{node}} --notice {{notice}}",
        ),
        add_node_cmd=env.get("HERMIT_E2E_ADD_NODE_CMD", f"{REPO}/hack/cluster add-node --spot"),
    )


def wait_until(what: str, timeout: float, probe: Callable[[], T | None], every: float = 1.0) -> T:
    """Polls probe until it returns something other than None/False; fails at the deadline."""
    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            result = probe()
            if result is not None and result is not False:
                return result
        except ApiException as exc:
            last_error = f" (last error: {exc.status} {exc.reason})"
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}{last_error}")
        time.sleep(every)


@pytest.fixture(scope="session")
def e2e_config() -> E2EConfig:
    return _e2e_config()


@pytest.fixture(scope="session")
def core(e2e_config: E2EConfig) -> client.CoreV1Api:
    """CoreV1Api of the cluster in KUBECONFIG; fails (never skips) when there is none."""
    hint = "no cluster: run hack/cluster up and export KUBECONFIG=$(hack/cluster kubeconfig)"
    if not e2e_config.kubeconfig:
        pytest.fail(f"{hint} (KUBECONFIG is not set)")
    try:
        config.load_kube_config(config_file=e2e_config.kubeconfig)
        api = client.CoreV1Api()
        api.list_namespace(limit=1, _request_timeout=10)
    except Exception as exc:
        pytest.fail(f"{hint} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
    return api


@pytest.fixture
def namespace(core: client.CoreV1Api, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    base = request.node.name.lower().replace("_", "-")[:40].strip("-")
    name = f"e2e-{base}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_until(
        f"default service account in {name}",
        60,
        lambda: core.read_namespaced_service_account("default", name),
    )
    yield name
    core.delete_namespace(name, grace_period_seconds=0)


def ready_nodes(core: client.CoreV1Api) -> list[client.V1Node]:
    out = []
    for node in core.list_node().items:
        for cond in node.status.conditions or []:
            if cond.type == "Ready" and cond.status == "True" and not node.spec.unschedulable:
                out.append(node)
    return out


def pod_manifest(name: str, node: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": node,
            "restartPolicy": spec.pop("restartPolicy", "Never"),
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": image, "imagePullPolicy": "IfNotPresent", "command": command}
            ],
            **spec,
        },
    }


def wait_pod_phase(
    core: client.CoreV1Api, ns: str, name: str, phases: set[str], timeout: float = 120
) -> client.V1Pod:
    def probe() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, ns)
        if pod.status.phase in phases:
            return pod
        if pod.status.phase == "Failed" and "Failed" not in phases:
            pytest.fail(f"pod {ns}/{name} failed: {pod.status.message or pod.status.reason}")
        return None

    return wait_until(f"pod {ns}/{name} in {sorted(phases)}", timeout, probe)


def run_cluster_command(template: str, **fields: str) -> subprocess.Popen[str]:
    """Starts a cluster-specific command (preempt, add-node) given as a template."""
    argv = shlex.split(template.format(**fields))
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
