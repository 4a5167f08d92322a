"""Many sandboxes on one spot node preempted together: what was durable before the deadline.

Against the cluster in $KUBECONFIG (hack/cluster; run it under the shared cluster lock):

    export PYTHONPATH=common:operator:node-agent:testbed
    KUBECONFIG=$(hack/cluster kubeconfig) .venv/bin/python -m bench.preempt_load \\
        [--sandboxes 30] [--mem-mb 16] [--notice 120] [--node spot-1]

It installs the chart as the e2e tests do (tests/e2e/cluster.py: this worktree's CRDs and
chart, MinIO on the host bridge, the operator on an on-demand node), creates --sandboxes
self-checking stateful sandboxes (tests/e2e/sandboxes.py) on ONE spot node (every other
node is cordoned while they start), makes sure another spot node is Ready, sends that
node a spot notice of --notice seconds (hack/cluster preempt-node) and prints, per
sandbox, when its Preemption checkpoint was durable (relative to the notice; the node is
gone at notice + --notice), the order, when it ran again and where, and whether the
workload's invariants held (its counter continues without a gap or a repeat, its own
checks pass, one live pod); and the CPU (% of one core) and RSS of every node-agent (with
its CRIU children) and of the operator, sampled every second from /proc (the local
cluster's containers are processes of this host). Everything is removed afterwards and
the preempted spot node is replaced (hack/cluster add-node --spot).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from bench.harness import counts, log, namespace, only_node, release, sandboxes, seconds
from hermit_common import api, protocol
from tests.e2e import cluster as e2e
from tests.e2e import sandboxes as sb

Obj = dict[str, Any]
CLK_TCK = os.sysconf("SC_CLK_TCK")
POLL_SECONDS = 0.5


# -- processes of this host: CPU and RSS of a process and its descendants ----------------


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def all_stats() -> dict[int, tuple[str, list[str]]]:
    """Every process of this host: pid -> (command name, the /proc/<pid>/stat fields after
    the name)."""
    out: dict[int, tuple[str, list[str]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue
        head, _, rest = text.rpartition(")")
        out[int(entry.name)] = (head.partition("(")[2], rest.split())
    return out


def children_map(stats: dict[int, tuple[str, list[str]]] | None = None
                 ) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for pid, (_, fields) in (stats if stats is not None else all_stats()).items():
        out.setdefault(int(fields[1]), []).append(pid)
    return out


def host_busy_ticks() -> tuple[int, int]:
    """(busy, total) ticks of the whole machine (/proc/stat's cpu line)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclass
class HostCpu:
    """The whole machine between the notice and the deadline: how busy its cores were and
    which commands used them (utime+stime of each process seen, summed by command name;
    a process that lived less than a sample is missed, its time goes to its parent's
    cutime, which is not counted)."""

    window: tuple[float, float] = (0.0, 0.0)
    busy: list[tuple[int, int]] = field(default_factory=list)
    first: dict[int, tuple[str, int]] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)
    opened: bool = False

    def sample(self, now: float, stats: dict[int, tuple[str, list[str]]]) -> None:
        if not (self.window[0] <= now <= self.window[1]) or self.window[1] == 0.0:
            return
        self.busy.append(host_busy_ticks())
        for pid, (comm, fields) in stats.items():
            ticks = int(fields[11]) + int(fields[12])
            if pid not in self.first:
                self.first[pid] = (comm, ticks if not self.opened else 0)
            self.last[pid] = ticks
        self.opened = True

    def summary(self, top: int = 10) -> str:
        if len(self.busy) < 2:
            return "no samples"
        (b0, t0), (b1, t1) = self.busy[0], self.busy[-1]
        cores = os.cpu_count() or 1
        by_comm: dict[str, int] = {}
        for pid, (comm, start) in self.first.items():
            by_comm[comm] = by_comm.get(comm, 0) + self.last.get(pid, start) - start
        seconds = (t1 - t0) / CLK_TCK / cores
        ranked = sorted(by_comm.items(), key=lambda kv: -kv[1])[:top]
        return (f"machine {cores} cores {100 * (b1 - b0) / max(1, t1 - t0):.0f} % busy over "
                f"{seconds:.0f} s; CPU-seconds by command: "
                + ", ".join(f"{c} {v / CLK_TCK:.1f}" for c, v in ranked))


