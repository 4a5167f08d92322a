"""A sandbox lives through any number of moves and losses, not just one.

Each scenario runs the self-checking workload (tests/e2e/sandboxes.py) and asserts that
nothing was lost (the counter continues, the workload's own checks of its memory, child,
pipes, socket, thread, database and files still hold) and nothing was duplicated (one
pod, ticks without repeats). The verdict on ticks is the external tick ledger's
(``sb.assert_ledger``: every tick any copy made, reported as it happened); the pod logs
read around each move are a cross-check. Generation 2 and 3 fail where generation 1 passes, so
the first scenario moves the same sandbox three times and then suspends, resumes and
forks it.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any

import pytest

from hermit_common import api, metrics, protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    RELEASE_NS,
    E2EConfig,
    Kube,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NOTICE_SECONDS = 20


def _preempt(kube: Kube, cfg: E2EConfig, ns: str, name: str, where: sb.Running,
             generation: int, done: set[str]) -> tuple[sb.Running, dict[str, Any]]:
    """One spot notice on the sandbox's node; returns where it runs next and the timings."""
    sb.wait_agent_ready(kube, RELEASE_NS, where.node)
    source_runtime = sb.node_runtime(kube, where.node)  # the node is gone after the notice
    started = time.monotonic()
    with sb.preempting(cfg, where.node, NOTICE_SECONDS):
        old = sb.LastTick(kube, ns, where.pod)
        ckpt = sb.durable_reading(
            f"generation {generation}: a Completed Preemption checkpoint", NOTICE_SECONDS,
            sb.completed_checkpoint(ns, "Preemption", sandbox_name=name, not_in=done), [old])
        durable = sb.since(started)
        done.add(ckpt["metadata"]["name"])
        last = old.final()
        after = sb.wait_running(kube, ns, name, restores=where.restores + 1, avoid=where.node,
                                timeout=180, min_ticks=1)
        running = sb.since(started)
        seen = sb.assert_continues(kube, ns, after.pod, last, exact=True)
        sb.assert_ledger(name, after=seen[-1])
    timing = {"generation": generation, "from": where.node, "to": after.node,
              "runtimes": f"{source_runtime} -> {sb.node_runtime(kube, after.node)}",
              "checkpoint": ckpt["metadata"]["name"], "notice_to_durable_s": durable,
              "notice_to_running_s": running, "frozen_ms": ckpt["status"].get("frozenMs"),
              "first_tick": seen[0]}
    return sb.Running(after.node, after.pod, after.restores, seen[-1]), timing


