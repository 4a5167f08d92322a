"""Upgrading Hermit from the previous release while a sandbox runs and moves (issue 21).

The e2e release is replaced by the previous release, as that release published it: its
chart and its images, built from its commit and pushed to the cluster's registry
(hack/previous-release), with the same values. A self-checking sandbox starts under it.
Then ``helm upgrade`` to this checkout's chart with ``nodeAgent.updateStrategy=OnDelete``:
the CRDs and the operator are upgraded at once, the node-agents one node at a time, by
the test, so old and new node-agents run side by side, as in any rolling upgrade:

1. the sandbox moves (a spot notice) from a node with an old node-agent to one with a new
   one: the previous release's checkpoint restores under this one;
2. it moves again, from the new node-agent, while the only other spot node still runs an
   old one. The new checkpoint's format level is one the old node-agent does not declare,
   so the replacement pod waits (Pending) instead of landing there, where a refusal would
   have made the operator fall back to an older checkpoint. Once that node's node-agent is
   upgraded, the newest checkpoint is restored there.

Both moves lose and duplicate nothing (the external tick ledger; the counter continues
exactly). Afterwards the release is put back as the e2e harness installs it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
import uuid
from typing import Any

import pytest
from kubernetes import client

from hermit_common import protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    RELEASE,
    RELEASE_NS,
    REPO,
    S3,
    E2EConfig,
    Kube,
    e2e_images,
    helm_binary,
    release_values,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

Obj = dict[str, Any]
NOTICE_SECONDS = 20
# How long the gated replacement must stay unbound while a schedulable spot node with an
# old node-agent is there: the scheduler binds a schedulable pod within a second or two.
GATED_FOR_SECONDS = 10


def _registry_prefix() -> str:
    """The registry the e2e release's images come from (HERMIT_E2E_HELM_SET), where the
    previous release's images are pushed too."""
    flags = e2e_images()
    for value in flags:
        if value.startswith("init.image.repository="):
            return value.split("=", 1)[1].rsplit("/", 1)[0]
    pytest.fail("the upgrade test installs the previous release from a registry: run "
                "`hack/cluster registry` and pass the helm flags it prints in "
                "HERMIT_E2E_HELM_SET (hack/test ci does both)")


def _previous_release() -> tuple[str, list[str]]:
    """The previous release's chart directory and the helm flags of its pushed images."""
    proc = subprocess.run(
        [str(REPO / "hack/previous-release"), _registry_prefix(), "--",
         "--dest-tls-verify=false"],  # the cluster's registry speaks plain HTTP
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"hack/previous-release failed: {proc.stderr[-3000:]}"
    chart, *flags = proc.stdout.strip().splitlines()
    return chart, shlex.split(" ".join(flags))


def _helm(cfg: E2EConfig, *args: str) -> None:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True,
                          env={**os.environ, "KUBECONFIG": cfg.kubeconfig}, timeout=600,
                          check=False)
    assert proc.returncode == 0, f"helm {args[0]} failed: {proc.stdout}{proc.stderr}"


def _digest(flags: list[str], value: str) -> str:
    """The digest ``--set value=sha256:...`` in hack/push-images' flags."""
    prefix = f"{value}="
    found = [f.split("=", 1)[1] for f in flags if f.startswith(prefix)]
    assert found, f"no {value} in {flags}"
    return found[0]


def _agents(kube: Kube) -> dict[str, client.V1Pod]:
    """The node-agent pods that are not being deleted, by node."""
    pods = kube.api.list_namespaced_pod(
        RELEASE_NS, label_selector="app.kubernetes.io/component=node-agent").items
    return {p.spec.node_name: p for p in pods
            if p.spec.node_name and p.metadata.deletion_timestamp is None}


def _runs(pod: client.V1Pod, digest: str) -> bool:
    ready = bool(pod.status.container_statuses) and all(
        s.ready for s in pod.status.container_statuses)
    return ready and all(c.image.endswith(f"@{digest}") for c in pod.spec.containers)


def _format_label(kube: Kube, node: str) -> str | None:
    labels = kube.api.read_node(node).metadata.labels or {}
    return labels.get(protocol.LABEL_CHECKPOINT_FORMAT)


