"""AgentSandboxes for the e2e tests: a workload that checks its own invariants, and the
probes that read a sandbox, its Checkpoints and its pods' output.

The workload is ``hermit-stateful`` (tests/workloads/stateful.c) from the sandbox image:
an in-memory counter printed as ``tick N`` on stdout and appended to a log in the
workspace, a background child over a pipe and a socketpair, a worker thread, a listening
TCP socket, patterned memory and an open SQLite database in the workspace, a file in the
writable layer. It verifies all of them every tick and exits non-zero, naming what
broke, when one does: a sandbox that keeps running after a move kept them all.

Every tick is also reported to the session's external tick ledger (tests/support/
ledger.py, the ``tick_ledger`` fixture): ``assert_ledger`` judges lost and duplicated
ticks from that record over the whole run; the pod log (``ticks``, ``LastTick``) is a
cross-check.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import stream
from prometheus_client.parser import text_string_to_metric_families

from hermit_common import api, protocol
from hermit_common.settings import TURN_AUDIENCE
from tests.e2e.cluster import (
    LOCAL_CLUSTER,
    RELEASE,
    REPO,
    E2EConfig,
    Kube,
    is_ready,
    is_spot,
    name_of,
    run_cluster_command,
    wait_until,
)
from tests.support import ledger

Obj = dict[str, Any]

WORKLOAD = "/bin/hermit-stateful"
TICK_MS = 200
WORKLOAD_PORT = 7000
WORKLOAD_MEM_MB = 24  # spans several 4 MiB store chunks
STATE_DIR = "/tmp/state"  # in the writable layer, writable by a non-root user
AGENT_SANDBOX_BINARY = "agent-sandbox-controller"  # hack/install-agent-sandbox builds it


def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi()


def stateful_spec(image: str, *, mem_mb: int = WORKLOAD_MEM_MB, verify_mb: int | None = None,
                  **spec: Any) -> Obj:
    """An AgentSandbox spec running the self-checking workload; ``spec`` adds fields.
    ``verify_mb``: the memory it verifies (so touches) per tick, when not its default."""
    # The sandbox runs under the restricted pod policy's default user (65532, the image
    # has no USER): its writable-layer state goes under /tmp (mode 1777), not /state.
    env = {"HERMIT_TICK_MS": str(TICK_MS), "PORT": str(WORKLOAD_PORT),
           "HERMIT_STATE_DIR": STATE_DIR, "HERMIT_TICK_LOG": "/workspace/ticks.log",
           "HERMIT_DB_PATH": "/workspace/agent.db", "HERMIT_DELETE_PATH": "",
           "HERMIT_WORKLOAD_MEM_MB": str(mem_mb)}
    if verify_mb is not None:
        env["HERMIT_WORKLOAD_VERIFY_MB"] = str(verify_mb)
    collector = ledger.current()
    if collector is not None:  # the session's external tick ledger
        env[ledger.ENV] = collector.address
    container = {"name": "agent", "image": image, "imagePullPolicy": "IfNotPresent",
                 "command": [WORKLOAD],
                 "env": [{"name": k, "value": v} for k, v in env.items()]}
    return {"podTemplate": {"spec": {"containers": [container]}}, **spec}


def create_sandbox(ns: str, name: str, spec: Obj) -> None:
    custom().create_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.SANDBOX_PLURAL, {
        "apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND,
        "metadata": {"name": name}, "spec": spec})


def patch_sandbox(ns: str, name: str, spec: Obj) -> None:
    custom().patch_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.SANDBOX_PLURAL,
                                            name, {"spec": spec})


def sandbox(ns: str, name: str) -> Obj:
    obj: Obj = custom().get_namespaced_custom_object(api.GROUP, api.VERSION, ns,
                                                     api.SANDBOX_PLURAL, name)
    return obj


def status(ns: str, name: str) -> Obj:
    out: Obj = sandbox(ns, name).get("status") or {}
    return out


def checkpoints(ns: str) -> list[Obj]:
    items: list[Obj] = custom().list_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL)["items"]
    return items


def events(kube: Kube, ns: str, name: str) -> list[Obj]:
    out = kube.api.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}")
    return [{"type": e.type, "reason": e.reason, "message": e.message} for e in out.items]


def wait_events(kube: Kube, ns: str, name: str, what: str, keep: Callable[[Obj], bool],
                timeout: float = 30) -> list[Obj]:
    """The Events about ``name`` that ``keep`` accepts, once there is one. An Event is
    posted after the status it explains (the operator's through kopf's queue), so it may
    land a moment after a wait on that status returned."""
    return wait_until(what, timeout, lambda: [e for e in events(kube, ns, name) if keep(e)]
                      or None, 0.5)


def node_runtime(kube: Kube, node: str) -> str:
    """The node's container runtime as its kubelet reports it (``containerd://2.2.9``)."""
    found = kube.node(node) or {}
    return str(found.get("status", {}).get("nodeInfo", {}).get("containerRuntimeVersion")
               or "unknown")


