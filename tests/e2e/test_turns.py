"""Turn boundaries on the cluster (docs/turns.md): a sandbox with ``onTurn: true`` driven
through turns by ``TurnClient`` is checkpointed only on the turns that changed something,
and a node lost without notice loses nothing of its last completed turn: its files and
processes (an idle agent), and the memory of the self-checking workload."""

from __future__ import annotations

import time
import uuid

import requests
from kubernetes import client

from hermit_common import protocol
from hermit_common.kubeapi import KubeApi
from hermit_common.settings import TURN_AUDIENCE
from hermit_common.turns import TurnClient, TurnResult
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import E2EConfig, Kube, wait_until
from tests.support import ledger
from tests.support.attacks import REFUSED, Attack

STRANGER = "stranger"
API_ONLY = "api-only"


def _turn_checkpoints(ns: str, name: str) -> list[str]:
    return sorted(c["metadata"]["name"] for c in sb.checkpoints(ns)
                  if c["spec"]["sandboxRef"]["name"] == name)


def _refusals(turns: TurnClient, ns: str, name: str, stranger: str, api_only: str) -> None:
    url = turns.endpoint(ns, name)
    anonymous = requests.post(url, json={"turn": 0}, timeout=30)
    assert anonymous.status_code == 401, anonymous.text
    # A token the API server accepts (its own audience) is not one for the endpoint.
    api = requests.post(url, json={"turn": 0}, timeout=30,
                        headers={"Authorization": f"Bearer {api_only}"})
    assert api.status_code == 401 and TURN_AUDIENCE in api.json()["error"], api.text
    foreign = requests.post(url, json={"turn": 0}, timeout=30,
                            headers={"Authorization": f"Bearer {stranger}"})
    assert foreign.status_code == 403, foreign.text
    assert "may not create agentsandboxes/turns" in foreign.json()["error"]


def _drive(turns: TurnClient, ns: str, name: str, pod: str) -> list[TurnResult]:
    """Six turns: file writes, nothing, a read, a process started."""
    steps = [
        "echo one > /workspace/t1",                             # 1: first turn: full
        "",                                                     # 2: nothing: skip
        "cat /workspace/t1 >/dev/null",                         # 3: a read: skip
        # the writable layer: /tmp, the one directory of the image a non-root user (the
        # restricted pod policy's default, 65532) may write
        "echo four > /workspace/t4; echo note > /tmp/agent-note",  # 4: files-only
        "",                                                     # 5: skip
        "echo six > /workspace/t6; setsid sleep 4242 </dev/null >/dev/null 2>&1 &",  # 6: full
    ]
    results = []
    for number, script in enumerate(steps, start=1):
        if script:
            sb.exec_sh(ns, pod, script)
        result = turns.turn_ended(ns, name, number, wait_seconds=120)
        print(f"turn {number}: {result.decision} -> {result.checkpoint} ({result.phase}); "
              f"{'; '.join(result.reasons)}")
        results.append(result)
    again = turns.turn_ended(ns, name, 5)
    assert again.repeated and again.decision == results[4].decision
    return results


