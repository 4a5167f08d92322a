"""Checkpoint/restore benchmark on real CRIU, containerd and MinIO, measured side by side.

    .venv/bin/python bench/checkpoint_bench.py [--sizes 64 512]

For each workload size (MiB of patterned, verified memory held by the stateful
workload) it takes, on one sandbox: a routine checkpoint (the sandbox keeps
running), a second one a few ticks later (only changed chunks upload), and a
migrating one (frozen until durable; into a sandbox prefix of its own, so no chunk is
reused: its frozen time is notice -> durable with nothing uploaded before), then
restores on a second node. It prints
the figures and the ratios: frozen time vs raw CRIU dump time, bytes uploaded by
the second checkpoint vs a full per-turn dump, and frozen time vs the whole cost.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from hermit_common.pin import Pin
from hermit_common.store import CheckpointStore
from hermit_node.engine.checkpoint import CheckpointEngine, CheckpointResult, CheckpointTarget
from hermit_node.engine.restore import RestoreEngine, RestoreResult, RestoreTarget
from hermit_node.host.criu import Criu
from hermit_testbed.cni import CniNetwork
from hermit_testbed.containerd import Containerd
from hermit_testbed.minio import start_minio, stop_minio
from hermit_testbed.scenario import (
    Node,
    build_sandbox_image,
    destroy_sandbox,
    hermit_bin,
    start_sandbox,
)


@dataclass
class Row:
    mem_mb: int
    first: CheckpointResult
    second: CheckpointResult
    migrate: CheckpointResult
    restore: RestoreResult
    continued: bool


def measure(base: Path, mem_mb: int, criu: Criu, store: CheckpointStore,
            nodes: tuple[Node, Node], network: CniNetwork) -> Row:
    node_a, node_b = nodes
    env = {"HERMIT_WORKLOAD_MEM_MB": str(mem_mb)}
    uid = str(uuid.uuid4())
    name = f"bench-{mem_mb}"
    source = start_sandbox(node_a, network, name, env=env)
    source.wait_ticks(10, timeout=300)
    engine_a = CheckpointEngine(criu, store, node_a.work_dir)

    def target(ckpt: str, sandbox: str = name) -> CheckpointTarget:
        return CheckpointTarget(namespace="bench", sandbox=sandbox, sandbox_uid=uid,
                                checkpoint=ckpt, init_pid=source.init_pid,
                                image_digest=node_a.image_digest())

    first = engine_a.checkpoint(target("c1"))
    source.wait_ticks(source.ticks()[-1] + 5)
    second = engine_a.checkpoint(target("c2"))
    source.wait_ticks(source.ticks()[-1] + 5)
    # Into a sandbox prefix with no chunks yet: notice -> durable with nothing to reuse.
    moved = f"{name}-moved"
    migrate = engine_a.checkpoint(target("c3", moved), stop=True)
    source.container.wait_exit(60)
    at_checkpoint = source.ticks()[-1]
    destroy_sandbox(source, network)
    shutil.rmtree(node_a.work_dir / "checkpoints", ignore_errors=True)

    restored_box = start_sandbox(node_b, network, name, restore=True, env=env)
    restored = RestoreEngine(criu, store, node_b.work_dir).restore(RestoreTarget(
        pin=Pin("bench", moved, "c3", uid=uid), init_pid=restored_box.init_pid,
        image_digest=node_b.image_digest()))
    ticks = restored_box.wait_ticks(at_checkpoint + 3, timeout=120)
    continued = ticks == list(range(1, len(ticks) + 1)) and restored_box.container.alive()
    destroy_sandbox(restored_box, network)
    return Row(mem_mb, first, second, migrate, restored, continued)


def report(rows: list[Row]) -> None:
    mb = 1e6
    print("\nper workload (MiB of memory held by the workload)")
    header = (f"{'MiB':>5} {'frozen ms':>9} {'dump ms':>8} {'images MB':>9} {'stored MB':>9} "
              f"{'upload ms':>9} {'2nd upl MB':>10} {'migr frozen ms':>14} "
              f"{'restore ms':>10} {'ok':>3}")
    print(header)
    for r in rows:
        print(f"{r.mem_mb:>5} {r.first.frozen_ms:>9} {r.first.dump_ms:>8} "
              f"{r.first.image_bytes / mb:>9.1f} {r.first.stored_bytes / mb:>9.1f} "
              f"{r.first.upload_ms:>9} {r.second.uploaded_bytes / mb:>10.2f} "
              f"{r.migrate.frozen_ms:>14} {r.restore.total_ms:>10} "
              f"{'yes' if r.continued else 'NO':>3}")
    print("\nratios (same run)")
    for r in rows:
        frozen_vs_dump = r.first.frozen_ms / max(r.first.dump_ms, 1)
        delta_vs_full = r.second.uploaded_bytes / max(r.second.image_bytes, 1)
        hidden = r.first.frozen_ms / max(r.first.frozen_ms + r.first.upload_ms, 1)
        m = r.migrate
        print(f"{r.mem_mb:>5} MiB: migrating checkpoint durable in {m.frozen_ms} ms frozen = "
              f"dump {m.dump_ms} ms (with {m.chunks_staged} of {m.chunks_total} chunks "
              f"uploaded during it) + {m.upload_ms} ms upload after it")
        print(f"{r.mem_mb:>5} MiB: frozen/raw dump = {frozen_vs_dump:.2f}x; "
              f"2nd checkpoint uploads {delta_vs_full:.4f} of a full dump "
              f"({r.second.uploaded_bytes / mb:.2f} of {r.second.image_bytes / mb:.1f} MB); "
              f"workload sees {hidden:.2f} of the routine checkpoint's time; "
              f"stored/raw = {r.first.stored_bytes / max(r.first.image_bytes, 1):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 512])
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="hermit-bench-"))
    criu = Criu(os.environ.get("HERMIT_CRIU_PATH", str(hermit_bin() / "criu")))
    minio = start_minio(base / "minio")
    rows = []
    try:
        store = CheckpointStore(minio.settings("hermit-bench", transfer_concurrency=8))
        store.ensure_bucket()
        image_tar = build_sandbox_image(base)
        with Containerd(base / "node-a") as cd_a, Containerd(base / "node-b") as cd_b, \
                CniNetwork(base / "cni") as network:
            nodes = (Node("node-a", cd_a, base / "work-a"), Node("node-b", cd_b, base / "work-b"))
            for node in nodes:
                node.work_dir.mkdir()
                node.image_ref = node.containerd.import_image(image_tar)
            for size in args.sizes:
                rows.append(measure(base, size, criu, store, nodes, network))
                print(f"measured {size} MiB", file=sys.stderr, flush=True)
    finally:
        stop_minio(minio)
        shutil.rmtree(base, ignore_errors=True)
    report(rows)
    return 0 if all(r.continued for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
