"""The chart's probes, the node-agent's read-only root filesystem and the optional
NetworkPolicies, rendered with ``helm template`` (helm from PATH or ~/.cache/hermit/bin;
hack/install-helm builds it), and their values against the schema."""

from __future__ import annotations

from typing import Any

import pytest

from hermit_common.health import LIVENESS_PATH, READINESS_PATH
from tests.support.chart import WITH_BUCKET, errors, merged, render

Obj = dict[str, Any]


def workload(docs: list[Obj], kind: str) -> Obj:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def container(docs: list[Obj], kind: str) -> Obj:
    (c,) = workload(docs, kind)["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("kind", ["Deployment", "DaemonSet"])
@pytest.mark.parametrize("metrics", ["true", "false"])
def test_both_pods_probe_healthz_and_readyz_on_the_metrics_port(kind: str,
                                                                metrics: str) -> None:
    c = container(render(f"metrics.enabled={metrics}", "metrics.port=9200"), kind)
    # The node-agent also serves the turn endpoint on the node's IP (docs/turns.md), the
    # operator the key service (docs/security.md#the-key-service).
    turns = [{"name": "turns", "containerPort": 9103, "hostPort": 9103, "protocol": "TCP"}]
    keys = [{"name": "keys", "containerPort": 9443, "protocol": "TCP"}]
    assert c["ports"] == [{"name": "metrics", "containerPort": 9200, "protocol": "TCP"},
                          *(turns if kind == "DaemonSet" else keys)]
    live, ready = c["livenessProbe"], c["readinessProbe"]
    assert live["httpGet"] == {"path": LIVENESS_PATH, "port": "metrics"}
    assert ready["httpGet"] == {"path": READINESS_PATH, "port": "metrics"}
    # A failed liveness probe gives the container the pod's own grace period.
    assert "terminationGracePeriodSeconds" not in live
    for probe in (live, ready):
        assert probe["timeoutSeconds"] >= 5 and probe["failureThreshold"] >= 3


def test_probe_timings_come_from_the_values() -> None:
    c = container(render("nodeAgent.livenessProbe.periodSeconds=30",
                         "nodeAgent.livenessProbe.failureThreshold=5"), "DaemonSet")
    assert (c["livenessProbe"]["periodSeconds"], c["livenessProbe"]["failureThreshold"]) == (
        30, 5)
    assert c["livenessProbe"]["httpGet"]["path"] == LIVENESS_PATH


def test_the_node_agent_is_privileged_with_a_read_only_root_and_a_tmp_volume() -> None:
    docs = render()
    spec = workload(docs, "DaemonSet")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["securityContext"] == {"privileged": True, "readOnlyRootFilesystem": True}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    assert "ephemeral-storage" in c["resources"]["limits"]
    # The NetworkPolicy applies to it only because it keeps its own network namespace.
    assert spec["hostNetwork"] is False


def test_no_network_policy_by_default() -> None:
    assert [d for d in render() if d["kind"] == "NetworkPolicy"] == []


def policies(*sets: str) -> dict[str, Obj]:
    docs = render("networkPolicy.enabled=true", *sets)
    return {d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]
            for d in docs if d["kind"] == "NetworkPolicy"}


def egress_ports(spec: Obj) -> list[set[tuple[int | str, str]]]:
    return [{(p["port"], p["protocol"]) for p in rule["ports"]} for rule in spec["egress"]]


