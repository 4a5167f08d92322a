"""Spot placement on a real cluster: the spot affinity matches each provider's label, and a
sandbox no spot node can take falls back to an on-demand node, then returns to spot.

The cluster is shared with other tests: what a test changes on nodes (labels, cordons) it
puts back in a ``finally``. See docs/placement.md.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import pytest
from kubernetes import client

from hermit_common import api, protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    SPOT_NODE_LABELS,
    E2EConfig,
    Kube,
    is_spot,
    labels_of,
    name_of,
    ready_nodes,
    spot_conventions,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

Obj = dict[str, Any]

NOTICE_SECONDS = 20
FALLBACK_SECONDS = 20
SPOT_KEYS = [key for key, _ in SPOT_NODE_LABELS.values()]


def _label(kube: Kube, node: str, labels: dict[str, str | None]) -> None:
    """Set (or, with None, remove) these labels of the node."""
    body: Any = {"metadata": {"labels": labels}}
    kube.api.patch_node(node, body)


def _ready(ns: str, name: str) -> Obj:
    for c in sb.status(ns, name).get("conditions") or []:
        if c["type"] == api.COND_READY:
            return dict(c)
    return {}


def _sleeper(image: str, node: str) -> Obj:
    """A sandbox pinned to ``node`` (placement.nodeSelector is ANDed with the spot
    affinity): it schedules only while that node is labelled spot."""
    container = {"name": "agent", "image": image, "imagePullPolicy": "IfNotPresent",
                 "command": ["sleep", "3600"]}
    return {"podTemplate": {"spec": {"containers": [container]}},
            "placement": {"nodeSelector": {"kubernetes.io/hostname": node}}}


def _placed_on(ns: str, name: str, node: str) -> Obj | None:
    s = sb.status(ns, name)
    return s if s.get("phase") == "Running" and s.get("nodeName") == node else None


def test_the_spot_affinity_matches_each_providers_label(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    """One node, relabelled in turn: as an on-demand node it takes no sandbox (Ready says
    WaitingForSpotCapacity), and with any one provider's spot label it does."""
    sb.ensure_spot_nodes(kube, e2e_config, 1)
    node = sb.ready_spot_nodes(kube)[0]
    saved: dict[str, str | None] = {k: labels_of(kube.node(node) or {}).get(k)
                                    for k in SPOT_KEYS}
    only = {k: None for k in SPOT_KEYS}
    try:
        _label(kube, node, {**only, "karpenter.sh/capacity-type": "on-demand"})
        waiting = "pinned-waits"
        sb.create_sandbox(namespace, waiting, _sleeper(e2e_config.sandbox_image, node))
        ready = wait_until("Ready=False WaitingForSpotCapacity", 60, lambda: (
            c := _ready(namespace, waiting)).get("reason") == api.REASON_WAITING_FOR_SPOT and c)
        assert "fallbackToOnDemandAfterSeconds is not set" in ready["message"], ready
        print(f"on-demand {node}: {ready['message']}")
        for convention, (key, value) in SPOT_NODE_LABELS.items():
            _label(kube, node, {**only, key: value})
            name = waiting if convention == "karpenter" else f"pinned-{convention}"
            if name != waiting:
                sb.create_sandbox(namespace, name, _sleeper(e2e_config.sandbox_image, node))
            started = time.monotonic()
            s = wait_until(f"{name} Running on {node} labelled {key}={value}", 120,
                           partial(_placed_on, namespace, name, node))
            assert s.get("capacity") == api.CAPACITY_SPOT, s
            pod = kube.pod(namespace, s["podName"]) or {}
            assert labels_of(pod).get(protocol.LABEL_CAPACITY) == api.CAPACITY_SPOT
            print(f"{convention} ({key}={value}): {name} Running on {node} in "
                  f"{sb.since(started)} s")
    finally:
        _label(kube, node, saved)


def _spot_node_added(kube: Kube, cfg: E2EConfig, exclude: set[str]) -> str:
    sb.add_spot_node(cfg)
    return wait_until("a new schedulable spot node", 120, lambda: next(
        (n for n in sb.ready_spot_nodes(kube) if n not in exclude), None))


def _suspend_and_resume(kube: Kube, ns: str, name: str, where: sb.Running) -> tuple[
        sb.Running, list[int]]:
    """Suspend (the pod is frozen from its Suspend checkpoint until it is durable, then
    released), resume, and check that the counter continues."""
    sb.patch_sandbox(ns, name, {"suspend": True})
    seen_last = [where.last_tick]

    def suspended() -> bool:
        seen_last.append(max([*sb.ticks(kube, ns, where.pod), seen_last[-1]]))
        return sb.status(ns, name).get("phase") == "Suspended"

    wait_until("sandbox Suspended", 120, suspended, 0.2)
    assert "capacity" not in sb.status(ns, name), "a suspended sandbox has no pod"
    sb.patch_sandbox(ns, name, {"suspend": False})
    resumed = sb.wait_running(kube, ns, name, restores=where.restores + 1, min_ticks=1)
    return resumed, sb.assert_continues(kube, ns, resumed.pod, seen_last[-1])


