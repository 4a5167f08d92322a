"""Many forks of one checkpoint created at once: how soon each runs, and what the node's
chunk cache saved (issue 20, point 6: "fan-out that scales").

Against the cluster in $KUBECONFIG (hack/cluster; run it under the shared cluster lock):

    export PYTHONPATH=common:operator:node-agent:testbed
    KUBECONFIG=$(hack/cluster kubeconfig) .venv/bin/python -m bench.fork_fanout \\
        [--forks 20] [--mem-mb 256] [--nodes N] [--one-node] [--node spot-1] \\
        [--chunk-cache-bytes 2147483648] [--helm-set nodeAgent.lazyRestore=true] [--keep]

It installs the chart as the e2e tests do (bench/harness.py: tests/e2e/cluster.py's
fixtures, with ``nodeAgent.chunkCacheBytes`` set: the cache is off by default), makes
sure --nodes spot nodes are Ready (hack/cluster add-node --spot), creates one
self-checking stateful sandbox (tests/e2e/sandboxes.py) holding --mem-mb of patterned
memory, takes a Manual checkpoint of it, then creates --forks AgentSandboxes with
``spec.restoreFrom`` that checkpoint back to back (--one-node: every node but one spot
node cordoned, so they all restore on that node). It follows them (pods and sandboxes
polled every POLL_SECONDS; the first tick of each fork's pod from the tick ledger, which
timestamps every report as it arrives) and prints per fork: create -> pod created, pod
created -> its containers running, pod running -> Restored (the node-agent's
restore-phase) -> first tick, create -> sandbox Running, its node, the node-agent's
restore-message (time, chunks from the cache), restore retries (the most
status.restoreAttempts seen, failed restore messages, RestoreFailed Events) and whether
the fork continues the checkpoint's counter with the workload's own checks holding; and a
summary: forks running, p50/max of create -> Running and of pod start -> first tick,
chunks from S3 vs from the cache per node, and the issue's targets as figures (all
running within 30 s; first tick within 5 s of the pod starting).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

import pytest
from kubernetes.client.exceptions import ApiException

from bench.fanout_figures import (
    Restore,
    cache_by_node,
    mib,
    parse_restore_message,
    spread,
    targets,
)
from bench.harness import Release, counts, log, namespace, only_node, release, sandboxes, seconds
from hermit_common import api, protocol
from tests.e2e import cluster as e2e
from tests.e2e import sandboxes as sb
from tests.support import ledger
from tests.support.wait import wait_until

POLL_SECONDS = 0.25
RUNNING_WITHIN_S = 30.0  # the targets
FIRST_TICK_WITHIN_S = 5.0
SOURCE = "source"


@dataclass
class PodSeen:
    """One pod of a fork, as first seen by the poll (time.monotonic())."""

    seen_at: float
    created: datetime | None  # metadata.creationTimestamp (whole seconds)
    node: str = ""
    ip: str = ""
    running_at: float | None = None  # every container running (hermit-init waits)
    restored_at: float | None = None  # restore-phase Restored
    restore_message: str = ""


@dataclass
class Fork:
    name: str
    created_at: float  # time.monotonic() just before its create call
    pods: dict[str, PodSeen] = field(default_factory=dict)
    running_at: float | None = None  # sandbox phase Running first seen
    node: str = ""
    pod: str = ""
    failed: str = ""
    attempts: int = 0  # the most status.restoreAttempts seen (reset by a success)
    restore_failures: list[str] = field(default_factory=list)
    first_tick_at: float | None = None
    first_tick_from: str = ""  # "ledger" (arrival time) or "log" (first poll that saw it)
    events: list[str] = field(default_factory=list)
    invariants: str = "not checked"
    ledger: str = ""

    @property
    def final(self) -> PodSeen | None:
        return self.pods.get(self.pod)

    def since_create(self, at: float | None) -> float | None:
        return at - self.created_at if at is not None else None

    @property
    def to_pod(self) -> float | None:
        first = min((p.seen_at for p in self.pods.values()), default=None)
        return self.since_create(first)

    @property
    def pod_to_running(self) -> float | None:
        p = self.final
        return p.running_at - p.seen_at if p and p.running_at is not None else None

    @property
    def start_to_restored(self) -> float | None:
        p = self.final
        if p is None or p.running_at is None or p.restored_at is None:
            return None
        return p.restored_at - p.running_at

    @property
    def start_to_tick(self) -> float | None:
        p = self.final
        if p is None or p.running_at is None or self.first_tick_at is None:
            return None
        return self.first_tick_at - p.running_at

    @property
    def restore(self) -> Restore | None:
        p = self.final
        return parse_restore_message(p.restore_message) if p else None


# -- the source and its checkpoint --------------------------------------------------------------


def source_checkpoint(rel: Release, ns: str, args: argparse.Namespace
                      ) -> tuple[str, int, int, int]:
    """The source sandbox Running with --mem-mb of memory and a Manual checkpoint of it:
    (checkpoint name, the source's last tick before it was taken, the last tick once it
    was Completed, its size in bytes). The source keeps running: a fork's first tick
    lies between the two ticks + 1."""
    began = time.monotonic()
    sb.create_sandbox(ns, SOURCE, sb.stateful_spec(rel.cfg.sandbox_image, mem_mb=args.mem_mb))
    where = sb.wait_running(rel.kube, ns, SOURCE, timeout=args.start_timeout, min_ticks=5)
    log(f"source sandbox Running on {where.node} ({args.mem_mb} MiB) in {sb.since(began)} s")
    # It writes its whole pattern before the first tick (every page is resident); the
    # checkpoint waits until it verified all of it once and its stall window passed.
    wait_until("the source past a whole memory pass", 120 + args.mem_mb / sb.VERIFY_MB,
               lambda: (t := sb.ticks(rel.kube, ns, where.pod))
               and t[-1] >= where.last_tick + sb.ticks_to_be_sound(args.mem_mb))
    before = sb.ticks(rel.kube, ns, where.pod)[-1]
    began = time.monotonic()
    ckpt = sb.checkpoint_now(ns, SOURCE, "fanout-source", timeout=args.start_timeout)
    after = sb.ticks(rel.kube, ns, where.pod)[-1]
    st = ckpt.get("status") or {}
    size = int(st.get("imageBytes") or 0)
    log(f"checkpoint {e2e.name_of(ckpt)} Completed in {sb.since(began)} s "
        f"(images {mib(size)}, stored {mib(int(st.get('storedBytes') or 0))}, dump "
        f"{st.get('dumpMs')} ms, upload {st.get('uploadMs')} ms; source ticks "
        f"{before}..{after})")
    return e2e.name_of(ckpt), before, after, size


# -- the fan-out ---------------------------------------------------------------------------------


def create_forks(rel: Release, ns: str, checkpoint: str, count: int, mem_mb: int
                 ) -> dict[str, Fork]:
    """``count`` forks created back to back (one create call after the other, no waits).
    Their spec is the source's (its env names the memory the restored image holds, which
    the checks read), plus restoreFrom."""
    forks: dict[str, Fork] = {}
    for i in range(count):
        name = f"fork-{i:02d}"
        forks[name] = Fork(name, time.monotonic())
        sb.create_sandbox(ns, name, sb.stateful_spec(rel.cfg.sandbox_image, mem_mb=mem_mb,
                                                     restoreFrom=checkpoint))
    first = min(f.created_at for f in forks.values())
    log(f"{count} forks of {checkpoint} created in {time.monotonic() - first:.2f} s")
    return forks


def _follow_pods(rel: Release, ns: str, forks: dict[str, Fork], now: float) -> None:
    pods = rel.kube.api.list_namespaced_pod(ns, label_selector=protocol.LABEL_SANDBOX)
    for p in pods.items:
        meta = p.metadata
        if meta is None or not meta.name:
            continue
        fork = forks.get((meta.labels or {}).get(protocol.LABEL_SANDBOX, ""))
        if fork is None:
            continue
        seen = fork.pods.setdefault(str(meta.name), PodSeen(now, meta.creation_timestamp))
        seen.node = (p.spec.node_name if p.spec else None) or seen.node
        seen.ip = (p.status.pod_ip if p.status else None) or seen.ip
        statuses = (p.status.container_statuses if p.status else None) or []
        if seen.running_at is None and statuses and all(
                c.state is not None and c.state.running is not None for c in statuses):
            seen.running_at = now
        notes = meta.annotations or {}
        phase = notes.get(protocol.ANNOTATION_RESTORE_PHASE)
        message = str(notes.get(protocol.ANNOTATION_RESTORE_MESSAGE) or "")
        if phase == protocol.RESTORED and seen.restored_at is None:
            seen.restored_at, seen.restore_message = now, message
        elif phase == protocol.RESTORE_FAILED:
            failure = f"{meta.name}: {message}"[:160]
            if failure not in fork.restore_failures:
                fork.restore_failures.append(failure)


def _follow_sandboxes(ns: str, forks: dict[str, Fork], now: float) -> None:
    for name, obj in sandboxes(ns).items():
        fork, st = forks.get(name), obj.get("status") or {}
        if fork is None:
            continue
        fork.attempts = max(fork.attempts, int(st.get("restoreAttempts") or 0))
        if st.get("phase") == api.PHASE_FAILED and not fork.failed:
            fork.failed = f"Failed: {st.get('conditions')}"[:160]
        if st.get("phase") == api.PHASE_RUNNING and fork.running_at is None:
            fork.running_at, fork.node, fork.pod = now, st.get("nodeName") or "", \
                st.get("podName") or ""


def _ledger_first_ticks(collector: ledger.Collector, forks: dict[str, Fork],
                        start: int) -> None:
    """The arrival of each fork's first ledger report (its first restored tick): a report
    from one of its pods' IPs since its create (a fork may report under the source's name,
    kept by the restored UTS namespace: the IP tells it apart). ``start``: the records
    before the fan-out, skipped."""
    by_ip = {p.ip: f for f in forks.values() if f.first_tick_at is None
             for p in f.pods.values() if p.ip}
    if not by_ip:
        return
    for r in collector.records[start:]:  # a slice: a copy, the collector appends
        fork = by_ip.get(r.source)
        if fork is not None and r.received >= fork.created_at and (
                fork.first_tick_at is None or r.received < fork.first_tick_at):
            fork.first_tick_at, fork.first_tick_from = r.received, "ledger"


def _log_first_tick(rel: Release, ns: str, fork: Fork, now: float) -> None:
    """Without a ledger: the first poll that saw a tick in the running pod's log."""
    seen = fork.final
    if seen is not None and seen.running_at is not None and fork.first_tick_at is None \
            and sb.ticks(rel.kube, ns, fork.pod):
        fork.first_tick_at, fork.first_tick_from = now, "log"