def ticks(kube: Kube, ns: str, pod: str) -> list[int]:
    """The ``tick N`` lines of a pod's output (empty when it has none yet)."""
    try:
        log = kube.pod_log(ns, pod)
    except ApiException:
        return []
    return [int(line.split()[1]) for line in log.splitlines()
            if line.startswith("tick ") and line.split()[1].isdigit()]


def ask(ns: str, pod: str) -> dict[str, str]:
    """The workload's answer on its TCP port, asked from inside the pod (same netns)."""
    out = stream(client.CoreV1Api().connect_get_namespaced_pod_exec, pod, ns,
                 command=["sh", "-c", f"nc 127.0.0.1 {WORKLOAD_PORT} </dev/null"],
                 stderr=True, stdin=False, stdout=True, tty=False)
    return {k: v for k, _, v in (kv.partition("=") for kv in str(out).split()) if v}


@dataclass
class Running:
    """Where a sandbox runs and how far its counter had got when we looked."""

    node: str
    pod: str
    restores: int
    last_tick: int


def wait_running(kube: Kube, ns: str, name: str, *, restores: int = 0, avoid: str = "",
                 timeout: float = 240, min_ticks: int = 5) -> Running:
    """Waits until the sandbox is Running with at least ``restores`` restores on a node
    other than ``avoid`` and its pod has printed ``min_ticks`` ticks; fails early when it
    Failed."""

    def probe() -> Running | None:
        s = status(ns, name)
        assert s.get("phase") != "Failed", f"sandbox {name} Failed: {s.get('conditions')}"
        if (s.get("phase") != "Running" or int(s.get("restores") or 0) < restores
                or not s.get("nodeName") or s.get("nodeName") == avoid):
            return None
        seen = ticks(kube, ns, s["podName"])
        if len(seen) < min_ticks:
            return None
        return Running(s["nodeName"], s["podName"], int(s.get("restores") or 0), seen[-1])

    return wait_until(f"sandbox {name} Running (restores >= {restores})", timeout, probe)


# assert_sound's default: the restore generation the workload reports equals the sandbox's
# status.restores (a fork's process image carries its original's count: pass it).
GEN_FROM_STATUS = -1
# The workload's stall window (HERMIT_STALL_MS, its default) and the ticks a stall also
# needs (STALL_TICKS in stateful.c); the memory it verifies per tick (HERMIT_WORKLOAD_VERIFY_MB).
STALL_MS = 5000
STALL_TICKS = 3
VERIFY_MB = 64
# What the workload prints on stderr that is no failure (stateful.c): everything else
# after its "hermit-stateful: " prefix is a broken invariant or a lost child.
_WORKLOAD_PREFIX = "hermit-stateful: "
_WORKLOAD_FINE = ("ok ", "restore detected")


def assert_continues(kube: Kube, ns: str, pod: str, before: int, *,
                     exact: bool = True, gen: int | None = GEN_FROM_STATUS) -> list[int]:
    """The restored pod's ticks continue the counter (not from 1), without a gap, and the
    workload's own checks hold (it answers, with its child and its database in step).
    ``exact``: its first tick follows ``before`` (a stopping checkpoint froze the tree at
    ``before``), else it may start earlier (a routine checkpoint, then a loss). Then it is
    still sound past the workload's stall window (``assert_sound``; ``gen``: the restore
    generation it must report, by default the sandbox's status.restores; None: any)."""
    def enough() -> list[int] | None:
        t = ticks(kube, ns, pod)
        return t if len(t) >= 10 else None

    seen = wait_until(f"ticks in pod {pod}", 60, enough)
    assert seen == list(range(seen[0], seen[0] + len(seen))), f"gap or repeat: {seen[:20]}"
    assert seen[0] > 1, f"the counter restarted: {seen[:5]}"
    if exact:
        assert seen[0] == before + 1, f"expected tick {before + 1} first, got {seen[:5]}"
    else:
        assert seen[0] <= before + 1, f"ticks {before + 1}..{seen[0] - 1} were skipped"
    answer = ask(ns, pod)
    assert int(answer.get("counter", "0")) >= seen[-1], answer
    if "db" in answer:
        assert int(answer["db"]) >= int(answer["counter"]) - 1, f"database behind: {answer}"
    assert_sound(kube, ns, pod, seen[0], answer, gen=gen)
    return seen