def test_turns_checkpoint_only_changes_and_a_loss_keeps_the_last_turn(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig, attack: Attack,
) -> None:
    sb.ensure_spot_nodes(kube, e2e_config, 2)
    name = f"turns-{uuid.uuid4().hex[:6]}"
    sb.create_sandbox(namespace, name, sb.idle_turn_spec(e2e_config.sandbox_image))
    node, pod = sb.wait_turn_sandbox(namespace, name)
    sb.wait_agent_ready(kube, hermit_release, node)
    turns = TurnClient(token=sb.turn_harness_token(namespace), kube=KubeApi(client.ApiClient()))
    _refusals(turns, namespace, name, sb.service_account_token(namespace, STRANGER),
              sb.service_account_token(namespace, API_ONLY, audiences=[]))
    # The row of the attack suite's table for what _refusals just saw (the slowloris and
    # the junk-token flood are in test_turn_attacks.py).
    attack.record(
        "turn endpoint: a token for the API server", tried="a service-account token with the "
        "API server's own audience (what a pod's default token is), and no token, posted to "
        "the node-agent's hostPort", outcome=REFUSED,
        evidence=f"401 naming audience {TURN_AUDIENCE} for the API server's token, 401 for no "
                 "token (and 403 for a Hermit-audience token of an account without the turn "
                 "role)")

    results = _drive(turns, namespace, name, pod)
    decisions = [r.decision for r in results]
    assert decisions == ["full", "skip", "skip", "files-only", "skip", "full"], decisions
    for r in results:
        if r.decision != protocol.TURN_SKIP:
            assert r.phase == protocol.COMPLETED, r
    made = {r.checkpoint for r in results if r.decision != protocol.TURN_SKIP}
    assert _turn_checkpoints(namespace, name) == sorted(made), "a skipped turn made a checkpoint"
    last = str(results[-1].checkpoint)

    lost_at = time.monotonic()
    sb.lose_node(e2e_config, node, timeout=120)
    new_node, new_pod = sb.wait_turn_sandbox(namespace, name, restores=1, avoid=node)
    restored = sb.status(namespace, name).get("restoredFrom") or {}
    assert restored.get("name") == last, f"expected a restore of {last}: {restored}"
    files = sb.exec_sh(namespace, new_pod, "cat /workspace/t1 /workspace/t4 /workspace/t6 "
                                        "/tmp/agent-note")
    assert files.split() == ["one", "four", "six", "note"], files
    wait_until("the process turn 6 started, restored", 30,
               lambda: "sleep 4242" in sb.exec_sh(namespace, new_pod, "ps -o args"))
    print(f"turns: {decisions}; checkpoints {sorted(made)}; node {node} lost without "
          f"notice, restored from {last} on {new_node} {sb.since(lost_at)} s later with "
          "every file and process of turn 6")


def test_a_turn_checkpoint_carries_the_workloads_memory_across_a_loss(
    kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
) -> None:
    """The self-checking workload, checkpointed at two turn ends, then its node lost: the
    copy on the new node resumes from the state the last turn froze (its first tick
    follows a tick made during that turn's end, told by the external ledger), with every
    self-check passing, and redoes only what ran after that turn."""
    name, where = sb.start_on_spot(kube, e2e_config, hermit_release, namespace,
                                   checkpoint={"onTurn": True})
    turns = TurnClient(token=sb.turn_harness_token(namespace), kube=KubeApi(client.ApiClient()))
    collector = ledger.current()
    assert collector is not None, "no tick ledger (HERMIT_E2E_LEDGER_HOST)"
    ended: list[tuple[TurnResult, int, int]] = []
    for number in (1, 2):
        before = collector.last_tick(name)
        result = turns.turn_ended(namespace, name, number, wait_seconds=120)
        ended.append((result, before, collector.last_tick(name)))
    decisions = [r.decision for r, _, _ in ended]
    # its memory changes every tick: each turn is a full checkpoint
    assert decisions == ["full", "full"], ended
    assert all(r.phase == protocol.COMPLETED for r, _, _ in ended), ended
    last, before, after = ended[-1]
    # Run on past the turn: that is the work the loss takes, and redone.
    ran_on = wait_until("ten ticks past the last turn", 30,
                        lambda: (t := collector.last_tick(name)) >= after + 10 and t)
    sb.lose_node(e2e_config, where.node, timeout=120)
    moved = sb.wait_running(kube, namespace, name, restores=1, avoid=where.node,
                            timeout=240, min_ticks=1)
    restored = sb.status(namespace, name).get("restoredFrom") or {}
    assert restored.get("name") == last.checkpoint, (
        f"expected a restore of the last turn's {last.checkpoint}: {restored}")
    seen = sb.assert_continues(kube, namespace, moved.pod, after, exact=False)
    old_last = max(c.last_tick for c in sb.ledger_verdict(name, after=seen[-1]).copies
                   if c.gen == 0)
    v = sb.assert_ledger(name, after=old_last, allow_replay=True,
                         timeout=30 + (old_last - seen[-1]) * sb.TICK_MS / 1000)
    new_first = min(c.first_tick for c in v.copies if c.gen > 0)
    # the state restored is the one frozen while turn 2 ended, not an older or a newer one
    assert before < new_first <= after + 1, (before, new_first, after, v.summary())
    assert old_last >= ran_on, v.summary()
    assert v.replayed == tuple(range(new_first, old_last + 1)), v.summary()
    print(f"turns with the stateful workload: {decisions}; turn 2 ended between ticks "
          f"{before} and {after}, restored from {last.checkpoint} on {moved.node} at tick "
          f"{new_first}; ticks {new_first}..{old_last} redone after the loss")