def follow(rel: Release, ns: str, forks: dict[str, Fork], timeout: float,
           ledger_start: int) -> None:
    """Polls pods and sandboxes until every fork made its first tick and is Running (or
    Failed, or the timeout)."""
    began = time.monotonic()
    collector = ledger.current()
    while time.monotonic() - began < timeout:
        now = time.monotonic()
        _follow_pods(rel, ns, forks, now)
        _follow_sandboxes(ns, forks, now)
        if collector is not None:
            _ledger_first_ticks(collector, forks, ledger_start)
        else:
            for fork in forks.values():
                _log_first_tick(rel, ns, fork, now)
        # Done when each fork ticked and its sandbox says Running (the two come in
        # either order), or it Failed.
        if all((f.first_tick_at is not None and f.running_at is not None) or f.failed
               for f in forks.values()):
            return
        time.sleep(max(0.0, POLL_SECONDS - (time.monotonic() - now)))
    log(f"WARNING: not every fork ticked within {timeout:.0f} s")


def check_forks(rel: Release, ns: str, forks: dict[str, Fork], before: int, after: int
                ) -> None:
    """test_moves' fork checks on each one (its counter continues from the checkpoint's
    tick, no gap or repeat, the workload's own checks hold, one live pod, restore
    generation 1), its ledger verdict and its restore Events; a broken one is reported,
    not raised."""
    for fork in forks.values():
        fork.events = [f"{e['reason']}: {e['message']}"[:160]
                       for e in sb.events(rel.kube, ns, fork.name)
                       if e["type"] == "Warning" or e["reason"] == api.REASON_RESTORE_FAILED]
        if not fork.pod:
            fork.invariants = fork.failed or "never Running"
            continue
        try:
            seen = sb.assert_continues(rel.kube, ns, fork.pod, after, exact=False)
            assert seen[0] >= before + 1, (
                f"first tick {seen[0]} precedes the checkpoint (source was at {before})")
            live = [p for p in rel.kube.api.list_namespaced_pod(
                ns, label_selector=f"{protocol.LABEL_SANDBOX}={fork.name}").items
                if p.metadata and p.metadata.deletion_timestamp is None]
            assert len(live) == 1, f"{len(live)} live pods"
            fork.invariants = f"ok, tick {seen[0]} first"
        except (AssertionError, ApiException, pytest.fail.Exception) as exc:
            fork.invariants = f"BROKEN: {str(exc).splitlines()[0][:100]}"
        collector, final = ledger.current(), fork.final
        if collector is not None and final is not None and final.ip:
            collector.attribute(fork.name, source=final.ip, since=fork.created_at,
                                reported_as=SOURCE)
            v = collector.verdict(fork.name)
            fork.ledger = "clean" if not (v.lost or v.duplicated) else f"BROKEN: {v.summary()}"