def workload_failures(log: str) -> list[str]:
    """The lines of a workload's log that report a broken invariant."""
    return [line for line in log.splitlines() if line.startswith(_WORKLOAD_PREFIX)
            and not line[len(_WORKLOAD_PREFIX):].startswith(_WORKLOAD_FINE)]


def ticks_to_be_sound(mem_mb: int, verify_mb: int = VERIFY_MB) -> int:
    """Ticks after the first restored one by which every self-check has had its chance:
    a stall of the worker thread or the child's echo has tripped, and the whole memory
    pattern has been verified once (the workload exits on any of them)."""
    return -(-STALL_MS // TICK_MS) + STALL_TICKS + -(-mem_mb // verify_mb) + 2


def assert_sound(kube: Kube, ns: str, pod: str, first: int, answer: dict[str, str], *,
                 gen: int | None = GEN_FROM_STATUS) -> None:
    """Past the workload's stall window after its first restored tick ``first``: its
    container still runs, never restarted, its log has no failure line, and its answer
    shows the worker thread and the child's echo advanced since ``answer`` (the echo a
    tick or two behind the counter) and the restore generation ``gen``
    (GEN_FROM_STATUS: the sandbox's status.restores; None: not checked)."""
    manifest = kube.pod(ns, pod) or {}
    env = {e["name"]: e.get("value", "") for c in manifest.get("spec", {}).get(
        "containers", []) for e in c.get("env") or []}
    mem_mb = int(env.get("HERMIT_WORKLOAD_MEM_MB") or 0)
    verify_mb = int(env.get("HERMIT_WORKLOAD_VERIFY_MB") or VERIFY_MB)
    # Past the stall window and a memory pass, and at least three ticks past the first
    # answer, so the thread and the echo must have moved since (the echo lags 0-2 ticks).
    target = max(first + ticks_to_be_sound(mem_mb, verify_mb),
                 int(answer.get("counter", "0")) + 3)
    wait_until(f"pod {pod} past tick {target} (its stall window and a whole memory pass)",
               60 + mem_mb / verify_mb,
               lambda: (t := ticks(kube, ns, pod)) and t[-1] >= target)
    log = kube.pod_log(ns, pod)
    assert not workload_failures(log), f"the workload in {pod} failed: {workload_failures(log)}"
    statuses = ((kube.pod(ns, pod) or {}).get("status") or {}).get("containerStatuses") or []
    for c in statuses:
        assert "running" in (c.get("state") or {}) and not c.get("restartCount"), (
            f"container {c.get('name')} of {pod} is not running as it started: {c}")
    later = ask(ns, pod)
    for key in ("threads", "seq"):
        assert key in later and int(later[key]) > int(answer.get(key, "0")), (
            f"{key} did not advance in {pod}: {answer} then {later}")
    # The child echoes each tick's sequence number a tick or two later; on a busy node (a
    # CI run restoring four sandboxes at once on two cores) it can fall a few ticks
    # behind for a moment. It must be back in step within the stall window: a child
    # that stays behind, or echoes past the counter, is out of step.
    samples: list[dict[str, str]] = [later]

    def in_step() -> bool:
        now = samples[-1]
        counter, seq = int(now.get("counter", "0")), int(now.get("seq", "-1"))
        if counter - 2 <= seq <= counter:
            return True
        assert seq <= counter, f"echo ahead of the counter in {pod}: {now}"
        samples.append(ask(ns, pod))
        return False

    try:
        wait_until(f"the child's echo in {pod} within 2 ticks of the counter", STALL_MS / 1000,
                   in_step, TICK_MS / 1000)
    except pytest.fail.Exception:
        pytest.fail(f"echo out of step in {pod} for {STALL_MS / 1000:g} s: {samples[0]} ... "
                    f"{samples[-1]}")
    later = samples[-1]
    if gen == GEN_FROM_STATUS:
        name = labels_of_pod(manifest).get(protocol.LABEL_SANDBOX, "")
        assert name, f"pod {pod} has no {protocol.LABEL_SANDBOX} label"
        gen = int(status(ns, name).get("restores") or 0)
    if gen is not None:
        assert int(later.get("gen", "-1")) == gen, (
            f"the workload counts restore generation {later.get('gen')}, expected {gen}: "
            f"{later}")


def labels_of_pod(pod: Obj) -> dict[str, str]:
    labels: dict[str, str] = (pod.get("metadata") or {}).get("labels") or {}
    return labels


def ledger_verdict(name: str, *, after: int = 0, timeout: float = 30) -> ledger.Verdict:
    """The external ledger's verdict on sandbox ``name`` once its newest copy reported a
    tick past ``after`` (what the pod log showed: the reports in flight have arrived)."""
    collector = ledger.current()
    assert collector is not None, (
        "no tick ledger: the tick_ledger fixture could not listen (HERMIT_E2E_LEDGER_HOST)")
    wait_until(f"the tick ledger of {name}'s newest copy past tick {after}", timeout,
               lambda: collector.newest_tick(name) > after, 0.2)
    return collector.verdict(name)


def attribute_fork(kube: Kube, ns: str, fork: str, pod: str, *, original: str,
                   since: float) -> None:
    """The fork ``fork`` (its pod ``pod``, created from time.monotonic() ``since`` on)
    restored ``original``'s image: its reports that still name ``original`` are the
    fork's, told apart by the pod's IP."""
    collector = ledger.current()
    assert collector is not None, "no tick ledger"
    ip = ((kube.pod(ns, pod) or {}).get("status") or {}).get("podIP")
    assert ip, f"fork pod {pod} has no IP"
    collector.attribute(fork, source=str(ip), since=since, reported_as=original)


def assert_ledger(name: str, *, after: int = 0, allow_replay: bool = False,
                  timeout: float = 30) -> ledger.Verdict:
    """The external ledger says: over the whole run of ``name``, no tick lost, none
    duplicated (``allow_replay``: ticks redone after a copy ended, the work a routine
    checkpoint loses with its node, are no duplicate), no copy's last report dropped
    (it could hide a duplicate) and nothing refused. Reports dropped inside a copy's
    span are printed, harmless (tests/support/ledger.py)."""
    v = ledger_verdict(name, after=after, timeout=timeout)
    print(f"tick ledger {name}: {v.summary()}")
    assert v.first == 1 or (bool(v.copies) and v.copies[0].gen > 0), (
        f"the ledger's first report of {name} is tick {v.first}: {v.summary()}")
    assert not v.lost, f"ticks lost: {v.summary()}"
    dup = v.concurrent if allow_replay else v.duplicated
    assert not dup, f"ticks duplicated: {v.summary()}"
    assert not v.edge_dropped and not v.refused, (
        f"a copy's last report dropped, or reports refused: the record cannot rule a "
        f"duplicate out: {v.summary()}")
    return v


class LastTick:
    """The last tick a pod printed, from every read it is asked for. A stopping checkpoint
    freezes the tree and the operator deletes the pod soon after it is durable, so one read
    after the checkpoint is Completed can come too late; reads while it is taken cannot:
    once the tree is frozen, every read is the last tick."""

    def __init__(self, kube: Kube, ns: str, pod: str) -> None:
        self._kube, self._ns, self._pod = kube, ns, pod
        self.value: int | None = None

    def read(self) -> None:
        seen = ticks(self._kube, self._ns, self._pod)
        if seen:
            self.value = max(self.value or 0, seen[-1])

    def final(self) -> int:
        """The last tick, read once more; fails when no read ever saw one."""
        self.read()
        assert self.value is not None, f"no tick of the old pod {self._pod} was ever read"
        return self.value


def durable_reading(what: str, timeout: float, probe: Callable[[], Obj | None],
                    old: list[LastTick], every: float = 0.2) -> Obj:
    """Waits for ``probe`` (a stopping checkpoint Completed), reading the last tick of each
    of the ``old`` pods before every probe: the reads while the checkpoint is taken see the
    tick it froze, so the restored pod's first tick can be asserted exactly."""

    def durable_while_reading() -> Obj | None:
        for pod in old:
            pod.read()  # the old pod is deleted soon after: read it while it is frozen
        return probe()

    return wait_until(what, timeout, durable_while_reading, every)


def ready_spot_nodes(kube: Kube) -> list[str]:
    return sorted(name_of(n) for n in kube.nodes() if is_ready(n) and is_spot(n))


def set_unschedulable(kube: Kube, node: str, unschedulable: bool = True) -> None:
    """Cordon (or uncordon) ``node`` as ``kubectl cordon`` does; a node gone meanwhile has
    nothing to uncordon."""
    body: Any = {"spec": {"unschedulable": unschedulable}}
    try:
        kube.api.patch_node(node, body)
    except ApiException as exc:
        if unschedulable or exc.status != 404:
            raise


@contextmanager
def only_schedulable_spot(kube: Kube, node: str) -> Iterator[None]:
    """While the block runs, every other Ready spot node is cordoned, so new sandboxes
    land on ``node``; uncordoned afterwards."""
    others = [n for n in ready_spot_nodes(kube) if n != node]
    try:
        for other in others:
            set_unschedulable(kube, other)
        yield
    finally:
        for other in others:
            set_unschedulable(kube, other, False)


def ensure_spot_nodes(kube: Kube, cfg: E2EConfig, count: int) -> None:
    """Adds spot nodes until ``count`` are Ready (one at a time: add-node takes a lock)."""
    while len(ready_spot_nodes(kube)) < count:
        add_spot_node(cfg)
    wait_until(f"{count} Ready spot nodes", 120, lambda: len(ready_spot_nodes(kube)) >= count)


# -- cluster actions that have no Kubernetes API: E2EConfig's commands (docs/cluster.md); ---
# -- the tests act on the cluster only through these -----------------------------------------

@contextmanager
def preempting(cfg: E2EConfig, node: str, notice: int, grace: float = 180) -> Iterator[None]:
    """A spot notice of ``notice`` seconds on ``node``, given as the body starts; after
    the body the preempt command (it ends with the node, at most ``grace`` seconds after
    the notice) must have succeeded. The body is done with the node: the rest of the
    notice is cut short when the command allows it (``E2EConfig.preempt_ends_early``)."""
    proc = run_cluster_command(cfg.preempt_cmd, node=node, notice=str(notice))
    try:
        yield
    finally:
        end_notice(cfg, proc)
        out, _ = proc.communicate(timeout=notice + grace)
    assert proc.returncode == 0, f"preempt command failed: {out}"


def end_notice(cfg: E2EConfig, proc: subprocess.Popen[str]) -> None:
    """The test is done with the node: the preempt command ends the rest of its notice at
    once when it allows that (``E2EConfig.preempt_ends_early``)."""
    if cfg.preempt_ends_early and proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)