def tree(roots: list[int], children: dict[int, list[int]]) -> set[int]:
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return seen


def cpu_ticks(pid: int) -> int:
    """utime + stime + cutime + cstime: a reaped child's time moves into its parent's."""
    fields = _stat(pid)
    return sum(int(f) for f in fields[11:15]) if fields else 0


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def operator_pids(kube: e2e.Kube, release_ns: str) -> list[int]:
    """The operator pods' processes: ``hermit-operator`` whose HOSTNAME is the pod's."""
    pods = kube.api.list_namespaced_pod(
        release_ns, label_selector="app.kubernetes.io/component=operator")
    hosts = {f"HOSTNAME={p.metadata.name}".encode() for p in pods.items if p.metadata}
    return sb.host_pids(b"hermit-operator", hosts)


@dataclass
class Series:
    """One process tree sampled every second: (monotonic time, CPU %, RSS MiB); CPU is
    None for a sample where the tree's root changed (a restart, the node gone)."""

    find: Callable[[], list[int]]
    roots: list[int] = field(default_factory=list)
    last: tuple[float, int] | None = None
    samples: list[tuple[float, float | None, float]] = field(default_factory=list)

    def sample(self, now: float, children: dict[int, list[int]]) -> None:
        if not self.roots or not all(Path(f"/proc/{p}").exists() for p in self.roots):
            self.roots, self.last = self.find(), None
        if not self.roots:
            return
        pids = tree(self.roots, children)
        ticks = sum(cpu_ticks(p) for p in pids)
        cpu = None
        if self.last is not None and now > self.last[0]:
            cpu = max(0.0, (ticks - self.last[1]) / CLK_TCK / (now - self.last[0]) * 100)
        self.last = (now, ticks)
        self.samples.append((now, cpu, sum(rss_mib(p) for p in pids)))

    def summary(self, notice_at: float) -> str:
        """Peak and mean CPU and peak RSS from the notice on (and RSS before it)."""
        before = [s for s in self.samples if s[0] < notice_at]
        during = [s for s in self.samples if s[0] >= notice_at]
        cpus = [c for _, c, _ in during if c is not None]
        if not during or not cpus:
            return "no samples"
        rss_before = max((r for *_, r in before), default=0.0)
        return (f"CPU peak {max(cpus):5.1f} % mean {statistics.fmean(cpus):5.1f} % "
                f"(of a core, {len(cpus)} s); RSS peak {max(r for *_, r in during):5.0f} MiB "
                f"(before the notice {rss_before:.0f} MiB)")


class Sampler(threading.Thread):
    """Samples every series once a second until stopped."""

    def __init__(self, series: dict[str, Series]) -> None:
        super().__init__(daemon=True)
        self.series, self.notice_at = series, 0.0
        self.host = HostCpu()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            now = time.monotonic()
            stats = all_stats()
            children = children_map(stats)
            for one in self.series.values():
                one.sample(now, children)
            self.host.sample(now, stats)
            self.stopped.wait(max(0.0, 1.0 - (time.monotonic() - now)))

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)


# -- the cluster ----------------------------------------------------------------------------


def wait_all_running(kube: e2e.Kube, ns: str, names: list[str], target: str,
                     timeout: float) -> dict[str, sb.Running]:
    def all_up() -> bool:
        objs = sandboxes(ns)
        up = 0
        for name in names:
            st = objs.get(name, {}).get("status") or {}
            assert st.get("phase") != api.PHASE_FAILED, f"{name} Failed: {st}"
            if st.get("phase") == api.PHASE_RUNNING:
                assert st.get("nodeName") == target, f"{name} runs on {st.get('nodeName')}"
                up += 1
        return up == len(names)

    e2e.wait_until(f"{len(names)} sandboxes Running on {target}", timeout, all_up, 2)
    return {n: sb.wait_running(kube, ns, n, timeout=120, min_ticks=3) for n in names}


