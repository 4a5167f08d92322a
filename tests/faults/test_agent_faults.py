"""The node-agent SIGKILLed at random points of a migration: while it dumps and uploads
the stopping checkpoint, and while it restores it on the new node.

The injection points are drawn from a seeded random source (the seed is printed;
$HERMIT_FAULTS_SEED replays a run). Each scenario records its row in the ledger, then
asserts nothing lost and no second live copy at any sample.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from hermit_common import protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import E2EConfig, Kube, wait_until
from tests.faults import inject, verdict
from tests.faults.ledger import Ledger

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

BIG = inject.BIG_MEM_MB

Obj = dict[str, Any]

UPLOAD_KILLS = 2
DRAWS = 3  # fresh sandboxes, until a kill lands in the window it targets
RESTORE_KILLS = 2
MAX_DELAY_S = 5.0  # the random point, after the phase that opens the window
# A restore from a prefetched cache takes 2-5 s here: a later point would land after it.
MAX_RESTORE_DELAY_S = 3.0


def test_node_agent_killed_at_random_points_of_the_checkpoint_upload(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, ledger: Ledger,
) -> None:
    """Each kill lands at a random delay after a Preemption checkpoint starts dumping:
    during the dump (CRIU aborts and thaws the tree), the upload (the restarted agent
    thaws the tree and fails the checkpoint, or ends the tree when its manifest was
    durable) or just after it. While the node is still going away a new request is
    made; the sandbox moves with nothing lost."""
    random = inject.rng("agent killed during the upload")
    for draw in range(1, DRAWS + 1):
        name, where = inject.start(kube, e2e_config, hermit_release, namespace, mem_mb=BIG)
        kills: list[str] = []
        with inject.preempting(kube, e2e_config, hermit_release, namespace, name, where,
                               120) as watch:
            _kill_during_uploads(kube, namespace, name, hermit_release, where.node,
                                 random, kills)
            ckpt, last = inject.durable_then_last_tick(namespace, name, watch, 120)
            outcome = verdict.judge(kube, namespace, name, last, restores=1,
                                    avoid=where.node, timeout=240)
        # The fault must hit what it targets, a checkpoint in flight; a draw whose kills
        # all came after the checkpoint was durable proves nothing: draw again.
        landed = any(k.endswith(tuple(f"({p})" for p in inject.IN_FLIGHT)) for k in kills)
        if landed or draw == DRAWS:
            break
        print(f"draw {draw}: no kill landed in flight ({kills}); drawing again")
        assert outcome.lost == 0 and outcome.duplicated == 0, outcome.detail
    row = inject.record(ledger, "node-agent SIGKILL during dump/upload", len(kills),
                        outcome, watch, f"draw {draw}: kills at {', '.join(kills)}; moved by "
                        f"{ckpt['metadata']['name']}")
    inject.assert_row(row)
    assert landed, f"in {DRAWS} draws no kill landed while a checkpoint was in flight: {kills}"


def _kill_during_uploads(kube: Kube, ns: str, name: str, release: str, node: str,
                         random: Any, kills: list[str]) -> None:
    """Up to UPLOAD_KILLS kills, each at a random point of a different checkpoint's
    dump/upload window; stops early once one is Completed (the sandbox is durable)."""
    seen: set[str] = set()
    for _ in range(UPLOAD_KILLS):
        ckpt = wait_until("a Preemption checkpoint dumping", 90, lambda: inject.
                          preemption_checkpoint(ns, name, (*inject.IN_FLIGHT, "Completed"),
                                                not_in=seen), 0.05)
        cname = ckpt["metadata"]["name"]
        if ckpt["status"]["phase"] == "Completed":
            return
        delay = random.uniform(0, MAX_DELAY_S)
        time.sleep(delay)  # the injection point itself, not a wait for a condition
        at = inject.phase_of(ns, cname)
        sb.kill_node_agent(kube, release, node)
        kills.append(f"{cname} +{delay:.2f}s ({at})")
        print(f"killed the node-agent of {node} {delay:.2f} s into {cname}, then {at}")
        seen.add(cname)
        decided = wait_until(f"{cname} decided after the restart", 90, lambda c=cname: (
            p := inject.phase_of(ns, c)) not in inject.IN_FLIGHT and p != "Pending" and p)
        print(f"  {cname} ended {decided}")
        if decided == "Completed":
            return


def test_node_agent_killed_at_random_points_of_the_restore(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, ledger: Ledger,
) -> None:
    """Each kill lands at a random delay after a restore pod starts restoring: the
    restarted agent reports the restore as a retryable failure and the operator restores
    the same checkpoint on a fresh pod (a restore that finished first is left alone)."""
    random = inject.rng("agent killed during the restore")
    for draw in range(1, DRAWS + 1):
        name, where = inject.start(kube, e2e_config, hermit_release, namespace, mem_mb=BIG)
        kills: list[str] = []
        with inject.preempting(kube, e2e_config, hermit_release, namespace, name, where,
                               40) as watch:
            ckpt, last = inject.durable_then_last_tick(namespace, name, watch, 40)
            _kill_during_restores(kube, namespace, name, hermit_release, where.pod,
                                  random, kills)
            outcome = verdict.judge(kube, namespace, name, last, restores=1,
                                    avoid=where.node, timeout=300)
        # The fault must hit what it targets, a restore under way; a draw whose kills all
        # came after the restore was done proves nothing: draw again.
        landed = any(k.endswith(f"({protocol.RESTORING})") for k in kills)
        if landed or draw == DRAWS:
            break
        print(f"draw {draw}: no kill landed while Restoring ({kills}); drawing again")
        assert outcome.lost == 0 and outcome.duplicated == 0, outcome.detail
    attempts = sb.status(namespace, name).get("restoreAttempts", 0)
    row = inject.record(ledger, "node-agent SIGKILL during restore", len(kills), outcome,
                        watch, f"draw {draw}: kills at {', '.join(kills)}; "
                        f"{ckpt['metadata']['name']}, restore attempts {attempts}")
    inject.assert_row(row)
    assert landed, f"in {DRAWS} draws no kill landed while a restore was under way: {kills}"


def _kill_during_restores(kube: Kube, ns: str, name: str, release: str, old_pod: str,
                          random: Any, kills: list[str]) -> None:
    done = {old_pod}
    for _ in range(RESTORE_KILLS):
        found = wait_until("a restore under way (or done)", 180,
                           lambda: _restoring(kube, ns, name, done), 0.05)
        if found == "restored":
            return
        pod, node = found
        delay = random.uniform(0, MAX_RESTORE_DELAY_S)
        time.sleep(delay)  # the injection point itself
        at = sb.pod_annotation(kube, ns, pod, protocol.ANNOTATION_RESTORE_PHASE)
        sb.kill_node_agent(kube, release, node)
        kills.append(f"{pod} +{delay:.2f}s ({at})")
        print(f"killed the node-agent of {node} {delay:.2f} s into the restore of {pod} "
              f"(then {at})")
        done.add(pod)


def _restoring(kube: Kube, ns: str, name: str, done: set[str]
               ) -> tuple[str, str] | str | None:
    """(pod, node) of a restore under way in a pod not in ``done``; "restored" once the
    sandbox runs again from any pod: one whose node-agent was killed just after its
    restore finished too (that restore is left alone)."""
    s = sb.status(ns, name)
    pod = s.get("podName")
    if pod and s.get("phase") == "Running" and int(s.get("restores") or 0) >= 1:
        return "restored"
    if not pod or pod in done:
        return None
    if sb.pod_annotation(kube, ns, pod, protocol.ANNOTATION_RESTORE_PHASE) == \
            protocol.RESTORING:
        node = (kube.pod(ns, pod) or {}).get("spec", {}).get("nodeName")
        return (pod, node) if node else None
    return None