def preempt_now(cfg: E2EConfig, node: str) -> None:
    """A cleanup: ``node`` preempted with no notice left, its outcome not judged (a node
    that keeps advising a rebalance must not be used by another test)."""
    run_cluster_command(cfg.preempt_cmd, node=node, notice="0").communicate(timeout=180)


def rebalance(cfg: E2EConfig, node: str, timeout: float = 120) -> None:
    """An AWS rebalance recommendation on ``node``, advised until the node is preempted."""
    proc = run_cluster_command(cfg.rebalance_cmd, node=node)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"rebalance command failed: {out}"


def lose_node(cfg: E2EConfig, node: str, timeout: float = 180) -> None:
    """``node`` lost without any notice (the instance gone at once)."""
    proc = run_cluster_command(cfg.lose_node_cmd, node=node)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"losing {node} failed: {out}"


def start_agent_sandbox(cfg: E2EConfig, timeout: float = 300) -> None:
    """The SIG's agent-sandbox controller running and its CRDs served (idempotent)."""
    if cfg.agent_sandbox_cmd == f"{REPO}/hack/cluster agent-sandbox":
        cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
        if not (cache / "bin" / AGENT_SANDBOX_BINARY).exists():
            pytest.fail(f"{cache}/bin/{AGENT_SANDBOX_BINARY} not found: run "
                        "hack/install-agent-sandbox (hack/bootstrap builds it)")
    proc = run_cluster_command(cfg.agent_sandbox_cmd)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{cfg.agent_sandbox_cmd} failed ({proc.returncode}): {out}"