def _roll_out(kube: Kube, node: str, digest: str) -> None:
    """Upgrades the node-agent of ``node`` as OnDelete lets a team do it: its pod deleted,
    the DaemonSet's new one Ready on the new image and the node labelled with the format
    level it reads."""
    old = _agents(kube)[node]
    kube.api.delete_namespaced_pod(old.metadata.name, RELEASE_NS)
    wait_until(f"the node-agent of {node} upgraded and Ready", 180, lambda: (
        (pod := _agents(kube).get(node)) is not None and pod.metadata.uid != old.metadata.uid
        and _runs(pod, digest)))
    wait_until(f"{node} labelled {protocol.LABEL_CHECKPOINT_FORMAT}", 60,
               lambda: _format_label(kube, node) == str(protocol.CHECKPOINT_FORMAT_LEVEL))


def _preempt(kube: Kube, cfg: E2EConfig, ns: str, name: str, where: sb.Running,
             done: set[str]) -> tuple[Obj, int]:
    """A spot notice on the sandbox's node: the Preemption checkpoint once durable, and the
    last tick it froze (read while it was taken)."""
    sb.wait_agent_ready(kube, RELEASE_NS, where.node)
    with sb.preempting(cfg, where.node, NOTICE_SECONDS):
        old = sb.LastTick(kube, ns, where.pod)
        ckpt = sb.durable_reading(
            f"a Completed Preemption checkpoint of {where.pod}", NOTICE_SECONDS + 60,
            sb.completed_checkpoint(ns, "Preemption", sandbox_name=name, not_in=done), [old])
        done.add(ckpt["metadata"]["name"])
        last = old.final()
    return ckpt, last


def _restored(kube: Kube, ns: str, name: str, where: sb.Running, ckpt: Obj, last: int
              ) -> sb.Running:
    """The sandbox runs again from ``ckpt`` (the newest: no fallback, nothing stale), its
    counter continuing exactly, and the ledger agrees."""
    after = sb.wait_running(kube, ns, name, restores=where.restores + 1, avoid=where.node,
                            timeout=240, min_ticks=1)
    seen = sb.assert_continues(kube, ns, after.pod, last, exact=True)
    restored = sb.status(ns, name)["restoredFrom"]
    assert restored["name"] == ckpt["metadata"]["name"], restored
    assert not restored.get("fallback") and restored.get("staleSeconds") == 0, restored
    sb.assert_ledger(name, after=seen[-1])
    return sb.Running(after.node, after.pod, after.restores, seen[-1])


