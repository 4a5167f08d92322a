"""What the fault scenarios share: a seeded random source for the injection points, a
watcher that samples the sandbox's live copies on the host while it recovers, and the
probes of a migration's progress. The verdict on ticks is the external tick ledger's
(verdict.judge); the live copies sampled and the old pod's last tick read here are
cross-checks."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tests.e2e import sandboxes as sb
from tests.e2e.cluster import E2EConfig, Kube, run_cluster_command, wait_until
from tests.faults import verdict
from tests.faults.ledger import Ledger, Row

Obj = dict[str, Any]

SEED_ENV = "HERMIT_FAULTS_SEED"
IN_FLIGHT = ("Dumping", "Uploading")
BIG_MEM_MB = 384  # a dump and upload (and restore) long enough to inject a fault in it


def rng(scenario: str) -> random.Random:
    """The random source of one scenario, seeded from $HERMIT_FAULTS_SEED or the clock;
    the seed is printed so a failing run can be replayed with the same injection points."""
    seed = int(os.environ.get(SEED_ENV) or time.time_ns() % 1_000_000_007)
    print(f"{scenario}: {SEED_ENV}={seed}")
    return random.Random(seed)


def start(kube: Kube, cfg: E2EConfig, release: str, ns: str, **spec: Any
           ) -> tuple[str, sb.Running]:
    """A new self-checking sandbox carrying its marker (verdict.spec), running on a spot
    node whose node-agent is ready, with a spare spot node to move to."""
    sb.ensure_spot_nodes(kube, cfg, 2)
    name = f"agent-{time.time_ns() % 1_000_000:06d}"
    sb.create_sandbox(ns, name, verdict.spec(cfg.sandbox_image, name, **spec))
    where = sb.wait_running(kube, ns, name, min_ticks=5)
    sb.wait_agent_ready(kube, release, where.node)
    return name, where


def tree_roots(name: str) -> set[int]:
    """Host pids of the roots of the sandbox's workload trees (verdict.live_process_trees
    counts them)."""
    pids = set(sb.host_pids(b"hermit-stateful", {f"{verdict.MARKER}={name}".encode()}))
    return {pid for pid in pids if verdict._parent(pid) not in pids}


@dataclass
class CopyWatch:
    """The most live copies of a sandbox seen at once on the host, sampled every
    ``every`` seconds in a thread while the scenario injects and waits."""

    name: str
    every: float = 0.25
    most: int = 0
    samples: int = 0
    frozen: FrozenTicks | None = None  # set while a preemption is watched
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, verdict.live_process_trees(self.name))
            self.samples += 1
            self._stop.wait(self.every)

    @property
    def duplicated(self) -> int:
        return max(0, self.most - 1)


@dataclass
class FrozenTicks:
    """Per Preemption checkpoint of the sandbox, the last tick its old pod printed, read
    in a thread whenever that checkpoint is Uploading or Completed (the tree is frozen
    then, so every such read is final). It runs from the fault onward because the
    operator deletes the pod, and its log, as soon as the checkpoint is durable, which
    may be while the scenario still waits for something else."""

    kube: Kube
    ns: str
    name: str
    pod: str
    every: float = 0.1
    at: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self._sample()
                failing = False
            except Exception as e:  # the API server may be down (a fault)
                if not failing:  # once per spell, not every 0.1 s
                    print(f"tick sample failed (until it works again): {e!r}")
                failing = True
            self._stop.wait(self.every)

    def _sample(self) -> None:
        ckpt = preemption_checkpoint(self.ns, self.name, ("Uploading", "Completed"))
        if ckpt is None:
            return
        seen = sb.ticks(self.kube, self.ns, self.pod)
        if seen:
            self.at[ckpt["metadata"]["name"]] = seen[-1]


@contextmanager
def _in_thread(sampler: CopyWatch | FrozenTicks, label: str) -> Iterator[None]:
    thread = threading.Thread(target=sampler.run, name=label, daemon=True)
    thread.start()
    try:
        yield
    finally:
        sampler._stop.set()
        thread.join(timeout=10)


@contextmanager
def watching(name: str) -> Iterator[CopyWatch]:
    watch = CopyWatch(name)
    with _in_thread(watch, f"copies-{name}"):
        yield watch


def record(ledger: Ledger, scenario: str, faults: int, outcome: verdict.Outcome,
           watch: CopyWatch, note: str = "") -> Row:
    """Records the scenario's row (before it asserts): duplicated is the most copies seen
    at any sample during the recovery or at the end, less one."""
    dup = max(outcome.duplicated, watch.duplicated)
    row = Row(scenario, faults, 1, outcome.lost, dup,
              "; ".join(x for x in (note, outcome.detail,
                                    f"{watch.samples} samples, at most {watch.most} live")
                        if x), outcome.ledger_lost, outcome.ledger_duplicated)
    ledger.record(row)
    print(f"row: {row}")
    return row


def assert_row(row: Row) -> None:
    assert row.ledger_lost == 0, f"ticks lost (external ledger): {row.note}"
    assert row.ledger_duplicated == 0, f"ticks duplicated (external ledger): {row.note}"
    assert row.lost == 0, f"sandbox lost: {row.note}"
    assert row.duplicated == 0, f"duplicated live copies: {row.note}"


def preemption_checkpoint(ns: str, name: str, phases: tuple[str, ...], *,
                          not_in: set[str] | frozenset[str] = frozenset()) -> Obj | None:
    """A Preemption checkpoint of the sandbox in one of ``phases`` and not in ``not_in``."""
    for c in sb.checkpoints(ns):
        if (c["spec"]["reason"] == "Preemption" and c["spec"]["sandboxRef"]["name"] == name
                and c["metadata"]["name"] not in not_in
                and (c.get("status") or {}).get("phase") in phases):
            return c
    return None


def phase_of(ns: str, ckpt: str) -> str:
    """The phase of a checkpoint now ("Deleted" once retention removed it)."""
    for c in sb.checkpoints(ns):
        if c["metadata"]["name"] == ckpt:
            return str((c.get("status") or {}).get("phase") or "Pending")
    return "Deleted"


def durable_then_last_tick(ns: str, name: str, watch: CopyWatch, timeout: float
                           ) -> tuple[Obj, int]:
    """Waits for a Completed Preemption checkpoint of the sandbox (cut-short ones that
    Failed are passed over) and returns it with the last tick its pod printed: the
    stopping checkpoint froze the tree there (0 when no read caught the frozen tree)."""
    ckpt = wait_until("a Completed Preemption checkpoint", timeout, lambda:
                      preemption_checkpoint(ns, name, ("Completed",)), 0.1)
    frozen = watch.frozen
    assert frozen is not None, "durable_then_last_tick needs a watch from preempting()"
    if ckpt["metadata"]["name"] not in frozen.at:
        frozen._sample()  # the pod may still be there
    return ckpt, frozen.at.get(ckpt["metadata"]["name"], 0)


@contextmanager
def preempting(kube: Kube, cfg: E2EConfig, release_ns: str, ns: str, name: str,
               where: sb.Running, notice: int) -> Iterator[CopyWatch]:
    """A spot notice of ``notice`` seconds on the sandbox's node (the node goes away at
    its end), with the live copies of sandbox ``name`` watched and the ticks of its old
    pod followed; on the way out waits for the preempt command and checks it succeeded.
    The body judges the move; once it is done the notice is cut short when the command
    allows it (``E2EConfig.preempt_ends_early``): its rest is only waiting."""
    sb.wait_agent_ready(kube, release_ns, where.node)
    proc = run_cluster_command(cfg.preempt_cmd, node=where.node, notice=str(notice))
    frozen = FrozenTicks(kube, ns, name, where.pod)
    try:
        with watching(name) as watch, _in_thread(frozen, f"ticks-{name}"):
            watch.frozen = frozen
            yield watch
    finally:
        sb.end_notice(cfg, proc)
        out, _ = proc.communicate(timeout=notice + 240)
    assert proc.returncode == 0, f"preempt command failed: {out}"