def _fall_back(kube: Kube, cfg: E2EConfig, ns: str, name: str, where: sb.Running,
               on_demand: list[str], t: dict[str, float]) -> sb.Running:
    """Preempt the only spot node: the replacement waits for spot, then restores the same
    checkpoint on an on-demand node with nothing lost."""
    started = time.monotonic()
    with sb.preempting(cfg, where.node, NOTICE_SECONDS):
        old = sb.LastTick(kube, ns, where.pod)
        ckpt = sb.durable_reading("a Completed Preemption checkpoint", NOTICE_SECONDS,
                                  sb.completed_checkpoint(ns, "Preemption", sandbox_name=name),
                                  [old])
        t["notice_to_durable_s"] = sb.since(started)
        last = old.final()
        ready = wait_until("Ready=False WaitingForSpotCapacity", 60, lambda: (
            c := _ready(ns, name)).get("reason") == api.REASON_WAITING_FOR_SPOT and c, 0.2)
        t["notice_to_waiting_s"] = sb.since(started)
        assert "moves to an on-demand node at" in ready["message"], ready
        print(f"waiting: {ready['message']}")
        after = sb.wait_running(kube, ns, name, restores=where.restores + 1, avoid=where.node,
                                timeout=FALLBACK_SECONDS + 180, min_ticks=1)
        t["notice_to_running_on_demand_s"] = sb.since(started)
        assert after.node in on_demand, f"{after.node} is not one of {on_demand}"
        s = sb.status(ns, name)
        assert s.get("capacity") == api.CAPACITY_ON_DEMAND, s
        assert (s.get("restoredFrom") or {}).get("name") == ckpt["metadata"]["name"], s
        pod = kube.pod(ns, after.pod) or {}
        assert labels_of(pod).get(protocol.LABEL_CAPACITY) == api.CAPACITY_ON_DEMAND
        annotations = pod["metadata"].get("annotations") or {}
        assert annotations.get(protocol.ANNOTATION_RESTORE_FROM) == ckpt["metadata"]["name"]
        fell = sb.wait_events(kube, ns, name, "an OnDemandFallback Event",
                              lambda e: e["reason"] == api.REASON_ON_DEMAND_FALLBACK)
        assert fell[0]["type"] == "Warning", sb.events(kube, ns, name)
        print(f"fallback: {fell[0]['message']}")
        seen = sb.assert_continues(kube, ns, after.pod, last, exact=True)
    return sb.Running(after.node, after.pod, after.restores, seen[-1])


def test_without_spare_spot_capacity_it_falls_back_to_on_demand_then_returns_to_spot(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    """The only spot node is preempted (the others are cordoned): the replacement pod waits
    fallbackToOnDemandAfterSeconds, then restores on an on-demand node. A spot node is
    added; a suspend and resume brings the sandbox back to spot. Nothing is lost."""
    on_demand = [name_of(n) for n in ready_nodes(kube) if not is_spot(n)]
    assert on_demand, "need a schedulable on-demand node"
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace,
                                   placement={"fallbackToOnDemandAfterSeconds": FALLBACK_SECONDS})
    assert sb.status(namespace, name).get("capacity") == api.CAPACITY_SPOT
    cordoned = [n for n in sb.ready_spot_nodes(kube) if n != where.node]
    t: dict[str, float] = {}
    try:
        for node in cordoned:
            sb.set_unschedulable(kube, node, True)
        print(f"sandbox {name} on {where.node} ({spot_conventions(kube.node(where.node) or {})})"
              f"; cordoned spot nodes {cordoned}; on-demand nodes {on_demand}")
        where = _fall_back(kube, e2e_config, namespace, name, where, on_demand, t)
        print("timeline: " + ", ".join(f"{k} {v}" for k, v in t.items()))
        started = time.monotonic()
        spot = _spot_node_added(kube, e2e_config, set(cordoned))
        t["spot_node_added_s"] = sb.since(started)
        sb.wait_agent_ready(kube, hermit_release, spot)
        resumed, seen = _suspend_and_resume(kube, namespace, name, where)
        t["add_to_resumed_on_spot_s"] = sb.since(started)
        assert resumed.node == spot, f"resumed on {resumed.node}, not on the new spot node {spot}"
        assert sb.status(namespace, name).get("capacity") == api.CAPACITY_SPOT
        print(f"spot node {spot} ({spot_conventions(kube.node(spot) or {})}) added; resumed "
              f"on it at tick {seen[0]}")
        print(f"spot node added in {t['spot_node_added_s']} s; resumed on it "
              f"{t['add_to_resumed_on_spot_s']} s after the add began")
    finally:
        for node in cordoned:
            if kube.node(node) is not None:
                sb.set_unschedulable(kube, node, False)