# -- the event --------------------------------------------------------------------------------


@dataclass
class Move:
    """What happened to one sandbox, in seconds since the notice."""

    checkpoint: str = ""
    phase: str = ""
    durable_s: float | None = None
    completed_at_s: float | None = None  # status.completedAt (whole seconds) - the notice
    frozen_ms: Any = None
    started_at_s: float | None = None  # status.startedAt (whole seconds) - the notice
    dump_ms: Any = None
    upload_ms: Any = None
    size: str = ""
    last_tick: int = 0  # the old pod's last tick when the checkpoint was durable
    running_s: float | None = None
    node: str = ""
    pod: str = ""
    invariants: str = "not checked"


def _follow_checkpoints(kube: e2e.Kube, ns: str, moves: dict[str, Move],
                        before: dict[str, sb.Running], at: float, notice: datetime) -> None:
    for c in sb.checkpoints(ns):
        name = c["spec"]["sandboxRef"]["name"]
        move = moves.get(name)
        if move is None or c["spec"]["reason"] != protocol.PREEMPTION or \
                move.durable_s is not None:
            continue
        st = c.get("status") or {}
        move.checkpoint, move.phase = e2e.name_of(c), st.get("phase") or protocol.PENDING
        started = protocol.parse_time(st.get("startedAt"))
        if started is not None:
            move.started_at_s = (started - notice).total_seconds()
        if move.phase == protocol.COMPLETED:
            move.durable_s, move.frozen_ms = at, st.get("frozenMs")
            move.dump_ms, move.upload_ms = st.get("dumpMs"), st.get("uploadMs")
            move.size = str(st.get("size") or "")
            completed = protocol.parse_time(st.get("completedAt"))
            if completed is not None:
                move.completed_at_s = (completed - notice).total_seconds()
            seen = sb.ticks(kube, ns, before[name].pod)
            move.last_tick = seen[-1] if seen else 0


def _follow_sandboxes(ns: str, moves: dict[str, Move], target: str, at: float) -> None:
    for name, obj in sandboxes(ns).items():
        st, move = obj.get("status") or {}, moves.get(name)
        if move is None or move.running_s is not None:
            continue
        if st.get("phase") == api.PHASE_FAILED:
            move.invariants = f"sandbox Failed: {st.get('conditions')}"
        if (st.get("phase") == api.PHASE_RUNNING and int(st.get("restores") or 0) >= 1
                and st.get("nodeName") not in (None, target)):
            move.running_s, move.node, move.pod = at, st["nodeName"], st["podName"]


def follow(kube: e2e.Kube, ns: str, before: dict[str, sb.Running], target: str,
           notice_at: float, timeout: float) -> dict[str, Move]:
    """Polls the Checkpoints and sandboxes until every sandbox runs again elsewhere (or
    the timeout): when each checkpoint was first seen Completed and each sandbox Running."""
    moves = {name: Move() for name in before}
    notice = datetime.now(UTC) - timedelta(seconds=time.monotonic() - notice_at)
    while time.monotonic() - notice_at < timeout:
        at = time.monotonic() - notice_at
        _follow_checkpoints(kube, ns, moves, before, at, notice)
        _follow_sandboxes(ns, moves, target, at)
        if all(m.running_s is not None for m in moves.values()):
            break
        time.sleep(POLL_SECONDS)
    return moves


def check_invariants(kube: e2e.Kube, ns: str, moves: dict[str, Move]) -> None:
    """test_moves' checks: the counter continues from the checkpoint without a gap or a
    repeat, the workload answers with its checks holding, and one live pod."""
    for name, move in moves.items():
        if move.running_s is None:
            continue
        try:
            seen = sb.assert_continues(kube, ns, move.pod, move.last_tick,
                                       exact=bool(move.last_tick))
            live = [p for p in kube.api.list_namespaced_pod(
                ns, label_selector=f"{protocol.LABEL_SANDBOX}={name}").items
                if p.metadata and p.metadata.deletion_timestamp is None]
            assert len(live) == 1, f"{len(live)} live pods"
            exact = "" if move.last_tick else " (old pod's last tick unread: not exact)"
            move.invariants = f"ok, tick {seen[0]} first{exact}"
        except (AssertionError, ApiException, pytest.fail.Exception) as exc:
            move.invariants = f"BROKEN: {str(exc).splitlines()[0][:80]}"