def restart_apiserver(cfg: E2EConfig, timeout: float = 180) -> None:
    """kube-apiserver stopped and started again; returns once it answers."""
    proc = run_cluster_command(cfg.restart_apiserver_cmd)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"restarting the API server failed: {out}"


def add_spot_node(cfg: E2EConfig, timeout: float = 300) -> None:
    """One more spot node (the caller waits for it to be Ready)."""
    proc = run_cluster_command(cfg.add_node_cmd)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"add-node failed: {out}"


def completed_checkpoint(ns: str, reason: str, *, sandbox_name: str,
                         not_in: frozenset[str] | set[str] = frozenset(),
                         ) -> Callable[[], Obj | None]:
    """A probe: a Completed Checkpoint of ``reason`` of the sandbox not named in
    ``not_in``; fails on a Failed one of that reason."""

    def probe() -> Obj | None:
        for c in checkpoints(ns):
            if (c["spec"]["reason"] != reason or c["spec"]["sandboxRef"]["name"] != sandbox_name
                    or c["metadata"]["name"] in not_in):
                continue
            phase = (c.get("status") or {}).get("phase")
            assert phase != "Failed", f"checkpoint failed: {c['status'].get('message')}"
            if phase == "Completed":
                return c
        return None

    return probe


def checkpoint_now(ns: str, sandbox: str, name: str, timeout: float = 120) -> Obj:
    """A Manual checkpoint of ``sandbox``, once Completed (the operator adopts and verifies
    it: it is labelled with the node the sandbox runs on)."""
    custom().create_namespaced_custom_object(
        api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, {
            "apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
            "metadata": {"name": name},
            "spec": {"sandboxRef": {"name": sandbox}, "reason": "Manual"}})

    def done() -> Obj | None:
        c: Any = custom().get_namespaced_custom_object(
            api.GROUP, api.VERSION, ns, api.CHECKPOINT_PLURAL, name)
        phase = (c.get("status") or {}).get("phase")
        assert phase != "Failed", f"checkpoint {name} failed: {c['status'].get('message')}"
        verified = (c["metadata"].get("annotations") or {}).get(
            protocol.ANNOTATION_NODE_VERIFIED) == "true"
        return dict(c) if phase == "Completed" and verified else None

    return wait_until(f"checkpoint {name} Completed and verified", timeout, done, 0.3)