def _gate(pod: Obj) -> list[Obj]:
    """The pod's required node-affinity requirements on the checkpoint format label."""
    terms = (((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}
             ).get("nodeSelectorTerms") or []
    return [r for t in terms for r in t.get("matchExpressions") or []
            if r["key"] == protocol.LABEL_CHECKPOINT_FORMAT]


def _replacement(kube: Kube, ns: str, name: str, incarnation: int) -> Obj | None:
    """The sandbox's pod after ``incarnation`` that restores (the newest one)."""
    s = sb.status(ns, name)
    if int(s.get("incarnation") or 0) <= incarnation or not s.get("podName"):
        return None
    return kube.pod(ns, s["podName"])


def test_upgrade_from_the_previous_release_while_a_sandbox_moves_twice(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
    s3_for_pods: S3,
) -> None:
    cfg = e2e_config
    old_chart, old_images = _previous_release()
    new_images = e2e_images()
    old_digest = _digest(old_images, "nodeAgent.image.digest")
    new_digest = _digest(new_images, "nodeAgent.image.digest")
    assert old_digest != new_digest
    sb.ensure_spot_nodes(kube, cfg, 3)
    first, second, third = sb.ready_spot_nodes(kube)[:3]
    current = ["upgrade", RELEASE, str(REPO / "charts/hermit"), "-n", RELEASE_NS,
               *release_values(s3_for_pods), *new_images, "--wait", "--timeout", "300s"]
    try:
        _helm(cfg, "uninstall", RELEASE, "-n", RELEASE_NS, "--wait")
        # This checkout's node-agents labelled the nodes with the level they read; going
        # back to a release without levels, the label goes too (docs/operations.md).
        for node in kube.nodes():
            body: Any = {"metadata": {"labels": {protocol.LABEL_CHECKPOINT_FORMAT: None}}}
            kube.api.patch_node(node["metadata"]["name"], body)
        _helm(cfg, "install", RELEASE, old_chart, "-n", RELEASE_NS,
              *release_values(s3_for_pods), *old_images, "--wait", "--timeout", "300s")
        for node in (first, second, third):
            wait_until(f"the previous release's node-agent Ready on {node}", 180,
                       lambda n=node: n in _agents(kube) and _runs(_agents(kube)[n],
                                                                   old_digest))
            assert _format_label(kube, node) is None
        name = f"agent-{uuid.uuid4().hex[:6]}"
        with sb.only_schedulable_spot(kube, first):
            sb.create_sandbox(namespace, name, sb.stateful_spec(cfg.sandbox_image))
            where = sb.wait_running(kube, namespace, name, min_ticks=5)
        assert where.node == first

        # The upgrade: CRDs and operator now, the node-agents node by node.
        _helm(cfg, *current, "--set", "nodeAgent.updateStrategy=OnDelete")
        schema = client.ApiextensionsV1Api().read_custom_resource_definition(
            "checkpoints.hermit.dev").spec.versions[0].schema.open_apiv3_schema
        assert "formatLevel" in schema.properties["status"].properties, (
            "the chart did not upgrade the Checkpoint CRD")
        agents = _agents(kube)
        assert all(_runs(agents[n], old_digest) for n in (first, second, third)), (
            "OnDelete: the upgrade must leave the running node-agents alone")
        _roll_out(kube, second, new_digest)
        assert _format_label(kube, third) is None

        # Move 1: old node-agent -> new node-agent. `third` is cordoned meanwhile (not
        # `first`: a cordon there would be a drain, an Eviction checkpoint, not a notice's).
        done: set[str] = set()
        sb.set_unschedulable(kube, third)
        try:
            ckpt, last = _preempt(kube, cfg, namespace, name, where, done)
            assert "formatLevel" not in ckpt["status"], (
                f"the previous release's checkpoint carries a format level: {ckpt['status']}")
            where = _restored(kube, namespace, name, where, ckpt, last)
        finally:
            sb.set_unschedulable(kube, third, False)
        assert where.node == second
        print(f"move 1: {first} (previous release) -> {second} (this one), checkpoint "
              f"{ckpt['metadata']['name']}")

        # Move 2: new node-agent -> only after the old one on `third` is upgraded.
        incarnation = int(sb.status(namespace, name)["incarnation"])
        ckpt, last = _preempt(kube, cfg, namespace, name, where, done)
        assert ckpt["status"].get("formatLevel") == protocol.CHECKPOINT_FORMAT_LEVEL, (
            ckpt["status"])
        pod = wait_until("the replacement pod", 60,
                         lambda: _replacement(kube, namespace, name, incarnation))
        gate = _gate(pod)
        assert gate and all(r == {"key": protocol.LABEL_CHECKPOINT_FORMAT, "operator": "Gt",
                                  "values": [str(protocol.CHECKPOINT_FORMAT_LEVEL - 1)]}
                            for r in gate), pod["spec"].get("affinity")
        assert third in sb.ready_spot_nodes(kube)
        waited = time.monotonic()
        while time.monotonic() - waited < GATED_FOR_SECONDS:
            pod = _replacement(kube, namespace, name, incarnation) or pod
            assert not pod["spec"].get("nodeName"), (
                f"pod {pod['metadata']['name']} was bound to {pod['spec']['nodeName']}, "
                f"whose node-agent does not read format {protocol.CHECKPOINT_FORMAT_LEVEL}")
            time.sleep(0.5)
        _roll_out(kube, third, new_digest)
        where = _restored(kube, namespace, name, where, ckpt, last)
        assert where.node == third
        print(f"move 2: {second} -> {third}, waited for its node-agent's upgrade; checkpoint "
              f"{ckpt['metadata']['name']} (format {protocol.CHECKPOINT_FORMAT_LEVEL})")
        assert sb.status(namespace, name)["restores"] == 2
        warnings = [e for e in sb.events(kube, namespace, name) if e["type"] == "Warning"]
        assert not warnings, f"the upgrade brought Warnings: {warnings}"
    finally:
        # As the harness installs it: this checkout's chart and images, RollingUpdate.
        _helm(cfg, *current)
