"""Overlap: a move's replacement pod is created at the notice, not once the checkpoint is
durable (the operator's overlapMoves, docs/protocol.md flow 2).

One self-checking sandbox (tests/e2e/sandboxes.py) is preempted twice with a spot notice:
first with overlap on (the chart's default), then with it off (a helm upgrade of the
release). Both times nothing may be lost or duplicated, the status must account for the
move (incarnation + 1, restores + 1, restoredFrom the stopping checkpoint with nothing
stale, lastDowntime), and the first replacement pod must be created before the checkpoint
is durable with overlap and after it without. A replacement its node's kubelet refused is
allowed only with the operator's Normal PodRejected Event for it (and one more incarnation). The
test prints notice -> durable and notice -> running again for both.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from hermit_common import api, protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    RELEASE,
    RELEASE_NS,
    REPO,
    E2EConfig,
    Kube,
    helm_binary,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

Obj = dict[str, Any]

NOTICE_SECONDS = 20
# Enough memory that the stopping checkpoint takes seconds, not one: "created before
# durable" then depends on the operator reacting to the notice, not on winning a race
# against a sub-second dump (24 MiB was durable 0.9 s after the pod appeared, and twice
# in the same second).
MEM_MB = 256
LEASE = "hermit-operator"  # the chart's operator.leaderElection.leaseName
OPERATOR_PODS = "app.kubernetes.io/component=operator"


@dataclass(frozen=True)
class Move:
    """One preemption, in seconds since the notice command started."""

    source: str
    target: str
    checkpoint: str
    replacement: float  # the new pod exists
    durable: float  # the checkpoint is Completed
    running: float  # the sandbox is Running on the new pod, which has printed a tick
    frozen_ms: int | None
    first_pod: str  # the first replacement pod (the one the overlap is about)
    first_created: str  # its creationTimestamp


def _set_overlap(kube: Kube, cfg: E2EConfig, on: bool) -> None:
    """operator.overlapMoves through a helm upgrade; returns once the one operator pod
    left runs with that value and holds the leadership Lease."""
    value = str(on).lower()
    proc = subprocess.run(
        [helm_binary(), "upgrade", RELEASE, str(REPO / "charts/hermit"), "-n", RELEASE_NS,
         "--reuse-values", "--set", f"operator.overlapMoves={value}", "--wait",
         "--timeout", "180s"],
        env={**os.environ, "KUBECONFIG": cfg.kubeconfig}, capture_output=True, text=True,
        check=False)
    assert proc.returncode == 0, f"helm upgrade failed: {proc.stdout}{proc.stderr}"
    leases = client.CoordinationV1Api()

    def leading() -> bool | None:
        listed: Any = kube.api.list_namespaced_pod(
            RELEASE_NS, label_selector=OPERATOR_PODS, _preload_content=False)
        pods: list[Obj] = json.loads(listed.data)["items"]
        if (len(pods) != 1 or pods[0]["metadata"].get("deletionTimestamp")
                or pods[0]["status"].get("phase") != "Running"):
            return None
        env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
        read: Any = leases.read_namespaced_lease(LEASE, RELEASE_NS, _preload_content=False)
        lease: Obj = json.loads(read.data)
        return (env.get("HERMIT_OVERLAP_MOVES") == value
                and lease["spec"].get("holderIdentity") == pods[0]["metadata"]["name"]) or None

    wait_until(f"one operator with overlapMoves={value}, holding the Lease", 120, leading, 0.5)


def _preempt(kube: Kube, cfg: E2EConfig, ns: str, name: str, where: sb.Running) -> Move:
    """A spot notice on the sandbox's node; follows the move at 0.2 s until the sandbox
    runs again on a new pod (which must continue the counter exactly). The first
    replacement pod is the one the overlap creates; when the node's kubelet refused it
    (a kubelet whose copy of the Node lags a label the scheduler already saw rejects a
    pod with NodeAffinity), the operator replaced it with a Normal PodRejected Event,
    and the move ends on a later pod: each one skipped must have that Event."""
    sb.wait_agent_ready(kube, RELEASE_NS, where.node)
    before = sb.status(ns, name)
    incarnation = int(before["incarnation"])
    candidates = [f"{name}-{incarnation + k}" for k in (1, 2, 3)]
    first: dict[str, str] = {}
    seen: dict[str, float] = {}
    last = [where.last_tick]
    earlier = {c["metadata"]["name"] for c in sb.checkpoints(ns)}
    done = sb.completed_checkpoint(ns, protocol.PREEMPTION, sandbox_name=name, not_in=earlier)

    def moved() -> sb.Running | None:
        # One time per poll for both: two reads of one poll are one observation, or their
        # order within it, rounded, would decide which came first.
        now = sb.since(started)
        if "replacement" not in seen:
            found = next((p for p in (kube.pod(ns, c) for c in candidates) if p), None)
            if found is not None:
                seen["replacement"] = now
                first.update(pod=found["metadata"]["name"],
                             created=str(found["metadata"]["creationTimestamp"]))
        if "durable" not in seen and done() is not None:
            seen["durable"] = now
        # The old pod's last tick is the one its checkpoint holds (it is frozen, then ended).
        last.append(max([*sb.ticks(kube, ns, where.pod), last[-1]]))
        s = sb.status(ns, name)
        pod = str(s.get("podName") or "")
        if (s.get("phase") != "Running" or int(s.get("incarnation") or 0) <= incarnation
                or int(s.get("restores") or 0) <= where.restores
                or not sb.ticks(kube, ns, pod)):
            return None
        return sb.Running(s["nodeName"], pod, int(s["restores"]), 0)

    started = time.monotonic()
    with sb.preempting(cfg, where.node, NOTICE_SECONDS):
        after = wait_until(f"sandbox {name} running again in a pod after {where.pod}", 180,
                           moved, 0.2)
        running = sb.since(started)
    ckpt = done()
    assert ckpt is not None and after.node != where.node
    assert first, "no replacement pod was seen"
    ticks = sb.assert_continues(kube, ns, after.pod, last[-1])
    lost = _lost_between(kube, ns, name, first["pod"], after.pod)
    _assert_accounted(ns, name, before, ckpt, after.pod, len(lost))
    print(f"  {where.node} -> {after.node}: ticks continue at {ticks[0]} (last {last[-1]})"
          + (f"; pods {', '.join(lost)} refused by their kubelet and replaced" if lost else ""))
    return Move(where.node, after.node, ckpt["metadata"]["name"], seen["replacement"],
                seen["durable"], running, (ckpt.get("status") or {}).get("frozenMs"),
                first["pod"], first["created"])


def _lost_between(kube: Kube, ns: str, name: str, first: str, final: str) -> list[str]:
    """The pods from ``first`` up to, not including, ``final`` (incarnations in between),
    each with the PodRejected Event that says the kubelet refused it before it ran."""
    lost = [f"{name}-{k}" for k in range(int(first.rsplit("-", 1)[1]),
                                         int(final.rsplit("-", 1)[1]))]
    for pod in lost:
        said = f"refused pod {pod} before it ran"

        def names_it(event: Obj, said: str = said) -> bool:
            return (event["reason"] == api.REASON_POD_REJECTED and event["type"] == "Normal"
                    and said in event["message"])

        sb.wait_events(kube, ns, name, f"a PodRejected Event for pod {pod}", names_it)
    return lost


def _assert_accounted(ns: str, name: str, before: Obj, ckpt: Obj, new_pod: str,
                      lost: int) -> None:
    """One move: incarnation + 1 (and one more per pod lost on the way), restores + 1,
    restored from the stopping checkpoint with nothing lost, and a downtime recorded."""
    s = sb.status(ns, name)
    assert int(s["incarnation"]) == int(before["incarnation"]) + 1 + lost, s
    assert int(s["restores"]) == int(before.get("restores") or 0) + 1, s
    assert s["podName"] == new_pod, s
    record = s.get("restoredFrom") or {}
    assert record.get("name") == ckpt["metadata"]["name"], record
    assert record.get("staleSeconds") == 0 and not record.get("fallback"), record
    assert s.get("lastDowntime"), s


def _completed_at(ckpt: str, ns: str) -> str:
    """The checkpoint's completedAt: RFC 3339 in whole seconds, UTC, as creationTimestamp
    is, so the two compare as strings."""
    [c] = [c for c in sb.checkpoints(ns) if c["metadata"]["name"] == ckpt]
    return str(c["status"]["completedAt"])


def test_overlap_creates_the_replacement_at_the_notice(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    spot_nodes = len(sb.ready_spot_nodes(kube))
    name, where = sb.start_on_spot(kube, e2e_config, RELEASE_NS, namespace, mem_mb=MEM_MB)
    moves: dict[str, Move] = {}
    try:
        for mode in ("on", "off"):
            if mode == "off":
                _set_overlap(kube, e2e_config, False)
            sb.ensure_spot_nodes(kube, e2e_config, 2)  # a spot pool keeps a spare
            print(f"overlap {mode}:")
            move = _preempt(kube, e2e_config, namespace, name, where)
            status = sb.status(namespace, name)
            where = sb.Running(move.target, status["podName"], int(status["restores"]), 0)
            created, durable = move.first_created, _completed_at(move.checkpoint, namespace)
            replacements = [e for e in sb.events(kube, namespace, name)
                            if e["reason"] == api.REASON_REPLACEMENT_CREATED
                            and f"pod {move.first_pod} " in e["message"]]
            if mode == "on":
                assert created <= durable and move.replacement <= move.durable, (created, durable)
                assert replacements, "no ReplacementCreated Event"
            else:
                assert created >= durable and move.replacement >= move.durable, (created, durable)
                assert not replacements, replacements
            moves[mode] = move
    finally:
        _set_overlap(kube, e2e_config, True)
        sb.ensure_spot_nodes(kube, e2e_config, spot_nodes)  # the pool as it was found
    on, off = moves["on"], moves["off"]
    for mode, m in moves.items():
        print(f"  overlap {mode}: {m.source} -> {m.target}: notice->replacement pod "
              f"{m.replacement} s, notice->durable {m.durable} s (frozen {m.frozen_ms} ms), "
              f"notice->running {m.running} s")
    print(f"overlap: notice->durable {on.durable} s (off: {off.durable} s), "
          f"notice->running {on.running} s (off: {off.running} s)")
