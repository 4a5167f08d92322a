"""The fault suite, part B: the metadata endpoint misbehaves, and notices race.

The node-agent reads its notices from http://169.254.169.254, which the local cluster
DNATs, in each node's network namespace, to that node's AEMM. A scenario puts a
fault-injecting IMDS (hermit_testbed.faulty_imds, in this process, on the host bridge)
in front of one node instead: a DNAT rule inserted ahead of the cluster's, and the
node's conntrack entries for the address dropped so the agent's kept-alive connection
to AEMM does not outlive the switch. The rules go again in a ``finally``. The server's
modes are switched while the agent polls: ok, error500, garbage, broken, hang, notice,
cancelled. A notice served this way is a real notice to the agent; the node is then
terminated (hack/cluster preempt-node --no-notice) once the scenario is judged, as the
cloud would at the deadline, so no tainted node is left behind for the next test.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from hermit_common import api, protocol
from hermit_testbed import faulty_imds as fi
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import (
    LOCAL_CLUSTER_HOST,
    RELEASE_NS,
    E2EConfig,
    Kube,
    node_netns,
    wait_until,
)
from tests.faults import verdict
from tests.faults.ledger import Ledger, Row

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

Obj = dict[str, Any]
IMDS_ADDRESS = "169.254.169.254"
NOTICE_SECONDS = 30
FAULT_ANSWERS = 12  # per fault mode: a few polls' worth (a poll asks up to 4 paths)
ACT_WITHIN = 15.0  # a notice served must be acted on (a Preemption request) within this


# -- the injection ------------------------------------------------------------------------

def _netns(node: str) -> str:
    ns = node_netns(node)
    if not Path(f"/run/netns/{ns}").exists():
        pytest.skip(f"not the local cluster: no network namespace {ns}")
    return ns


def _dnat(port: int) -> list[str]:
    return ["-d", f"{IMDS_ADDRESS}/32", "-p", "tcp", "--dport", "80", "-j", "DNAT",
            "--to-destination", f"{LOCAL_CLUSTER_HOST}:{port}"]


def _in_netns(ns: str, *argv: str, check: bool = True) -> None:
    proc = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True,
                          timeout=30, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} in {ns}: {proc.stderr.strip()}")


def _forget_connections(ns: str) -> None:
    # conntrack -D exits 1 when nothing matched: not an error here.
    _in_netns(ns, "conntrack", "-D", "-p", "tcp", "--orig-dst", IMDS_ADDRESS, check=False)


@contextmanager
def faulty_metadata(node: str) -> Iterator[fi.FaultyImds]:
    """The node's metadata endpoint, served by a FaultyImds (mode ``ok``) until exit."""
    ns = _netns(node)
    with fi.FaultyImds(host=LOCAL_CLUSTER_HOST) as imds:
        rule = _dnat(imds.address[1])
        inserted = []
        try:
            for chain in ("PREROUTING", "OUTPUT"):
                _in_netns(ns, "iptables", "-t", "nat", "-I", chain, "1", *rule)
                inserted.append(chain)
            _forget_connections(ns)
            wait_until(f"the node-agent of {node} polls the faulty IMDS", 30,
                       lambda: imds.served(fi.OK) > 0, 0.2)
            yield imds
        finally:
            for chain in inserted:
                _in_netns(ns, "iptables", "-t", "nat", "-D", chain, *rule, check=False)
            _forget_connections(ns)


def _met(imds: fi.FaultyImds, mode: str, answers: int = FAULT_ANSWERS,
         notice_time: datetime | None = None) -> int:
    """Serves ``mode`` until the agent met it ``answers`` times more; returns the count."""
    before = imds.served(mode)
    imds.set(mode, notice_time)
    wait_until(f"{answers} {mode} answers", 120,
               lambda: imds.served(mode) - before >= answers, 0.2)
    return imds.served(mode) - before


def _notice(imds: fi.FaultyImds, seconds: int = NOTICE_SECONDS) -> datetime:
    when = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=seconds)
    imds.set(fi.NOTICE, when)
    return when


def _terminate(cfg: E2EConfig, node: str) -> None:
    """What the cloud does at the deadline: the node goes (and its AEMM with it)."""
    sb.lose_node(cfg, node, timeout=300)


# -- what the scenarios look at -----------------------------------------------------------

def _ckpts(ns: str, name: str, reason: str | None = None) -> list[Obj]:
    return [c for c in sb.checkpoints(ns) if c["spec"]["sandboxRef"]["name"] == name
            and (reason is None or c["spec"]["reason"] == reason)]