# -- the benchmark ------------------------------------------------------------------------------


def start(kube: e2e.Kube, cfg: e2e.E2EConfig, release_ns: str, ns: str,
          args: argparse.Namespace) -> tuple[str, dict[str, sb.Running]]:
    """N sandboxes Running on one spot node, another spot node Ready to take them."""
    sb.ensure_spot_nodes(kube, cfg, 2)
    target = args.node or sb.ready_spot_nodes(kube)[0]
    sb.wait_agent_ready(kube, release_ns, target)
    names = [f"agent-{i:02d}" for i in range(args.sandboxes)]
    began = time.monotonic()
    with only_node(kube, target):
        for name in names:
            sb.create_sandbox(ns, name, sb.stateful_spec(cfg.sandbox_image, mem_mb=args.mem_mb))
        before = wait_all_running(kube, ns, names, target, args.start_timeout)
    log(f"{len(names)} sandboxes ({args.mem_mb} MiB each) Running on {target} "
        f"in {sb.since(began)} s")
    for node in sb.ready_spot_nodes(kube):
        sb.wait_agent_ready(kube, release_ns, node)
    return target, before


def _agent_finder(node: str) -> Callable[[], list[int]]:
    return lambda: sb.node_agent_pids(node)


def sampler_for(kube: e2e.Kube, release_ns: str, target: str) -> Sampler:
    nodes = [e2e.name_of(n) for n in e2e.ready_nodes(kube)]
    series = {f"node-agent {node}{' (preempted)' if node == target else ''}":
              Series(_agent_finder(node)) for node in nodes}
    series["operator"] = Series(lambda: operator_pids(kube, release_ns))
    return Sampler(series)


def preempt(kube: e2e.Kube, cfg: e2e.E2EConfig, release_ns: str, ns: str, target: str,
            before: dict[str, sb.Running], args: argparse.Namespace,
            ) -> tuple[dict[str, Move], Sampler]:
    sampler = sampler_for(kube, release_ns, target)
    sampler.start()
    e2e.wait_until("5 s of samples before the notice", 30,
                   lambda: max(len(s.samples) for s in sampler.series.values()) >= 5)
    missing = [label for label, s in sampler.series.items() if not s.samples]
    if missing:
        log(f"WARNING: no process found on this host for {', '.join(missing)}")
    follower = _follow_agent_log(kube, release_ns, target, args.agent_log)
    log(f"spot notice to {target}: {args.notice} s")
    notice_at = sampler.notice_at = time.monotonic()
    sampler.host.window = (notice_at, notice_at + args.notice)
    command = e2e.run_cluster_command(cfg.preempt_cmd, node=target, notice=str(args.notice))
    try:
        moves = follow(kube, ns, before, target, notice_at, args.notice + args.after)
    finally:
        out, _ = command.communicate(timeout=args.notice + 180)
        sampler.stop()
        if follower is not None:
            follower.terminate()
            follower.wait(timeout=10)
    assert command.returncode == 0, f"preempt command failed: {out}"
    return moves, sampler


def _follow_agent_log(kube: e2e.Kube, release_ns: str, node: str,
                      path: str) -> subprocess.Popen[bytes] | None:
    """``kubectl logs -f`` of the node's node-agent into ``path`` ("": none), from 10 s
    before the notice until the node is gone: the agent's DEBUG log of the checkpoints."""
    if not path:
        return None
    pods = [p for p in kube.api.list_namespaced_pod(
        release_ns, label_selector="app.kubernetes.io/component=node-agent").items
        if p.spec and p.spec.node_name == node and p.metadata]
    if not pods:
        log(f"WARNING: no node-agent pod on {node}: no log")
        return None
    with open(path, "wb") as out:
        return subprocess.Popen(
            ["kubectl", "--kubeconfig", os.environ["KUBECONFIG"], "logs", "-f",
             "--since=10s", "-n", release_ns, str(pods[0].metadata.name)],
            stdout=out, stderr=subprocess.STDOUT)


