"""Acceptance of the e2e cluster itself: nodes, local images, pod networking,
spot preemption with notice, and adding a node. Runs against any cluster in
KUBECONFIG whose nodes carry the capacity-type labels (docs/cluster.md)."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest
from kubernetes import client, utils
from kubernetes.client.rest import ApiException

from .conftest import (
    IMDS_ANNOTATION,
    SPOT_LABEL,
    E2EConfig,
    pod_manifest,
    ready_nodes,
    run_cluster_command,
    wait_pod_phase,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _create(core: client.CoreV1Api, ns: str, manifest: dict[str, object]) -> None:
    utils.create_from_dict(core.api_client, manifest, namespace=ns)


def _spot_nodes(core: client.CoreV1Api) -> list[client.V1Node]:
    return [n for n in ready_nodes(core) if (n.metadata.labels or {}).get(SPOT_LABEL) == "spot"]


def test_all_nodes_ready_with_capacity_labels(core: client.CoreV1Api) -> None:
    nodes = core.list_node().items
    not_ready = [n.metadata.name for n in nodes if n not in ready_nodes(core)]
    names = {n.metadata.name for n in ready_nodes(core)}
    assert not not_ready, f"nodes not Ready: {not_ready}"
    capacity = {n.metadata.name: (n.metadata.labels or {}).get(SPOT_LABEL) for n in nodes}
    assert sum(v == "spot" for v in capacity.values()) >= 2, f"need two spot nodes: {capacity}"
    assert "on-demand" in capacity.values(), f"need an on-demand node: {capacity}"
    for node in nodes:
        labels = node.metadata.labels or {}
        if labels.get(SPOT_LABEL) == "spot":
            assert labels.get("eks.amazonaws.com/capacityType") == "SPOT", node.metadata.name
            assert labels.get("cloud.google.com/gke-spot") == "true", node.metadata.name
        else:
            assert labels.get("eks.amazonaws.com/capacityType") == "ON_DEMAND", node.metadata.name
    assert names


def test_pod_from_local_image_runs_on_each_node(
    core: client.CoreV1Api, namespace: str, e2e_config: E2EConfig
) -> None:
    nodes = [n.metadata.name for n in ready_nodes(core)]
    for node in nodes:
        cmd = ["sh", "-c", f"echo hello-from-{node}"]
        _create(core, namespace, pod_manifest(f"hello-{node}", node, e2e_config.sandbox_image, cmd))
    for node in nodes:
        wait_pod_phase(core, namespace, f"hello-{node}", {"Succeeded"})
        log = core.read_namespaced_pod_log(f"hello-{node}", namespace)
        assert log.strip() == f"hello-from-{node}"


def test_pods_on_two_nodes_reach_each_other_and_the_apiserver(
    core: client.CoreV1Api, namespace: str, e2e_config: E2EConfig
) -> None:
    nodes = [n.metadata.name for n in ready_nodes(core)]
    assert len(nodes) >= 2, f"need two Ready nodes, have {nodes}"
    token = uuid.uuid4().hex
    server_cmd = ["sh", "-c", f"mkdir -p /www && echo {token} > /www/index.html && exec httpd -f -p 8080 -h /www"]
    _create(core, namespace, pod_manifest("server", nodes[0], e2e_config.sandbox_image, server_cmd))
    server = wait_pod_phase(core, namespace, "server", {"Running"})
    ip = server.status.pod_ip
    client_cmd = [
        "sh",
        "-c",
        # pod -> pod on another node, then pod -> kube-apiserver through the kubernetes Service
        f"for i in $(seq 30); do wget -q -T 2 -O - http://{ip}:8080/ && break; sleep 1; done; "
        'nc -w 3 "$KUBERNETES_SERVICE_HOST" "$KUBERNETES_SERVICE_PORT" </dev/null && echo apiserver-ok',
    ]
    _create(core, namespace, pod_manifest("client", nodes[1], e2e_config.sandbox_image, client_cmd))
    wait_pod_phase(core, namespace, "client", {"Succeeded"})
    log = core.read_namespaced_pod_log("client", namespace).split()
    assert token in log, f"{nodes[1]} could not fetch from {ip} on {nodes[0]}: {log}"
    assert "apiserver-ok" in log, f"no connection to the kubernetes Service: {log}"


def _instance_action(url: str) -> dict[str, str] | None:
    try:
        with urllib.request.urlopen(f"{url}/latest/meta-data/spot/instance-action", timeout=3) as r:
            data: dict[str, str] = json.loads(r.read())
            return data
    except OSError:
        return None


def test_preempt_spot_node_with_notice(
    core: client.CoreV1Api, namespace: str, e2e_config: E2EConfig
) -> None:
    spot = sorted(n.metadata.name for n in _spot_nodes(core))
    assert spot, "no Ready spot node"
    victim = spot[-1]
    node = core.read_node(victim)
    imds = (node.metadata.annotations or {}).get(IMDS_ANNOTATION)
    assert imds, f"node {victim} has no {IMDS_ANNOTATION} annotation"
    assert _instance_action(imds) is None, "spot notice served before preemption"
    _create(
        core,
        namespace,
        pod_manifest("victim", victim, e2e_config.sandbox_image, ["sleep", "3600"]),
    )
    wait_pod_phase(core, namespace, "victim", {"Running"})

    notice = 30
    start = time.monotonic()
    proc = run_cluster_command(e2e_config.preempt_cmd, node=victim, notice=str(notice))
    try:
        action = wait_until("the spot notice on " + imds, 30, lambda: _instance_action(imds), 0.5)
        assert action["action"] == "terminate", action
        # the node lives through the notice window
        assert core.read_node(victim).metadata.name == victim
        wait_until(f"node {victim} deleted", notice + 90, lambda: _node_gone(core, victim))
        assert time.monotonic() - start >= notice - 1, "node went away before its notice expired"
        wait_until("pod victim gone", 90, lambda: _pod_gone(core, namespace, "victim"))
        assert _instance_action(imds) is None, "metadata endpoint outlived its instance"
    finally:
        out, _ = proc.communicate(timeout=notice + 120)
    assert proc.returncode == 0, f"preempt command failed: {out}"


def _node_gone(core: client.CoreV1Api, name: str) -> bool:
    try:
        core.read_node(name)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def _pod_gone(core: client.CoreV1Api, ns: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, ns)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def test_add_node_brings_a_ready_spot_node(
    core: client.CoreV1Api, namespace: str, e2e_config: E2EConfig
) -> None:
    before = {n.metadata.name for n in core.list_node().items}
    proc = run_cluster_command(e2e_config.add_node_cmd)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"add-node failed: {out}"

    def new_spot() -> str | None:
        fresh = [n.metadata.name for n in _spot_nodes(core) if n.metadata.name not in before]
        return fresh[0] if fresh else None

    name = wait_until("a new Ready spot node", 180, new_spot)
    _create(
        core,
        namespace,
        pod_manifest("fresh", name, e2e_config.sandbox_image, ["sh", "-c", "echo fresh"]),
    )
    wait_pod_phase(core, namespace, "fresh", {"Succeeded"})