def since(started: float) -> float:
    return round(time.monotonic() - started, 1)


def host_pids(program: bytes, env_any: set[bytes], arg: bytes | None = None) -> list[int]:
    """Host pids of ``program`` (its argv[0] or argv[1] ends with it, and ``arg`` is one of
    its arguments) whose environment holds one of ``env_any`` (the local cluster shares
    this host's kernel: every node's processes are visible here)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if not any(part.endswith(program) for part in cmdline[:2]) or \
                    (arg is not None and arg not in cmdline):
                continue
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if env_any & environ:
            found.append(int(entry.name))
    return found


def node_agent_pids(node: str) -> list[int]:
    """Host pids of the node-agent serving ``node``, told apart by HERMIT_NODE_NAME and,
    when hack/test ci runs two local clusters side by side (HERMIT_CLUSTER_INSTANCE set;
    their nodes have the same names), by that cluster's cgroup of the node."""
    pids = host_pids(b"hermit-node", {f"HERMIT_NODE_NAME={node}".encode()}, b"run")
    if os.environ.get("HERMIT_CLUSTER_INSTANCE") is None:
        return pids
    return [pid for pid in pids if LOCAL_CLUSTER.runs_on(pid, node)]


def kill_node_agent(kube: Kube, release_ns: str, node: str) -> None:
    """SIGKILL the node-agent of ``node`` and wait until its pod is Ready again."""
    pids = node_agent_pids(node)
    assert pids, f"no node-agent process for {node} on this host"
    before = _agent_restarts(kube, release_ns, node)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(f"the node-agent of {node} restarted and Ready", 120,
               lambda: _agent_restarts(kube, release_ns, node) > before
               and _agent_ready(kube, release_ns, node))


def _agent_pod(kube: Kube, release_ns: str, node: str) -> Obj | None:
    pods = kube.api.list_namespaced_pod(release_ns, field_selector=f"spec.nodeName={node}")
    for p in pods.items:
        if "node-agent" in p.metadata.name:
            return {"status": p.status}
    return None


def _agent_restarts(kube: Kube, release_ns: str, node: str) -> int:
    pod = _agent_pod(kube, release_ns, node)
    statuses = (pod["status"].container_statuses or []) if pod else []
    return sum(s.restart_count for s in statuses)


def _agent_ready(kube: Kube, release_ns: str, node: str) -> bool:
    pod = _agent_pod(kube, release_ns, node)
    statuses = (pod["status"].container_statuses or []) if pod else []
    return bool(statuses) and all(s.ready for s in statuses)


def pod_annotation(kube: Kube, ns: str, pod: str, key: str) -> str | None:
    obj = kube.pod(ns, pod) or {}
    value = (obj.get("metadata", {}).get("annotations") or {}).get(key)
    return str(value) if value is not None else None