def report(args: argparse.Namespace, target: str, moves: dict[str, Move],
           sampler: Sampler) -> None:
    order = sorted((m.durable_s, n) for n, m in moves.items() if m.durable_s is not None)
    rank = {n: i + 1 for i, (_, n) in enumerate(order)}
    print(f"\n{len(moves)} sandboxes ({args.mem_mb} MiB workload each) on {target}, "
          f"spot notice {args.notice} s (deadline: the node is gone at +{args.notice} s); "
          f"times in seconds after the notice, first seen (polled every {POLL_SECONDS} s); "
          f"completedAt: the Checkpoint's own time (whole seconds)")
    print(f"{'#':>3} {'sandbox':10} {'checkpoint phase':17} {'durable':>8} "
          f"{'started':>7} {'completedAt':>11} {'frozen ms':>9} {'dump ms':>7} "
          f"{'upload ms':>9} "
          f"{'size':>10} {'running':>8}  {'on':12} invariants")
    for name, m in sorted(moves.items(), key=lambda kv: (rank.get(kv[0], 999), kv[0])):
        print(f"{rank.get(name, '-'):>3} {name:10} {m.phase or '-':17} {seconds(m.durable_s):>8} "
              f"{seconds(m.started_at_s):>7} {seconds(m.completed_at_s):>11} "
              f"{m.frozen_ms if m.frozen_ms is not None else '-':>9} "
              f"{m.dump_ms if m.dump_ms is not None else '-':>7} "
              f"{m.upload_ms if m.upload_ms is not None else '-':>9} {m.size or '-':>10} "
              f"{seconds(m.running_s):>8}  {m.node or '-':12} {m.invariants}")
    in_time = [(t, n) for t, n in order if t <= args.notice]
    last = f" (last at {in_time[-1][0]:.1f} s)" if in_time else ""
    print(f"\n{len(in_time)}/{len(moves)} durable before the deadline{last}; "
          f"order: {', '.join(n for _, n in order)}")
    running = sorted(m.running_s for m in moves.values() if m.running_s is not None)
    if running:
        print(f"notice->running: p50 {statistics.median(running):.1f} s, max "
              f"{running[-1]:.1f} s ({len(running)}/{len(moves)} running again); where: "
              f"{counts(m.node for m in moves.values() if m.node)}")
    held = sum(m.invariants.startswith("ok") for m in moves.values())
    print(f"invariants held: {held}/{len(moves)}")
    for label, series in sampler.series.items():
        print(f"{label:32} {series.summary(sampler.notice_at)}")
    print(f"notice to deadline: {sampler.host.summary()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sandboxes", type=int, default=30)
    parser.add_argument("--mem-mb", type=int, default=16,
                        help="the workload's patterned memory per sandbox (MiB)")
    parser.add_argument("--notice", type=int, default=120, help="spot notice (seconds)")
    parser.add_argument("--node", default="", help="the spot node (default: the first Ready)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--agent-log", default="",
                        help="write the preempted node's node-agent log there")
    parser.add_argument("--after", type=float, default=240,
                        help="how long after the deadline to wait for the sandboxes to run")
    args = parser.parse_args(argv)
    # `timeout` sends SIGTERM: unwind (uncordon, delete, uninstall) instead of dying.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with release() as rel:
        kube, cfg, release_ns = rel.kube, rel.cfg, rel.namespace
        spot_before = len(sb.ready_spot_nodes(kube))
        try:
            with namespace(kube, "bench-preempt") as ns:
                target, before = start(kube, cfg, release_ns, ns, args)
                moves, sampler = preempt(kube, cfg, release_ns, ns, target, before, args)
                check_invariants(kube, ns, moves)
                report(args, target, moves, sampler)
        finally:
            # The preempted node is gone: a spot pool replaces it (test_moves' tests
            # expect two spot nodes, ensure_spot_nodes adds them as needed too).
            sb.ensure_spot_nodes(kube, cfg, spot_before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
