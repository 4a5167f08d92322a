"""The node-level migration demo: ``python -m hermit_testbed.demo`` (run by hack/demo).

Starts MinIO and two "nodes" (private containerd daemons), runs the stateful sandbox
on node A, checkpoints it into S3, destroys everything of it on node A, restores it
on node B, and prints a short timeline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from hermit_common.errors import HermitError
from hermit_common.pin import Pin
from hermit_common.store import CheckpointStore
from hermit_node.engine.checkpoint import CheckpointEngine, CheckpointTarget
from hermit_node.engine.restore import RestoreEngine, RestoreTarget
from hermit_node.host.criu import Criu
from hermit_testbed.cni import CniNetwork
from hermit_testbed.containerd import Containerd
from hermit_testbed.minio import start_minio, stop_minio
from hermit_testbed.scenario import (
    Node,
    build_sandbox_image,
    destroy_sandbox,
    hermit_bin,
    ns_pid,
    process_tree,
    start_sandbox,
)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run_demo(base: Path, mem_mb: int, warmup_ticks: int) -> None:
    began = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - began:6.2f}s] {text}", flush=True)

    criu = Criu(os.environ.get("HERMIT_CRIU_PATH", str(hermit_bin() / "criu")))
    say(f"CRIU {criu.version()}; building the sandbox image (busybox + hermit-init + workload)")
    image_tar = build_sandbox_image(base)
    minio = start_minio(base / "minio")
    try:
        settings = minio.settings("hermit-demo")
        store = CheckpointStore(settings)
        store.ensure_bucket()
        with Containerd(base / "node-a") as cd_a, Containerd(base / "node-b") as cd_b, \
                CniNetwork(base / "cni") as network:
            node_a, node_b = Node("node-a", cd_a, base / "work-a"), Node("node-b", cd_b,
                                                                         base / "work-b")
            for node in (node_a, node_b):
                node.work_dir.mkdir()
                node.image_ref = node.containerd.import_image(image_tar)
            env = {"HERMIT_WORKLOAD_MEM_MB": str(mem_mb)} if mem_mb else {}
            source = start_sandbox(node_a, network, "sandbox", env=env)
            source.wait_ticks(warmup_ticks, timeout=120)
            answer = source.ask()
            say(f"node-a: sandbox running at {source.netns.ip}:7000, counter={answer['counter']}"
                f", child pid {answer['child']}, {mem_mb} MiB of patterned memory")
            uid = str(uuid.uuid4())
            result = CheckpointEngine(criu, store, node_a.work_dir).checkpoint(CheckpointTarget(
                namespace="demo", sandbox="sandbox", sandbox_uid=uid, checkpoint="ckpt-1",
                init_pid=source.init_pid, image_digest=node_a.image_digest()), stop=True)
            at_checkpoint = source.ticks()[-1]
            say(f"checkpointed {_mb(result.image_bytes)} (CRIU images + files) in "
                f"{result.dump_ms} ms of dump; counter was {at_checkpoint}")
            say(f"uploaded {_mb(result.uploaded_bytes)} (zstd chunks, stored "
                f"{_mb(result.stored_bytes)}) in {result.upload_ms} ms; frozen "
                f"{result.frozen_ms} ms until durable")
            source.container.wait_exit(30)
            destroy_sandbox(source, network)
            shutil.rmtree(node_a.work_dir / "checkpoints", ignore_errors=True)
            say("node-a: container, network namespace, workspace and local images deleted")
            target = start_sandbox(node_b, network, "sandbox", restore=True, env=env)
            restored = RestoreEngine(criu, store, node_b.work_dir).restore(RestoreTarget(
                pin=Pin("demo", "sandbox", "ckpt-1", uid=uid), init_pid=target.init_pid,
                image_digest=node_b.image_digest()))
            say(f"node-b: restored in {restored.total_ms} ms (download {restored.download_ms} "
                f"ms, files {restored.apply_ms} ms, criu {restored.restore_ms} ms)")
            ticks = target.wait_ticks(at_checkpoint + 5)
            first_after = ticks[at_checkpoint] if len(ticks) > at_checkpoint else None
            answer = target.ask()
            tree = process_tree(target.init_pid)
            say(f"node-b: counter continued at {first_after} (checkpoint had {at_checkpoint}); "
                f"socket at {target.netns.ip} says counter={answer['counter']} "
                f"child={answer['child']}; restored pids in ns: "
                f"{sorted(ns_pid(p) for p in tree[1:])}")
            if first_after != at_checkpoint + 1 or ticks != list(range(1, len(ticks) + 1)):
                raise HermitError(f"the counter did not continue: {ticks[-20:]}")
            destroy_sandbox(target, network)
    finally:
        stop_minio(minio)
    say("done")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mem-mb", type=int, default=64,
                        help="patterned memory the workload holds (MiB)")
    parser.add_argument("--warmup-ticks", type=int, default=20)
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="hermit-demo-"))
    try:
        run_demo(base, args.mem_mb, args.warmup_ticks)
    except HermitError as exc:
        print(f"hermit demo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
