"""Hermit end to end: helm-installed operator and node-agents move a sandbox off a
spot node that gets an interruption notice, and its processes carry on elsewhere.

Needs a cluster in KUBECONFIG whose nodes have the Hermit images, an S3 endpoint the
pods can reach (HERMIT_E2E_S3_ENDPOINT/_ACCESS_KEY/_SECRET_KEY; on the local cluster
of hack/cluster a MinIO is started on its host bridge), and the preempt command of
conftest.py.
"""

from __future__ import annotations

import base64
import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from hermit_common import api
from hermit_testbed.errors import TestbedError
from hermit_testbed.minio import start_minio, stop_minio
from tests.e2e.conftest import (
    REPO,
    SPOT_LABEL,
    E2EConfig,
    Kube,
    is_ready,
    labels_of,
    name_of,
    run_cluster_command,
    wait_until,
)

pytestmark = pytest.mark.e2e

RELEASE = "hermit-e2e"
RELEASE_NS = "hermit-e2e"
BUCKET = "hermit-e2e"
LOCAL_CLUSTER_HOST = "10.213.0.1"  # hack/cluster's host bridge: pods reach it
COUNTER = (
    'i=0; while true; do i=$((i+1)); echo "tick $i"; echo $i > /workspace/count; '
    "sleep 0.2; done"
)


@dataclass(frozen=True)
class S3:
    endpoint: str
    access_key: str
    secret_key: str


@pytest.fixture(scope="module")
def s3_for_pods() -> Iterator[S3]:
    env = os.environ
    if env.get("HERMIT_E2E_S3_ENDPOINT"):
        yield S3(env["HERMIT_E2E_S3_ENDPOINT"], env.get("HERMIT_E2E_S3_ACCESS_KEY", ""),
                 env.get("HERMIT_E2E_S3_SECRET_KEY", ""))
        return
    with tempfile.TemporaryDirectory(prefix="hermit-e2e-minio-") as work:
        try:
            server = start_minio(Path(work), host=LOCAL_CLUSTER_HOST)
        except (TestbedError, OSError) as exc:
            pytest.fail(f"no S3 for the cluster: set HERMIT_E2E_S3_ENDPOINT, or run "
                        f"hack/cluster up so MinIO can listen on {LOCAL_CLUSTER_HOST} ({exc})")
        server.settings(BUCKET)
        from hermit_common.store import CheckpointStore

        CheckpointStore(server.settings(BUCKET)).ensure_bucket()
        try:
            yield S3(server.endpoint, server.access_key, server.secret_key)
        finally:
            stop_minio(server)


def _helm() -> str:
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
    helm = cache / "bin" / "helm"
    if not helm.exists():
        pytest.fail("helm not found: run hack/install-helm")
    return str(helm)


