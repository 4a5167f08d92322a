"""The turn benchmark: agent traces replayed under four checkpoint policies, side by side.

    PYTHONPATH=common:operator:node-agent:testbed .venv/bin/python -m bench.turns [--quick]

One run, one machine, one MinIO: for each sandbox size (MiB of memory the sandbox holds)
and each contender (full CRIU dump per turn with gzip and a plain upload; Hermit at a fixed
interval; Hermit turn-aware; checkpointing off) a fresh sandbox replays the trace, then
gets a spot notice; its final checkpoint and the one a crash at a random turn would
leave are restored on a second node and checked. Prints a table and the targets of
issue #11, and writes the same figures as a PNG chart (its path is printed).
See bench/README.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.turnbench import report, sandbox, trace
from bench.turnbench.contenders import CONTENDERS, FullDumpStore
from bench.turnbench.run import Env, Outcome, run_contender
from hermit_common.store import CheckpointStore
from hermit_node.host.criu import Criu
from hermit_testbed.cni import CniNetwork
from hermit_testbed.containerd import Containerd
from hermit_testbed.minio import MinioServer, start_minio, stop_minio
from hermit_testbed.scenario import Node, hermit_bin


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--trace", default="mixed", help="a trace in bench/traces or a JSON path")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 1024],
                   help="MiB of memory the sandbox holds (default: 64 1024)")
    p.add_argument("--big-turns", type=int, default=6,
                   help="turns replayed for sizes of 512 MiB and more (default 6)")
    p.add_argument("--interval", type=float, default=30.0,
                   help="seconds between the interval contender's checkpoints (default 30, "
                        "the smallest spec.checkpoint.intervalSeconds)")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=CONTENDERS)
    p.add_argument("--seed", type=int, default=None, help="picks the crash turn")
    p.add_argument("--turns", type=int, default=None, help="replay only the first N turns")
    p.add_argument("--wait-scale", type=float, default=1.0,
                   help="multiply the model's think times (default 1: the trace's 2-10 s)")
    p.add_argument("--quick", action="store_true",
                   help="for development: 4 turns, think times x0.25, interval 10 s")
    p.add_argument("--chart", type=Path, default=Path("turn-bench.png"))
    return p.parse_args(argv)


def _trace_for(args: argparse.Namespace, base: trace.Trace, mem_mb: int) -> trace.Trace:
    if args.quick:
        return trace.shortened(base, 4, 0.25)
    turns = args.big_turns if mem_mb >= 512 else None
    if args.turns:
        turns = min(turns or args.turns, args.turns)
    return trace.shortened(base, turns, args.wait_scale)


def _measure(env: Env, args: argparse.Namespace, base: trace.Trace,
             rng: random.Random) -> list[report.Figures]:
    rows: list[report.Figures] = []
    for mem_mb in args.sizes:
        t = _trace_for(args, base, mem_mb)
        crash_turn = rng.randrange(len(t.turns))
        outcomes: dict[str, Outcome] = {}
        for name in args.contenders:
            began = time.monotonic()
            outcomes[name] = run_contender(env, name, mem_mb, t, crash_turn)
            print(f"measured {name} {mem_mb} MiB in {time.monotonic() - began:.0f} s",
                  file=sys.stderr, flush=True)
            for i, d in enumerate(outcomes[name].decisions):
                print(f"  turn {i} ({t.turns[i].kind}): {d.decision}: {'; '.join(d.reasons)}",
                      file=sys.stderr, flush=True)
            _print_restores(outcomes[name])
        off = outcomes.get("off")
        rows += [report.figures(o, off) for o in outcomes.values()]
    return rows


def _print_restores(out: Outcome) -> None:
    """Where each restore's time to running went, on stderr."""
    for kind, check in (("full", out.notice_restore), ("lazy", out.lazy_restore),
                        ("crash", out.crash)):
        if check is not None and check.phases:
            print(f"  {kind} restore of {check.checkpoint}: {check.phases}", file=sys.stderr,
                  flush=True)


def _setup(base: Path, minio: MinioServer) -> tuple[CheckpointStore, CheckpointStore, Path]:
    settings = minio.settings("hermit-turn-bench", transfer_concurrency=8)
    store = CheckpointStore(settings)
    store.ensure_bucket()
    return store, FullDumpStore(settings), sandbox.build_bench_image(base)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.interval = min(args.interval, 10.0)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    base_trace = trace.load(args.trace)
    rng = random.Random(args.seed)
    base = Path(tempfile.mkdtemp(prefix="hermit-turn-bench-"))
    criu = Criu(os.environ.get("HERMIT_CRIU_PATH", str(hermit_bin() / "criu")))
    minio = start_minio(base / "minio")
    try:
        store, naive, image_tar = _setup(base, minio)
        with Containerd(base / "node-a") as cd_a, Containerd(base / "node-b") as cd_b, \
                CniNetwork(base / "cni") as network:
            nodes = (Node("node-a", cd_a, base / "work-a"), Node("node-b", cd_b, base / "work-b"))
            for node in nodes:
                node.work_dir.mkdir()
                node.image_ref = node.containerd.import_image(image_tar)
            env = Env(criu, store, naive, nodes, network, args.interval)
            rows = _measure(env, args, base_trace, rng)
    finally:
        stop_minio(minio)
        shutil.rmtree(base, ignore_errors=True)
    _print(args, base_trace, rows)
    return 0


def _print(args: argparse.Namespace, base_trace: trace.Trace,
           rows: list[report.Figures]) -> None:
    title = (f"turn benchmark, trace {base_trace.name}{' (quick)' if args.quick else ''}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores")
    print(f"\n{title}\n")
    print(report.table(rows))
    big, small = max(args.sizes), min(args.sizes)
    print("\ntargets (issue #11)\n")
    print(report.targets_text(report.targets(rows, big, small)))
    path = report.chart(rows, args.chart.resolve(), title)
    print(f"\nchart: {path}")


if __name__ == "__main__":
    sys.exit(main())