# -- only nodes with a ready node-agent (docs/real-clusters.md#which-nodes) ---------------

# A label the node-agent DaemonSet's default affinity excludes (a virtual node): putting it
# on a node takes its node-agent away through the chart's own rule, with the API alone.
VIRTUAL = ("type", "virtual-kubelet")


def _agent_labelled(kube: Kube, node: str) -> bool:
    return labels_of(kube.node(node) or {}).get(
        protocol.LABEL_NODE_AGENT) == protocol.NODE_AGENT_READY


def _sandbox_pod(kube: Kube, ns: str, name: str) -> Obj | None:
    items: list[Obj] = Kube._json(kube.api.list_namespaced_pod(
        ns, label_selector=f"{protocol.LABEL_SANDBOX}={name}", _preload_content=False))["items"]
    return items[0] if items else None


def _unschedulable(pod: Obj | None) -> Obj | None:
    """The pod's PodScheduled=False (Unschedulable) condition: the scheduler tried it on
    every node and none fits."""
    for c in ((pod or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == "PodScheduled" and c["status"] == "False" \
                and c.get("reason") == "Unschedulable":
            return dict(c)
    return None


def _no_agent(kube: Kube, release_ns: str, node: str) -> bool:
    pods = kube.api.list_namespaced_pod(
        release_ns, field_selector=f"spec.nodeName={node}",
        label_selector="app.kubernetes.io/component=node-agent")
    return not pods.items


def test_a_sandbox_never_lands_on_a_node_without_a_ready_node_agent(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    """The DaemonSet requires Linux amd64 (not virtual) nodes; every node with a ready
    node-agent is labelled hermit.dev/node-agent=ready. A spot node whose node-agent is
    taken away (labelled as a virtual node) and whose label is removed gets no sandbox:
    one pinned to it stays unschedulable. With the node-agent back, the label returns and
    that sandbox runs there."""
    apps = client.AppsV1Api(kube.api.api_client)
    [ds] = [d for d in Kube._json(apps.list_namespaced_daemon_set(
        hermit_release, _preload_content=False))["items"]
        if d["metadata"]["name"].endswith("node-agent")]
    [term] = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    required = {e["key"]: (e["operator"], e["values"]) for e in term["matchExpressions"]}
    assert required["kubernetes.io/os"] == ("In", ["linux"])
    assert required["kubernetes.io/arch"] == ("In", ["amd64"])
    assert required[VIRTUAL[0]] == ("NotIn", [VIRTUAL[1]])

    sb.ensure_spot_nodes(kube, e2e_config, 1)
    nodes = [name_of(n) for n in ready_nodes(kube)]
    for node in nodes:  # each node-agent labels its node once it is ready
        sb.wait_agent_ready(kube, hermit_release, node)
        wait_until(f"{node} labelled {protocol.LABEL_NODE_AGENT}=ready", 60,
                   partial(_agent_labelled, kube, node))
    node = sb.ready_spot_nodes(kube)[-1]
    saved = labels_of(kube.node(node) or {}).get(VIRTUAL[0])
    name = "pinned-no-agent"
    try:
        _label(kube, node, {VIRTUAL[0]: VIRTUAL[1]})
        wait_until(f"no node-agent pod on {node}", 120,
                   partial(_no_agent, kube, hermit_release, node))
        _label(kube, node, {protocol.LABEL_NODE_AGENT: None})
        assert not _agent_labelled(kube, node)
        sb.create_sandbox(namespace, name, _sleeper(e2e_config.sandbox_image, node))
        refused = wait_until(f"{name}'s pod unschedulable", 120, lambda: _unschedulable(
            _sandbox_pod(kube, namespace, name)))
        pod = _sandbox_pod(kube, namespace, name) or {}
        assert not pod["spec"].get("nodeName"), pod["spec"].get("nodeName")
        terms = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        ready = {"key": protocol.LABEL_NODE_AGENT, "operator": "In",
                 "values": [protocol.NODE_AGENT_READY]}
        assert terms and all(ready in t["matchExpressions"] for t in terms), terms
        print(f"{node} without a node-agent or its label: {name}'s pod unschedulable: "
              f"{refused.get('message')}")
        assert not _agent_labelled(kube, node)  # nothing put it back meanwhile
        assert _no_agent(kube, hermit_release, node)
    finally:
        _label(kube, node, {VIRTUAL[0]: saved})
    sb.wait_agent_ready(kube, hermit_release, node)
    wait_until(f"{node} labelled again by its node-agent", 60,
               partial(_agent_labelled, kube, node))
    s = wait_until(f"{name} Running on {node}", 120, partial(_placed_on, namespace, name, node))
    print(f"node-agent back on {node}: labelled again, {name} Running there ({s['podName']})")