def _untouched(kube: Kube, ns: str, name: str, where: sb.Running, restarts: int) -> str:
    """Empty when the fault changed nothing: no checkpoint, same pod still ticking, node
    neither tainted nor cordoned, node-agent Ready without a restart; else what changed."""
    problems = []
    if _ckpts(ns, name):
        problems.append(f"checkpoints taken: {[c['metadata']['name'] for c in _ckpts(ns, name)]}")
    status = sb.status(ns, name)
    if status.get("podName") != where.pod or status.get("phase") != "Running":
        problems.append(f"sandbox moved or stopped: {status.get('phase')} {status.get('podName')}")
    node = kube.node(where.node) or {}
    spec = node.get("spec") or {}
    if spec.get("unschedulable") or any(
            t.get("key") == protocol.TAINT_INTERRUPTION for t in spec.get("taints") or []):
        problems.append(f"node {where.node} tainted or cordoned")
    if sb._agent_restarts(kube, RELEASE_NS, where.node) != restarts or \
            not sb._agent_ready(kube, RELEASE_NS, where.node):
        problems.append("node-agent restarted or not Ready")
    last = sb.ticks(kube, ns, where.pod)
    if not last or last[-1] <= where.last_tick:
        problems.append("the sandbox stopped ticking")
    return "; ".join(problems)


def _moved(kube: Kube, ns: str, name: str, where: sb.Running,
           done: frozenset[str] = frozenset()) -> tuple[verdict.Outcome, Obj]:
    """Waits for the Completed Preemption checkpoint, then judges the move it makes."""
    completed = sb.completed_checkpoint(ns, protocol.PREEMPTION, sandbox_name=name,
                                        not_in=done)
    seen = [where.last_tick]

    def probe() -> Obj | None:
        # The old pod's ticks, read until the checkpoint is Completed: the tree is frozen
        # from the dump until it is durable, so the last read holds its last tick even
        # when the operator deletes the pod (and its log) before the read after.
        seen.extend(sb.ticks(kube, ns, where.pod)[-1:])
        return completed()

    ckpt = wait_until("a Completed Preemption checkpoint", NOTICE_SECONDS + 30, probe, 0.2)
    last = sb.ticks(kube, ns, where.pod) or [max(seen)]
    outcome = verdict.judge(kube, ns, name, last[-1] if last else where.last_tick,
                            restores=where.restores + 1, avoid=where.node)
    return outcome, ckpt


def _assert_whole(outcome: verdict.Outcome) -> None:
    """Nothing lost or duplicated: the external tick ledger's ticks, then the sandbox."""
    assert outcome.ledger_lost == 0 and outcome.ledger_duplicated == 0, outcome.detail
    assert outcome.lost == 0 and outcome.duplicated == 0, outcome.detail


def _acted(ns: str, name: str) -> Obj:
    """The Preemption request the node-agent made for the sandbox (within ACT_WITHIN)."""
    found: list[Obj] = wait_until(
        "a Preemption checkpoint request", ACT_WITHIN,
        lambda: _ckpts(ns, name, protocol.PREEMPTION) or None, 0.2)
    return found[0]


def _start(kube: Kube, cfg: E2EConfig, ns: str) -> tuple[str, sb.Running]:
    sb.ensure_spot_nodes(kube, cfg, 2)
    name = f"agent-{time.monotonic_ns() % 10**6:06d}"
    sb.create_sandbox(ns, name, verdict.spec(cfg.sandbox_image, name))
    where = sb.wait_running(kube, ns, name, min_ticks=5)
    sb.wait_agent_ready(kube, RELEASE_NS, where.node)
    return name, where


def _settled_once(ns: str, name: str, where: sb.Running) -> str:
    """Empty when the sandbox moved exactly once on one Preemption checkpoint."""
    preempts = _ckpts(ns, name, protocol.PREEMPTION)
    restores = int(sb.status(ns, name).get("restores") or 0)
    if len(preempts) != 1 or restores != where.restores + 1:
        return (f"{len(preempts)} Preemption checkpoints "
                f"({[c['metadata']['name'] for c in preempts]}), restores {restores}")
    return ""


# -- the scenarios ------------------------------------------------------------------------

def _errors_then_notice(kube: Kube, cfg: E2EConfig, ns: str, ledger: Ledger, scenario: str,
                        modes: tuple[str, ...]) -> None:
    name, where = _start(kube, cfg, ns)
    restarts = sb._agent_restarts(kube, RELEASE_NS, where.node)
    try:
        with faulty_metadata(where.node) as imds:
            faults = sum(_met(imds, mode) for mode in modes)
            changed = _untouched(kube, ns, name, where, restarts)
            where = sb.Running(where.node, where.pod, where.restores,
                               sb.ticks(kube, ns, where.pod)[-1])
            started = time.monotonic()
            _notice(imds)
            _acted(ns, name)
            acted_s = sb.since(started)
            outcome, _ = _moved(kube, ns, name, where)
        once = _settled_once(ns, name, where)
    finally:
        _terminate(cfg, where.node)
    note = "; ".join(x for x in (changed and f"during the faults: {changed}", once,
                                 f"notice acted on in {acted_s} s", outcome.detail) if x)
    ledger.record(Row(scenario, faults, 1, outcome.lost, outcome.duplicated, note,
                      outcome.ledger_lost, outcome.ledger_duplicated))
    _assert_whole(outcome)
    assert not changed, f"the faults changed something: {changed}"
    assert not once, once


