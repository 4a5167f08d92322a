"""``hermit-node``: the node-agent's command line.

    hermit-node checkpoint --pid PID --namespace NS --sandbox NAME --uid UID --name CKPT [--stop]
    hermit-node restore    --pid PID --namespace NS --sandbox NAME --uid UID --name CKPT
    hermit-node watch      print interruption notices from the configured cloud
    hermit-node run        the DaemonSet's main loop

Store settings come from HERMIT_S3_* variables (see README), sealing from
HERMIT_SEAL_* (docs/security.md). Any HermitError ends
the command with a one-line message and exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hermit_common.errors import HermitError
from hermit_common.settings import (
    Env,
    NodeSettings,
    SealSettings,
    StoreSettings,
    WatcherSettings,
)

if TYPE_CHECKING:
    from hermit_common.store import CheckpointStore
    from hermit_node.host.criu import Criu


def _engine_parts() -> tuple[Criu, CheckpointStore, Path, Path]:
    # Imported here: `watch` and `run` need neither boto3 nor pycriu at start-up.
    from hermit_common.seal import sealing_from
    from hermit_common.store import CheckpointStore
    from hermit_node.host.criu import Criu

    env = Env(os.environ)
    store = CheckpointStore(StoreSettings.from_env(os.environ),
                            sealing=sealing_from(SealSettings.from_env(os.environ)))
    # NodeSettings.from_env needs HERMIT_NODE_NAME, which only `run` requires; the
    # defaults come from its fields.
    criu = Criu(env.text("HERMIT_CRIU_PATH", NodeSettings.criu_path))
    work_dir = Path(env.text("HERMIT_WORK_DIR", NodeSettings.work_dir))
    cgroup_root = Path(env.text("HERMIT_CGROUP_ROOT", NodeSettings.cgroup_root))
    return criu, store, work_dir, cgroup_root


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pid", type=int, required=True, help="host pid of the container's init")
    p.add_argument("--namespace", required=True)
    p.add_argument("--sandbox", required=True)
    p.add_argument("--uid", required=True, help="the sandbox's uid (binds the checkpoint)")
    p.add_argument("--name", required=True, help="checkpoint name")
    p.add_argument("--bundle", type=Path, help="OCI bundle dir (default: the shim's cwd)")
    p.add_argument("--image-digest", help="digest of the container image")


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    from hermit_node.engine.checkpoint import CheckpointEngine, CheckpointTarget

    criu, store, work_dir, cgroup_root = _engine_parts()
    engine = CheckpointEngine(criu, store, work_dir, cgroup_root=cgroup_root)
    result = engine.checkpoint(CheckpointTarget(
        namespace=args.namespace, sandbox=args.sandbox, sandbox_uid=args.uid,
        checkpoint=args.name, init_pid=args.pid, bundle=args.bundle,
        workspace_path=args.workspace or None, image_digest=args.image_digest,
    ), stop=args.stop)
    print(json.dumps(dataclasses.asdict(result)))
    return 0


def _cmd_restore(args: argparse.Namespace) -> int:
    from hermit_common.pin import Pin
    from hermit_node.engine.restore import RestoreEngine, RestoreTarget

    criu, store, work_dir, cgroup_root = _engine_parts()
    engine = RestoreEngine(criu, store, work_dir, cgroup_root=cgroup_root)
    result = engine.restore(RestoreTarget(
        pin=Pin(args.namespace, args.sandbox, args.name, uid=args.uid,
                digest=args.manifest_digest),
        init_pid=args.pid, bundle=args.bundle, image_digest=args.image_digest,
        workspace_path=args.workspace or None,
    ))
    print(json.dumps(dataclasses.asdict(result)))
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    from hermit_node.control.watchers import build_watcher

    settings = WatcherSettings.from_env(os.environ)
    watcher = build_watcher(settings)
    stop = threading.Event()
    try:
        for notice in watcher.watch(stop):
            print(json.dumps(dataclasses.asdict(notice), default=str), flush=True)
            if args.once:
                break
    except KeyboardInterrupt:
        stop.set()
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from hermit_node.main import run_agent

    return run_agent(os.environ)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hermit-node", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("checkpoint", help="checkpoint a running container into the store")
    _add_target_args(p)
    p.add_argument("--workspace", default="/workspace",
                   help="workspace mount point to capture ('' for none)")
    p.add_argument("--stop", action="store_true",
                   help="end the container once the checkpoint is durable (migration)")
    p.set_defaults(func=_cmd_checkpoint)

    p = sub.add_parser("restore", help="restore a checkpoint into a new container")
    _add_target_args(p)
    p.add_argument("--manifest-digest", help="expected manifest digest (sha256:...)")
    p.add_argument("--workspace", default="/workspace",
                   help="the new container's workspace mount point, the only mount the "
                        "restore replaces ('' for none)")
    p.set_defaults(func=_cmd_restore)

    p = sub.add_parser("watch", help="print interruption notices as JSON lines")
    p.add_argument("--once", action="store_true", help="exit after the first notice")
    p.set_defaults(func=_cmd_watch)

    p = sub.add_parser("run", help="run the node-agent (DaemonSet main loop)")
    p.set_defaults(func=_cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        code: int = args.func(args)
    except HermitError as exc:
        print(f"hermit-node: error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