@pytest.fixture(scope="module")
def hermit_release(kube: Kube, s3_for_pods: S3, e2e_config: E2EConfig) -> Iterator[str]:
    """The chart installed with S3 credentials in a Secret; removed afterwards."""
    helm = _helm()
    env = {**os.environ, "KUBECONFIG": e2e_config.kubeconfig}
    subprocess.run([helm, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait"], env=env,
                   capture_output=True, check=False)
    try:
        kube.api.create_namespace({"metadata": {"name": RELEASE_NS}})
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
    secret = {"metadata": {"name": "hermit-s3"}, "data": {
        "AWS_ACCESS_KEY_ID": base64.b64encode(s3_for_pods.access_key.encode()).decode(),
        "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3_for_pods.secret_key.encode()).decode()}}
    try:
        kube.api.create_namespaced_secret(RELEASE_NS, secret)
    except client.exceptions.ApiException as exc:
        if exc.status != 409:
            raise
        kube.api.replace_namespaced_secret("hermit-s3", RELEASE_NS, secret)
    proc = subprocess.run(
        [helm, "install", RELEASE, str(REPO / "charts/hermit"), "-n", RELEASE_NS,
         "--set", f"s3.bucket={BUCKET}", "--set", f"s3.endpoint={s3_for_pods.endpoint}",
         "--set", "s3.existingSecret=hermit-s3", "--set", "nodeAgent.logLevel=DEBUG",
         "--wait", "--timeout", "180s"],
        env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"helm install failed: {proc.stdout}{proc.stderr}"
    try:
        yield RELEASE_NS
    finally:
        subprocess.run([helm, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait"], env=env,
                       capture_output=True, check=False)


def _custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi()


def _sandbox(ns: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = _custom().get_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.SANDBOX_PLURAL, name)
    return obj


def _checkpoints(ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = _custom().list_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL)["items"]
    return items


def _ticks(kube: Kube, ns: str, pod: str) -> list[int]:
    try:
        log = kube.pod_log(ns, pod)
    except client.exceptions.ApiException:
        return []
    return [int(line.split()[1]) for line in log.splitlines() if line.startswith("tick ")]


def _ready_spot_nodes(kube: Kube) -> list[str]:
    return sorted(name_of(n) for n in kube.nodes()
                  if is_ready(n) and labels_of(n).get(SPOT_LABEL) == "spot"
                  and not n["spec"].get("unschedulable"))


def test_sandbox_moves_off_a_preempted_spot_node_and_keeps_its_memory(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    if len(_ready_spot_nodes(kube)) < 2:
        added = run_cluster_command(e2e_config.add_node_cmd)
        out, _ = added.communicate(timeout=300)
        assert added.returncode == 0, f"add-node failed: {out}"
        wait_until("two Ready spot nodes", 120, lambda: len(_ready_spot_nodes(kube)) >= 2)
    name = f"agent-{uuid.uuid4().hex[:6]}"
    _custom().create_namespaced_custom_object(api.GROUP, api.VERSION, namespace,
                                              api.SANDBOX_PLURAL, {
        "apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND,
        "metadata": {"name": name},
        "spec": {"podTemplate": {"spec": {"containers": [{
            "name": "agent", "image": e2e_config.sandbox_image,
            "imagePullPolicy": "IfNotPresent", "command": ["/bin/sh", "-c", COUNTER]}]}}},
    })

    def running() -> dict[str, Any] | None:
        status = _sandbox(namespace, name).get("status", {})
        return status if status.get("phase") == "Running" and status.get("nodeName") else None

    first = wait_until(f"sandbox {name} Running", 180, running)
    old_node, old_pod = first["nodeName"], first["podName"]
    assert old_node in _ready_spot_nodes(kube), f"{old_node} is not a spot node"
    wait_until("20 ticks", 60, lambda: len(_ticks(kube, namespace, old_pod)) >= 20)

    notice = 60
    preempt = run_cluster_command(e2e_config.preempt_cmd, node=old_node, notice=str(notice))
    try:
        def completed() -> dict[str, Any] | None:
            for c in _checkpoints(namespace):
                if c["spec"]["reason"] == "Preemption" and \
                        c.get("status", {}).get("phase") == "Completed":
                    return c
            failed = [c["status"].get("message") for c in _checkpoints(namespace)
                      if c.get("status", {}).get("phase") == "Failed"]
            assert not failed, f"checkpoint failed: {failed}"
            return None

        checkpoint = wait_until("a Completed Preemption checkpoint", notice, completed, 0.5)
        status = checkpoint["status"]
        assert status["manifestDigest"].startswith("sha256:")
        assert status["nodeName"] == old_node
        last_before = _ticks(kube, namespace, old_pod)

        def restored() -> dict[str, Any] | None:
            s = _sandbox(namespace, name).get("status", {})
            if s.get("restores", 0) >= 1 and s.get("phase") == "Running" and \
                    s.get("nodeName") not in (None, old_node):
                return s
            return None

        after = wait_until(f"sandbox {name} restored on another node", 180, restored)
        new_pod = after["podName"]
        ticks = wait_until("ticks in the restored pod", 60,
                           lambda: (t := _ticks(kube, namespace, new_pod)) and len(t) >= 5 and t)
        # The shell's in-memory counter continued: the new pod's output starts where the
        # checkpoint was (not at 1) and counts on without a gap.
        assert ticks[0] > 20, f"counter restarted: {ticks[:5]}"
        assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), ticks[:20]
        if last_before:
            assert ticks[0] >= last_before[-1] - 1, (last_before[-3:], ticks[:3])
        print(f"checkpoint {checkpoint['metadata']['name']}: frozen {status.get('frozenMs')} ms,"
              f" dump {status.get('dumpMs')} ms, upload {status.get('uploadMs')} ms, "
              f"stored {status.get('storedBytes')} B; restored on {after['nodeName']} "
              f"continuing at tick {ticks[0]}")
    finally:
        out, _ = preempt.communicate(timeout=notice + 180)
    assert preempt.returncode == 0, f"preempt command failed: {out}"