def test_three_preemptions_in_a_row_then_suspend_resume_and_fork(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    sb.ensure_spot_nodes(kube, e2e_config, 2)
    name = f"agent-{uuid.uuid4().hex[:6]}"
    sb.create_sandbox(namespace, name, sb.stateful_spec(e2e_config.sandbox_image))
    where = sb.wait_running(kube, namespace, name, min_ticks=10)
    done: set[str] = set()
    timings = []
    for generation in (1, 2, 3):
        # The next node must exist before the notice: a spot pool keeps spares.
        sb.ensure_spot_nodes(kube, e2e_config, 2)
        where, timing = _preempt(kube, e2e_config, namespace, name, where, generation, done)
        timings.append(timing)
        print(f"move {generation}: {timing}")
    assert sb.status(namespace, name)["restores"] == 3
    _assert_moves_are_observable(kube, e2e_config, namespace, name, done)

    # Suspend: checkpointed and released; resume: restored, the counter continues.
    sb.patch_sandbox(namespace, name, {"suspend": True})
    # The pod is frozen from the Suspend checkpoint until it is durable, then deleted:
    # follow its output until then, so the last tick is the one the checkpoint holds.
    seen_last = [where.last_tick]

    def suspended() -> bool:
        seen_last.append(max([*sb.ticks(kube, namespace, where.pod), seen_last[-1]]))
        return sb.status(namespace, name).get("phase") == "Suspended"

    wait_until("sandbox Suspended", 120, suspended, 0.2)
    last = seen_last[-1]
    suspend = sb.completed_checkpoint(namespace, "Suspend", sandbox_name=name)()
    assert suspend is not None, "no Completed Suspend checkpoint"
    sb.patch_sandbox(namespace, name, {"suspend": False})
    resumed = sb.wait_running(kube, namespace, name, restores=4, min_ticks=1)
    seen = sb.assert_continues(kube, namespace, resumed.pod, last)
    sb.assert_ledger(name, after=seen[-1])
    print(f"resumed on {resumed.node} at tick {seen[0]}")

    # Fork the restored sandbox: a second sandbox from its Suspend checkpoint.
    fork = f"{name}-fork"
    fork_created = time.monotonic()
    sb.create_sandbox(namespace, fork, sb.stateful_spec(
        e2e_config.sandbox_image, restoreFrom=suspend["metadata"]["name"]))
    forked = sb.wait_running(kube, namespace, fork, restores=1, min_ticks=1)
    # The fork's process image counts its original's three restores before the Suspend
    # checkpoint, and its own: generation 4 (its status says 1 restore, its own).
    fork_ticks = sb.assert_continues(kube, namespace, forked.pod, seen[0] - 1, gen=4)
    assert sb.status(namespace, name)["phase"] == "Running", "the original keeps running"
    # The fork reports from the tick after the Suspend checkpoint's, under its own name
    # (its pod's hostname) or, when the restore kept the dumped hostname, the original's,
    # from its own pod's IP; either way its record is its own, the original's untouched.
    sb.attribute_fork(kube, namespace, fork, forked.pod, original=name, since=fork_created)
    forked_ledger = sb.assert_ledger(fork, after=fork_ticks[-1])
    # (one later when the checkpoint froze a tick between its report and its log line)
    assert forked_ledger.first in (seen[0], seen[0] + 1), forked_ledger.summary()
    sb.assert_ledger(name, after=seen[-1])
    print(f"fork {fork} on {forked.node} started at tick {fork_ticks[0]}")
    kubectl = sb.kubectl_binary()
    print("after three moves, a suspend/resume and a fork:")
    print(sb.kubectl_text(kubectl, e2e_config.kubeconfig, "asb,ckpt", "-n", namespace))
    print("moves:")
    for t in timings:
        print(f"  gen {t['generation']}: {t['from']} -> {t['to']} ({t['runtimes']}): "
              f"notice->durable "
              f"{t['notice_to_durable_s']} s, notice->running {t['notice_to_running_s']} s, "
              f"frozen {t['frozen_ms']} ms")


SIZE = re.compile(r"^\d+(\.\d)? (B|KiB|MiB|GiB)$")
DURATION = re.compile(r"^(\d+ms|\d+\.\d+s|\d+m\d+s)$")


def _assert_moves_are_observable(kube: Kube, cfg: E2EConfig, ns: str, name: str,
                                 moves: set[str]) -> None:
    """What a user of the operator looks at after the moves: the downtime histogram on the
    operator's /metrics, and sizes, durations and progress in `kubectl get`."""
    seen: dict[str, str] = {}

    def counted() -> float | None:
        seen.update(sb.operator_metrics(kube, RELEASE_NS))
        n = sb.metric_sum(seen, f"{metrics.OPERATOR_DOWNTIME}_count")
        return n if n >= len(moves) else None

    try:
        count = wait_until(f"{len(moves)} moves in the downtime histogram", 30, counted)
    finally:
        print("operator metrics:", *[line for text in seen.values()
                                     for line in text.splitlines()
                                     if line.startswith("hermit_operator_")], sep="\n  ")
        print("sandbox status:", sb.status(ns, name))
    # Sandboxes by phase, as the leader reconciled them: this one is Running; and the
    # operator says its version.
    assert sb.metric_sum(seen, metrics.OPERATOR_SANDBOXES, phase=api.PHASE_RUNNING) >= 1
    assert sb.metric_sum(seen, f"{metrics.OPERATOR_BUILD}_info") >= 1
    status = sb.status(ns, name)
    assert DURATION.match(status.get("lastDowntime", "")), status
    assert SIZE.match((status.get("lastCheckpoint") or {}).get("size", "")), status
    kubectl = sb.kubectl_binary()
    rows = {r["NAME"]: r for r in sb.kubectl_table(kubectl, cfg.kubeconfig, "ckpt", "-n", ns)}
    shown = [rows[m] for m in moves if m in rows]  # retention may have deleted the oldest
    assert shown, f"no Preemption checkpoint in kubectl get ckpt: {sorted(rows)}"
    for row in shown:
        assert row["PHASE"] == "Completed", row
        assert SIZE.match(row["SIZE"]) and DURATION.match(row["DURATION"]), row
        assert re.match(r"^\d+ chunks?, \d+ new$", row["PROGRESS"]), row
    [asb] = sb.kubectl_table(kubectl, cfg.kubeconfig, "asb", name, "-n", ns, "-o", "wide")
    assert asb["CHECKPOINT SIZE"] == status["lastCheckpoint"]["size"], asb
    assert asb["LAST DOWNTIME"] == status["lastDowntime"], asb
    print(f"operator: {metrics.OPERATOR_DOWNTIME}_count {count:g} after {len(moves)} moves")
    print(sb.kubectl_text(kubectl, cfg.kubeconfig, "asb,ckpt", "-n", ns))
    print(sb.kubectl_text(kubectl, cfg.kubeconfig, "asb,ckpt", "-n", ns, "-o", "wide"))


def test_node_lost_without_notice_restores_the_interval_checkpoint(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    interval = 30
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace,
                                   checkpoint={"intervalSeconds": interval})
    ckpt = wait_until("a Completed Interval checkpoint", interval + 60,
                      sb.completed_checkpoint(namespace, "Interval", sandbox_name=name), 1)
    assert sb.status(namespace, name)["phase"] == "Running", "a routine checkpoint stops nothing"
    at_checkpoint = sb.ticks(kube, namespace, where.pod)[-1]
    # Let the workload run past the checkpoint: that is the work the loss takes.
    last_before = wait_until("ten ticks past the checkpoint", 30, lambda: (
        t := sb.ticks(kube, namespace, where.pod)) and t[-1] >= at_checkpoint + 10 and t[-1])
    lost_at = time.monotonic()
    sb.lose_node(e2e_config, where.node, timeout=120)
    after = sb.wait_running(kube, namespace, name, restores=1, avoid=where.node, timeout=240,
                            min_ticks=1)
    seen = sb.assert_continues(kube, namespace, after.pod, last_before, exact=False)
    restored = sb.status(namespace, name).get("restoredFrom") or {}
    assert restored.get("name"), f"status.restoredFrom missing: {sb.status(namespace, name)}"
    # The newest checkpoint the lost node completed is the one restored, nothing older.
    completed = sorted((c for c in sb.checkpoints(namespace)
                        if c["spec"]["sandboxRef"]["name"] == name
                        and protocol.node_of(c) == where.node
                        and (c.get("status") or {}).get("phase") == "Completed"),
                       key=lambda c: str(c["status"].get("completedAt")))
    assert completed and restored["name"] == completed[-1]["metadata"]["name"], (
        restored, [(c["metadata"]["name"], c["status"].get("completedAt")) for c in completed])
    stale = int(restored.get("staleSeconds", -1))
    assert stale > 0, restored  # ten ticks at least ran after it: that work is lost
    lost_seconds: dict[str, str] = {}

    def work_lost_counted() -> float | None:
        lost_seconds.update(sb.operator_metrics(kube, RELEASE_NS))
        return sb.metric_sum(lost_seconds, f"{metrics.OPERATOR_WORK_LOST}_sum") or None

    total_lost = wait_until("the loss in hermit_operator_work_lost_seconds", 30,
                            work_lost_counted)
    assert total_lost >= stale, (total_lost, stale)
    # The ledger's record of the old copy holds every tick it made before the node went,
    # which the pod log may not: what the restored copy redid is exactly those after the
    # checkpoint, one copy after the other (a replay), nothing lost.
    old_last = max(c.last_tick for c in sb.ledger_verdict(name, after=seen[-1]).copies
                   if c.gen == 0)
    # the restored copy redoes up to the old copy's last tick and beyond (a tick each 0.2 s)
    v = sb.assert_ledger(name, after=old_last, allow_replay=True,
                         timeout=30 + (old_last - seen[-1]) * sb.TICK_MS / 1000)
    new_first = min(c.first_tick for c in v.copies if c.gen > 0)
    assert old_last >= last_before, v.summary()
    assert new_first in (seen[0], seen[0] + 1), v.summary()  # a tick cut by the checkpoint
    assert v.replayed == tuple(range(new_first, old_last + 1)), v.summary()
    lost_ticks = old_last - new_first + 1
    # fails if no Warning says which checkpoint was restored and how old it was
    sb.wait_events(kube, namespace, name, f"a Warning naming {restored.get('name')}",
                   lambda e: e["type"] == "Warning"
                   and str(restored.get("name")) in str(e["message"]))
    print(f"lost without notice: restored {restored['name']} (Interval checkpoint "
          f"{ckpt['metadata']['name']} or newer), {stale} s old when restored; "
          f"{lost_ticks} ticks = {lost_ticks * sb.TICK_MS / 1000:.1f} s of work lost "
          f"(intervalSeconds {interval}); running again {sb.since(lost_at)} s after the loss")
    assert lost_ticks * sb.TICK_MS / 1000 <= interval + 15


def test_kubectl_drain_checkpoints_and_moves_the_sandbox(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace)
    started = time.monotonic()
    with sb.draining(e2e_config, where.node) as drain:
        old = sb.LastTick(kube, namespace, where.pod)
        ckpt = sb.durable_reading("a Completed Eviction checkpoint", 120, sb.completed_checkpoint(
            namespace, "Eviction", sandbox_name=name), [old])
        last = old.final()
        out, _ = drain.communicate(timeout=240)
        assert drain.returncode == 0, f"drain failed: {out}"
        drained = sb.since(started)
        after = sb.wait_running(kube, namespace, name, restores=1, avoid=where.node,
                                min_ticks=1)
        seen = sb.assert_continues(kube, namespace, after.pod, last, exact=True)
        sb.assert_ledger(name, after=seen[-1])
        print(f"drain of {where.node}: done in {drained} s; sandbox moved to "
              f"{after.node} from checkpoint {ckpt['metadata']['name']}")
