"""Acceptance of the e2e cluster itself: nodes, local images, pod networking,
spot preemption with notice, and adding a node. Runs against any cluster in
KUBECONFIG whose nodes carry the capacity-type labels (docs/cluster.md)."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

import pytest

from . import sandboxes as sb
from .cluster import (
    IMDS_ANNOTATION,
    SPOT_LABEL,
    E2EConfig,
    Kube,
    is_ready,
    is_spot,
    labels_of,
    name_of,
    pod_manifest,
    ready_nodes,
    wait_pod_phase,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _spot_nodes(kube: Kube) -> list[str]:
    return sorted(name_of(n) for n in ready_nodes(kube) if is_spot(n))


def test_all_nodes_ready_with_capacity_labels(kube: Kube) -> None:
    """Spot nodes carry one provider's spot label or more (hack/cluster: one each, in
    turn); on-demand nodes none, and Karpenter's on-demand value."""
    nodes = kube.nodes()
    not_ready = [name_of(n) for n in nodes if not is_ready(n)]
    assert not not_ready, f"nodes not Ready: {not_ready}"
    spot = [name_of(n) for n in nodes if is_spot(n)]
    on_demand = [name_of(n) for n in nodes if not is_spot(n)]
    assert len(spot) >= 2, f"need two spot nodes: {spot}"
    assert on_demand, "need an on-demand node"
    for node in nodes:
        if not is_spot(node):
            assert labels_of(node).get(SPOT_LABEL) == "on-demand", name_of(node)


def test_pod_from_local_image_runs_on_each_node(
    kube: Kube, namespace: str, e2e_config: E2EConfig
) -> None:
    nodes = [name_of(n) for n in ready_nodes(kube)]
    for node in nodes:
        cmd = ["sh", "-c", f"echo hello-from-{node}"]
        kube.create_pod(
            namespace, pod_manifest(f"hello-{node}", node, e2e_config.sandbox_image, cmd)
        )
    for node in nodes:
        wait_pod_phase(kube, namespace, f"hello-{node}", {"Succeeded"})
        assert kube.pod_log(namespace, f"hello-{node}").strip() == f"hello-from-{node}"


def test_pods_on_two_nodes_reach_each_other_and_the_apiserver(
    kube: Kube, namespace: str, e2e_config: E2EConfig
) -> None:
    nodes = [name_of(n) for n in ready_nodes(kube)]
    assert len(nodes) >= 2, f"need two Ready nodes, have {nodes}"
    token = uuid.uuid4().hex
    server_cmd = [
        "sh",
        "-c",
        f"mkdir -p /www && echo {token} > /www/index.html && exec httpd -f -p 8080 -h /www",
    ]
    image = e2e_config.sandbox_image
    kube.create_pod(namespace, pod_manifest("server", nodes[0], image, server_cmd))
    ip = wait_pod_phase(kube, namespace, "server", {"Running"})["status"]["podIP"]
    client_cmd = [
        "sh",
        "-c",
        # pod -> pod on another node, then pod -> kube-apiserver through the kubernetes Service
        # (busybox 1.35 wget -T segfaults: bound it with timeout instead)
        f"for i in $(seq 30); do timeout 3 wget -q -O - http://{ip}:8080/ && break; sleep 1; done;"
        ' nc -w 3 "$KUBERNETES_SERVICE_HOST" "$KUBERNETES_SERVICE_PORT" </dev/null'
        " && echo apiserver-ok",
    ]
    kube.create_pod(namespace, pod_manifest("client", nodes[1], image, client_cmd))
    wait_pod_phase(kube, namespace, "client", {"Succeeded"})
    log = kube.pod_log(namespace, "client").split()
    assert token in log, f"{nodes[1]} could not fetch from {ip} on {nodes[0]}: {log}"
    assert "apiserver-ok" in log, f"no connection to the kubernetes Service: {log}"


def _instance_action(url: str) -> dict[str, str] | None:
    try:
        with urllib.request.urlopen(f"{url}/latest/meta-data/spot/instance-action", timeout=3) as r:
            data: dict[str, str] = json.loads(r.read())
            return data
    except (OSError, ValueError):
        return None


def test_preempt_spot_node_with_notice(kube: Kube, namespace: str, e2e_config: E2EConfig) -> None:
    spot = _spot_nodes(kube)
    assert spot, "no Ready spot node"
    victim = spot[-1]
    node = kube.node(victim) or {}
    imds = (node["metadata"].get("annotations") or {}).get(IMDS_ANNOTATION)
    assert imds, f"node {victim} has no {IMDS_ANNOTATION} annotation"
    assert _instance_action(imds) is None, "spot notice served before preemption"
    image = e2e_config.sandbox_image
    kube.create_pod(namespace, pod_manifest("victim", victim, image, ["sleep", "3600"]))
    wait_pod_phase(kube, namespace, "victim", {"Running"})

    notice = 30
    start = time.monotonic()
    with sb.preempting(e2e_config, victim, notice, grace=120):
        action = wait_until(f"the spot notice on {imds}", 30, lambda: _instance_action(imds), 0.5)
        assert action["action"] == "terminate", action
        assert kube.node(victim) is not None, "node went away at the notice"
        wait_until(f"node {victim} deleted", notice + 90, lambda: kube.node(victim) is None)
        assert time.monotonic() - start >= notice - 1, "node went away before its notice expired"
        wait_until("pod victim gone", 90, lambda: kube.pod(namespace, "victim") is None)
        assert _instance_action(imds) is None, "metadata endpoint outlived its instance"


def test_add_node_brings_a_ready_spot_node(
    kube: Kube, namespace: str, e2e_config: E2EConfig
) -> None:
    before = {name_of(n) for n in kube.nodes()}
    sb.add_spot_node(e2e_config)

    def new_spot() -> str | None:
        fresh = [n for n in _spot_nodes(kube) if n not in before]
        return fresh[0] if fresh else None

    name = wait_until("a new Ready spot node", 180, new_spot)
    image = e2e_config.sandbox_image
    kube.create_pod(namespace, pod_manifest("fresh", name, image, ["sh", "-c", "echo fresh"]))
    wait_pod_phase(kube, namespace, "fresh", {"Succeeded"})