def node_agent_log(kube: Kube, release_ns: str, node: str) -> str:
    """The current log of the node-agent on ``node``."""
    pods = kube.api.list_namespaced_pod(release_ns, field_selector=f"spec.nodeName={node}")
    for p in pods.items:
        if "node-agent" in p.metadata.name:
            return str(kube.api.read_namespaced_pod_log(p.metadata.name, release_ns))
    return ""


def wait_agent_ready(kube: Kube, release_ns: str, node: str, timeout: float = 120) -> None:
    """A node that joined a moment ago may not run its node-agent yet: a notice there
    would go unseen. Wait for it (a cluster would start it with the node)."""
    wait_until(f"the node-agent of {node} Ready", timeout,
               lambda: _agent_ready(kube, release_ns, node))


def start_on_spot(kube: Kube, cfg: E2EConfig, release_ns: str, ns: str, **spec: Any
                  ) -> tuple[str, Running]:
    """A new self-checking sandbox (``spec``: stateful_spec's extras) running on a spot
    node whose node-agent is ready, with a spare spot node to move to."""
    ensure_spot_nodes(kube, cfg, 2)
    name = f"agent-{uuid.uuid4().hex[:6]}"
    create_sandbox(ns, name, stateful_spec(cfg.sandbox_image, **spec))
    where = wait_running(kube, ns, name, min_ticks=5)
    wait_agent_ready(kube, release_ns, where.node)
    return name, where


def node_agent_pod(kube: Kube, release_ns: str, node: str) -> Any:
    """The node-agent pod (a V1Pod) on ``node``; fails when there is none."""
    pods = kube.api.list_namespaced_pod(release_ns, field_selector=f"spec.nodeName={node}")
    for p in pods.items:
        if "node-agent" in p.metadata.name:
            return p
    pytest.fail(f"no node-agent pod on {node}")


def node_agent_metrics(kube: Kube, release_ns: str, node: str) -> str:
    """The /metrics text of the node-agent on ``node``, through the API server's pod proxy."""
    name = node_agent_pod(kube, release_ns, node).metadata.name
    return str(kube.api.connect_get_namespaced_pod_proxy_with_path(
        f"{name}:{METRICS_PORT}", release_ns, "metrics"))


def exec_sh(ns: str, pod: str, script: str) -> str:
    """``sh -c script`` in the pod's first container: its stdout and stderr."""
    return str(stream(client.CoreV1Api().connect_get_namespaced_pod_exec, pod, ns,
                      command=["sh", "-c", script], stderr=True, stdin=False, stdout=True,
                      tty=False))


# -- callers of the turn endpoint (docs/turns.md) -------------------------------------------