def test_network_policies_select_each_component_and_open_only_what_it_needs() -> None:
    specs = policies()
    assert sorted(specs) == ["ensure-secrets", "node-agent", "operator"]
    api = {(443, "TCP"), (6443, "TCP")}
    dns = {(53, "UDP"), (53, "TCP")}
    # The hook Job that makes the missing Secrets: the API server and DNS, nothing in.
    hook = specs.pop("ensure-secrets")
    assert hook["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == \
        "ensure-secrets"
    assert hook["ingress"] == [] and egress_ports(hook) == [api, dns]
    for component, spec in specs.items():
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        turns = [{"ports": [{"port": "turns", "protocol": "TCP"}]}]  # docs/turns.md
        # The key service, from node-agents only (docs/security.md#the-key-service).
        keys = [{"ports": [{"port": "keys", "protocol": "TCP"}], "from": [{"podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "hermit",
                            "app.kubernetes.io/instance": "hermit",
                            "app.kubernetes.io/component": "node-agent"}}}]}]
        assert spec["ingress"] == [{"ports": [{"port": "metrics", "protocol": "TCP"}]},
                                   *(turns if component == "node-agent" else keys)]
    # The operator reaches S3's port for STS only to vend scoped store credentials
    # (docs/storage.md#scoped-store-credentials); with the shared fallback it does not.
    assert egress_ports(specs["operator"]) == [api, dns, {(443, "TCP")}]
    assert egress_ports(policies("s3.sharedNodeCredentials=true")["operator"]) == [api, dns]
    assert egress_ports(specs["node-agent"]) == [api, dns, {(443, "TCP")}, {(80, "TCP")},
                                                 {(9443, "TCP")}]
    assert specs["node-agent"]["egress"][4]["to"][0]["podSelector"]["matchLabels"][
        "app.kubernetes.io/component"] == "operator"
    assert specs["node-agent"]["egress"][3]["to"] == [
        {"ipBlock": {"cidr": "169.254.169.254/32"}}]


@pytest.mark.parametrize(("endpoint", "port"), [
    ("http://minio.minio:9000", 9000),
    ("http://minio.minio", 80),
    ("https://s3.example.com:8443/", 8443),
    ("https://storage.googleapis.com", 443),
    ("http://[fd00::1]:9000", 9000),
])
def test_the_s3_egress_port_comes_from_the_endpoint(endpoint: str, port: int) -> None:
    spec = policies(f"s3.endpoint={endpoint}")["node-agent"]
    assert egress_ports(spec)[2] == {(port, "TCP")}


def test_network_policy_values_narrow_the_peers() -> None:
    specs = policies("cloudProvider=none", "networkPolicy.apiServerCidrs={10.0.0.1/32}",
                     "networkPolicy.s3Cidrs={52.216.0.0/15}",
                     "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=obs",
                     "networkPolicy.extraEgress[0].ports[0].port=8125")
    agent = specs["node-agent"]
    assert agent["egress"][0]["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert agent["egress"][2]["to"] == [{"ipBlock": {"cidr": "52.216.0.0/15"}}]
    # No metadata rule without a cloud (API, DNS, S3, the key service); the extra rule
    # last, in both policies.
    assert len(agent["egress"]) == 5
    for spec in specs.values():
        assert spec["egress"][-1] == {"ports": [{"port": 8125}]}
    for component in ("operator", "node-agent"):  # the hook Job accepts nothing
        assert specs[component]["ingress"][0]["from"] == [
            {"namespaceSelector": {"matchLabels": {"team": "obs"}}}]


@pytest.mark.parametrize(("override", "where"), [
    ({"operator": {"livenessProbe": {"exec": {"command": ["true"]}}}},
     "operator.livenessProbe"),
    ({"nodeAgent": {"readinessProbe": {"periodSeconds": -1}}},
     "nodeAgent.readinessProbe.periodSeconds"),
    ({"networkPolicy": {"enabled": "yes"}}, "networkPolicy.enabled"),
    ({"networkPolicy": {"apiServerPorts": []}}, "networkPolicy.apiServerPorts"),
    ({"networkPolicy": {"apiServerCidrs": ["10.0.0.1"]}}, "networkPolicy.apiServerCidrs.0"),
    ({"networkPolicy": {"dnsTo": [{"ports": []}]}}, "networkPolicy.dnsTo.0"),
    ({"networkPolicy": {"egress": []}}, "networkPolicy"),
])
def test_invalid_health_and_policy_values_are_rejected(override: Obj, where: str) -> None:
    problems = errors(merged(WITH_BUCKET, override))
    assert any(p.startswith(f"{where}:") for p in problems), problems