def test_metadata_errors_change_nothing_and_a_notice_after_them_still_moves(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        ledger: Ledger) -> None:
    _errors_then_notice(kube, e2e_config, namespace, ledger, "IMDS 500s, garbage, broken HTTP",
                        (fi.ERROR500, fi.GARBAGE, fi.BROKEN))


def test_a_hung_metadata_endpoint_does_not_stick_the_watch_loop(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        ledger: Ledger) -> None:
    # Each hung request costs the agent its request timeout (2 s): the hung answers are
    # half a minute of an endpoint that never answers.
    _errors_then_notice(kube, e2e_config, namespace, ledger, "IMDS hangs (no answer)",
                        (fi.HANG,))


def test_a_withdrawn_notice_still_moves_the_sandbox_exactly_once(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        ledger: Ledger) -> None:
    # The node-agent acts on the first sighting of a notice and never forgets it: the
    # node stays tainted and cordoned, and the move goes through (docs/faults.md).
    name, where = _start(kube, e2e_config, namespace)
    try:
        with faulty_metadata(where.node) as imds:
            _notice(imds)
            _acted(namespace, name)
            withdrawn = _met(imds, fi.CANCELLED, 4)
            outcome, _ = _moved(kube, namespace, name, where)
        once = _settled_once(namespace, name, where)
    finally:
        _terminate(e2e_config, where.node)
    ledger.record(Row("notice withdrawn (404 again)", 1, 1, outcome.lost, outcome.duplicated,
                      "; ".join(x for x in (once, f"{withdrawn} answers withdrawn",
                                            outcome.detail) if x),
                      outcome.ledger_lost, outcome.ledger_duplicated))
    _assert_whole(outcome)
    assert not once, once


def _notice_again(imds: fi.FaultyImds, first: datetime) -> None:
    _met(imds, fi.CANCELLED, 4)  # a blip, then the same notice again
    _met(imds, fi.NOTICE, 4, first)
    _met(imds, fi.NOTICE, 4, first + timedelta(seconds=15))  # another time


def test_two_notices_for_one_node_make_one_move(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        ledger: Ledger) -> None:
    name, where = _start(kube, e2e_config, namespace)
    try:
        with faulty_metadata(where.node) as imds:
            first = _notice(imds)
            _acted(namespace, name)
            with ThreadPoolExecutor(1) as pool:  # while the move is in flight
                again = pool.submit(_notice_again, imds, first)
                outcome, _ = _moved(kube, namespace, name, where)
                again.result(timeout=120)
        once = _settled_once(namespace, name, where)
    finally:
        _terminate(e2e_config, where.node)
    ledger.record(Row("notice seen twice, then another time", 2, 1, outcome.lost,
                      outcome.duplicated, "; ".join(x for x in (once, outcome.detail) if x),
                      outcome.ledger_lost, outcome.ledger_duplicated))
    _assert_whole(outcome)
    assert not once, once


def _manual_checkpoint(ns: str, name: str) -> str:
    ckpt = f"{name}-manual"
    sb.custom().create_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, {
        "apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND, "metadata": {"name": ckpt},
        "spec": {"sandboxRef": {"name": name}, "reason": protocol.MANUAL}})
    return ckpt


def _finished(ns: str, ckpt: str) -> Obj:
    def probe() -> Obj | None:
        found = [c for c in sb.checkpoints(ns) if c["metadata"]["name"] == ckpt]
        status: Obj = (found[0].get("status") or {}) if found else {}
        return status if status.get("phase") in ("Completed", "Failed") else None

    out: Obj = wait_until(f"checkpoint {ckpt} Completed or Failed", 120, probe, 0.5)
    return out


def test_a_manual_checkpoint_racing_a_notice_ends_and_the_sandbox_moves_once(
        kube: Kube, namespace: str, hermit_release: str, e2e_config: E2EConfig,
        ledger: Ledger) -> None:
    name, where = _start(kube, e2e_config, namespace)
    try:
        with faulty_metadata(where.node) as imds:
            manual = _manual_checkpoint(namespace, name)
            _notice(imds)
            _acted(namespace, name)
            outcome, _ = _moved(kube, namespace, name, where)
            ended = _finished(namespace, manual)
        once = _settled_once(namespace, name, where)
    finally:
        _terminate(e2e_config, where.node)
    phase, message = ended.get("phase"), ended.get("message") or ""
    ledger.record(Row("manual checkpoint racing a notice", 1, 1, outcome.lost,
                      outcome.duplicated, "; ".join(x for x in (
                          once, f"manual {phase} {message[:60]}".strip(), outcome.detail) if x),
                      outcome.ledger_lost, outcome.ledger_duplicated))
    _assert_whole(outcome)
    assert not once, once
    assert phase == "Completed" or message, f"manual checkpoint {phase} without a reason"