# -- the report -------------------------------------------------------------------------------


def report(args: argparse.Namespace, checkpoint: str, size: int,
           forks: dict[str, Fork]) -> None:
    total = len(forks)
    print(f"\n{total} forks of {checkpoint} ({args.mem_mb} MiB workload"
          + (f", {mib(size)} of images" if size else "") + "), created back to back; "
          f"seconds, first seen by a poll every {POLL_SECONDS} s (the first tick: the tick "
          "ledger's arrival time when it says so)")
    print(f"{'fork':8} {'->pod':>6} {'pod->run':>8} {'run->rst':>8} {'run->tick':>9} "
          f"{'->Running':>9} {'node':10} {'pods':>4} {'tries':>5} {'restore ms':>10} "
          f"{'S3/cached':>10}  invariants")
    for name, f in sorted(forks.items()):
        r = f.restore
        print(f"{name:8} {seconds(f.to_pod):>6} {seconds(f.pod_to_running):>8} "
              f"{seconds(f.start_to_restored):>8} {seconds(f.start_to_tick):>9} "
              f"{seconds(f.since_create(f.running_at)):>9} {f.node or '-':10} "
              f"{len(f.pods):>4} {f.attempts:>5} {r.ms if r else '-':>10} "
              f"{f'{r.from_store}/{r.cached}' if r else '-':>10}  {f.invariants}"
              + (f"; ledger {f.ledger}" if f.ledger else "")
              + (" (first tick from the log)" if f.first_tick_from == "log" else ""))
    for name, f in sorted(forks.items()):
        final = f.final
        if final is not None and final.restore_message and f.restore is None:
            print(f"  {name} restore-message: {final.restore_message}")
        for line in [*f.restore_failures, *f.events]:
            print(f"  {name} restore trouble: {line}")
    running = [f.since_create(f.running_at) for f in forks.values()]
    ticks = [f.start_to_tick for f in forks.values()]
    print(f"\nforks running: {sum(v is not None for v in running)}/{total}; where: "
          f"{counts(f.node for f in forks.values() if f.node)}")
    print(f"create -> Running:         {spread(running, total)}")
    print(f"create -> pod created:     {spread((f.to_pod for f in forks.values()), total)}")
    print(f"pod created -> running:    "
          f"{spread((f.pod_to_running for f in forks.values()), total)}")
    print(f"pod running -> Restored:   "
          f"{spread((f.start_to_restored for f in forks.values()), total)}")
    print(f"pod running -> first tick: {spread(ticks, total)}")
    print(f"create -> first tick:      "
          f"{spread((f.since_create(f.first_tick_at) for f in forks.values()), total)}")
    retried = [f.name for f in forks.values() if f.attempts or f.restore_failures
               or len(f.pods) > 1]
    print(f"restores retried: {len(retried)}/{total}" + (f" ({', '.join(retried)})"
                                                        if retried else ""))
    held = sum(f.invariants.startswith("ok") for f in forks.values())
    print(f"invariants held: {held}/{total}")
    print("chunk cache (S3 chunks per restore: the store's share; 0: all from the cache):")
    restored = [(f.node, (f.final.restored_at or 0.0) if f.final else 0.0, f.restore)
                for f in forks.values() if f.node]
    for line in cache_by_node(restored):
        print(f"  {line}")
    for line in targets(total, running, ticks, running_within=RUNNING_WITHIN_S,
                        tick_within=FIRST_TICK_WITHIN_S):
        print(line)