def idle_turn_spec(image: str) -> dict[str, Any]:
    """An agent that sleeps between turns; the turns are kubectl execs."""
    return {"podTemplate": {"spec": {"containers": [{
                "name": "agent", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sleep", "1000000"]}]}},
            "checkpoint": {"onTurn": True}}


def wait_turn_sandbox(ns: str, name: str, *, restores: int = 0,
                      avoid: str = "") -> tuple[str, str]:
    """(node, pod) once the sandbox is Running with ``restores`` restores off ``avoid``
    (the idle agent prints no ticks for wait_running to count)."""
    def probe() -> tuple[str, str] | None:
        s = status(ns, name)
        assert s.get("phase") != "Failed", f"sandbox {name} Failed: {s.get('conditions')}"
        if (s.get("phase") == "Running" and int(s.get("restores") or 0) >= restores
                and s.get("nodeName") and s.get("nodeName") != avoid):
            return str(s["nodeName"]), str(s["podName"])
        return None

    return wait_until(f"sandbox {name} Running (restores >= {restores})", 240, probe)


def service_account_token(ns: str, account: str, audiences: list[str] | None = None) -> str:
    """A token of a new service account for the turn endpoint's audience (the chart's
    default), or for ``audiences`` ([]: the API server's own)."""
    core = client.CoreV1Api()
    core.create_namespaced_service_account(ns, {"metadata": {"name": account}})
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    wanted = [TURN_AUDIENCE] if audiences is None else audiences
    if wanted:
        spec["audiences"] = wanted
    out = core.create_namespaced_service_account_token(account, ns, {"spec": spec})
    return str(out.status.token)


def turn_harness_token(ns: str, account: str = "harness") -> str:
    """A token of a new service account bound to the chart's turn-client role in ``ns``."""
    token = service_account_token(ns, account)
    client.RbacAuthorizationV1Api().create_namespaced_role_binding(ns, {
        "metadata": {"name": account},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": f"{RELEASE}-turn-client"},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}]})
    return token


# -- what an operator's user looks at: /metrics and kubectl get ----------------------------

METRICS_PORT = 9101  # the chart's metrics.port


def operator_metrics(kube: Kube, release_ns: str) -> dict[str, str]:
    """The /metrics text of every running operator pod, read through the API server's
    pod proxy (no port-forward, and the same on any cluster)."""
    pods = kube.api.list_namespaced_pod(
        release_ns, label_selector="app.kubernetes.io/component=operator")
    return {p.metadata.name: str(kube.api.connect_get_namespaced_pod_proxy_with_path(
        f"{p.metadata.name}:{METRICS_PORT}", release_ns, "metrics"))
        for p in pods.items if p.status.phase == "Running"}


def metric_sum(texts: dict[str, str], sample: str, **labels: str) -> float:
    """The sum of ``sample`` (e.g. ``..._count``) over every label set that has
    ``labels`` and every text."""
    return sum(s.value for text in texts.values()
               for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == sample
               and all(s.labels.get(k) == v for k, v in labels.items()))


def kubectl_table(kubectl: str, kubeconfig: str, *args: str) -> list[dict[str, str]]:
    """``kubectl get <args>`` as rows of {COLUMN: value} (columns are at least two spaces
    apart; kubectl prints <none> for an empty field)."""
    out = kubectl_text(kubectl, kubeconfig, *args)
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines:
        return []
    header = lines[0]
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)]
    names = [header[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return [{n: line[a:b].strip() for n, a, b in zip(names, starts, [*starts[1:], None],
                                                      strict=True)} for line in lines[1:]]


def kubectl_text(kubectl: str, kubeconfig: str, *args: str) -> str:
    proc = subprocess.run([kubectl, "get", *args, "--kubeconfig", kubeconfig],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def kubectl_binary() -> str:
    path = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit")) / "bin/kubectl"
    if not path.exists():
        pytest.fail(f"kubectl not found at {path}: run hack/install-k8s")
    return str(path)


@contextmanager
def draining(cfg: E2EConfig, node: str) -> Iterator[subprocess.Popen[str]]:
    """``kubectl drain NODE`` running; on the way out it is killed if still running and
    the node uncordoned."""
    kubectl = kubectl_binary()
    drain = subprocess.Popen(
        [kubectl, "drain", node, "--ignore-daemonsets", "--delete-emptydir-data",
         "--timeout=180s", "--kubeconfig", cfg.kubeconfig],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield drain
    finally:
        if drain.poll() is None:
            drain.kill()
        subprocess.run([kubectl, "uncordon", node, "--kubeconfig", cfg.kubeconfig],
                       capture_output=True, check=False)


# -- acting as a node-agent (the attack suite): its service account and a token bound to ---
# -- one of its pods, which names that pod's node as the real agent's does ------------------

def service_account(kube: Kube, release_ns: str, component: str) -> str:
    """The service account the chart's pods of this component run as."""
    pods = kube.api.list_namespaced_pod(
        release_ns, label_selector=f"app.kubernetes.io/component={component}").items
    assert pods, f"no {component} pod in {release_ns}"
    return str(pods[0].spec.service_account_name)


def node_agent_pod_name(kube: Kube, release_ns: str, node: str) -> str:
    """The name of the running node-agent pod on ``node``."""
    pods = kube.api.list_namespaced_pod(
        release_ns, label_selector="app.kubernetes.io/component=node-agent",
        field_selector=f"spec.nodeName={node}").items
    running = [p.metadata.name for p in pods if p.status.phase == "Running"]
    assert running, f"no running node-agent pod on {node}"
    return str(running[0])


def node_agent_api_client(cfg: E2EConfig, kube: Kube, release_ns: str,
                          pod: str) -> client.ApiClient:
    """An API client holding a token of the node-agent's service account bound to its pod
    ``pod`` (``kubectl create token --bound-object-kind Pod``): since Kubernetes 1.32 it
    carries the pod's node, so the chart's node-scoped policies judge it exactly as they
    judge that node-agent."""
    token = subprocess.run(
        [kubectl_binary(), "--kubeconfig", cfg.kubeconfig, "-n", release_ns, "create",
         "token", service_account(kube, release_ns, "node-agent"), "--bound-object-kind",
         "Pod", "--bound-object-name", pod, "--duration", "10m"],
        capture_output=True, text=True, check=True).stdout.strip()
    admin = kube.api.api_client.configuration
    conf = client.Configuration()
    conf.host, conf.ssl_ca_cert = admin.host, admin.ssl_ca_cert
    conf.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(conf)