# -- the benchmark ------------------------------------------------------------------------------


def spot_nodes(rel: Release, args: argparse.Namespace) -> list[str]:
    """The Ready spot nodes, --nodes of them at least (added as needed)."""
    sb.ensure_spot_nodes(rel.kube, rel.cfg, max(1, args.nodes))
    nodes = sb.ready_spot_nodes(rel.kube)
    for node in nodes:
        sb.wait_agent_ready(rel.kube, rel.namespace, node)
    return nodes


@contextlib.contextmanager
def placement(rel: Release, args: argparse.Namespace, nodes: list[str]) -> Iterator[str]:
    """--one-node: every other node cordoned while the forks start and run (a retried
    restore makes a new pod); the node's name, else ""."""
    if not args.one_node:
        yield ""
        return
    target = args.node or nodes[0]
    with only_node(rel.kube, target):
        yield target


def run(rel: Release, ns: str, args: argparse.Namespace) -> None:
    nodes = spot_nodes(rel, args)
    log(f"Ready spot nodes: {', '.join(nodes)}")
    checkpoint, before, after, size = source_checkpoint(rel, ns, args)
    with placement(rel, args, nodes) as target:
        if target:
            log(f"--one-node: every node but {target} cordoned")
        ledger_start = len(rel.ledger.records) if rel.ledger is not None else 0
        forks = create_forks(rel, ns, checkpoint, args.forks, args.mem_mb)
        follow(rel, ns, forks, args.timeout, ledger_start)
        check_forks(rel, ns, forks, before, after)
    report(args, checkpoint, size, forks)


def keep_until_interrupted(ns: str) -> None:
    """--keep: everything stays (the release's MinIO is this process's child) until
    Ctrl-C or SIGTERM; then the clean-up runs."""
    log(f"--keep: namespace {ns} kept; Ctrl-C (or SIGTERM) cleans up")
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        threading.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forks", type=int, default=20)
    parser.add_argument("--mem-mb", type=int, default=256,
                        help="the source workload's patterned memory (MiB)")
    parser.add_argument("--nodes", type=int, default=0,
                        help="spot nodes to spread over, added as needed (default: the "
                        "Ready ones, at least one)")
    parser.add_argument("--one-node", action="store_true",
                        help="cordon every node but one spot node: all forks on it")
    parser.add_argument("--node", default="",
                        help="--one-node's node (default: the first Ready spot node)")
    parser.add_argument("--chunk-cache-bytes", type=int, default=2 * 1024**3,
                        help="nodeAgent.chunkCacheBytes (0: the chart's default, no cache)")
    parser.add_argument("--helm-set", action="append", default=[], metavar="KEY=VALUE",
                        help="another chart value for this run (repeatable)")
    parser.add_argument("--start-timeout", type=float, default=600,
                        help="for the source to run and its checkpoint to complete")
    parser.add_argument("--timeout", type=float, default=300,
                        help="for every fork's first tick")
    parser.add_argument("--keep", action="store_true",
                        help="keep everything until Ctrl-C, then clean up")
    args = parser.parse_args(argv)
    # `timeout` sends SIGTERM: unwind (uncordon, delete, uninstall) instead of dying.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with release() as rel:
        if rel.ledger is None:
            log("WARNING: no tick ledger: first ticks are timed from the pod logs")
        for value in [f"nodeAgent.chunkCacheBytes={args.chunk_cache_bytes}", *args.helm_set]:
            e2e.helm_set(rel.cfg, rel.namespace, value)
        with namespace(rel.kube, "bench-fanout") as ns:
            try:
                run(rel, ns, args)
            finally:
                if args.keep:
                    keep_until_interrupted(ns)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
