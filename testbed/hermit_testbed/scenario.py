"""The node-level migration scenario, shared by the integration test, the demo and bench/.

Two "nodes" (each its own private containerd), one CNI bridge between them, a
sandbox image holding busybox, ``hermit-init`` and the ``hermit-stateful`` workload.
A sandbox runs on node A; it is checkpointed into S3 and restored on node B.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hermit_testbed.cni import CniNetwork, Netns
from hermit_testbed.container import Container, Mount
from hermit_testbed.containerd import Containerd
from hermit_testbed.errors import TestbedError
from hermit_testbed.image import build_image, busybox_rootfs

IMAGE_REF = "hermit.local/stateful-sandbox:test"
INIT = "/usr/local/bin/hermit-init"
WORKLOAD = "/usr/local/bin/hermit-stateful"
DELETED_FROM_IMAGE = "/etc/hermit-delete-me"
WORKLOAD_PORT = 7000


def hermit_bin() -> Path:
    return Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit")) / "bin"


def required_binary(name: str, hint: str) -> Path:
    path = hermit_bin() / name
    if not path.is_file():
        raise TestbedError(f"{name} not found at {path}: run {hint}")
    return path


def build_sandbox_image(work: Path) -> Path:
    """An image with busybox, the sandbox init and the stateful workload; returns the tar."""
    init = required_binary("hermit-init", "hack/build-init")
    workload = required_binary("hermit-stateful", "hack/build-init stateful")
    rootfs = work / "sandbox-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    busybox_rootfs(rootfs)
    bindir = rootfs / "usr/local/bin"
    bindir.mkdir(parents=True, exist_ok=True)
    for binary in (init, workload):
        shutil.copy2(binary, bindir / binary.name)
    (rootfs / DELETED_FROM_IMAGE.lstrip("/")).write_text("the workload deletes this file\n")
    for d in ("state", "workspace"):
        (rootfs / d).mkdir(exist_ok=True)
    return build_image(rootfs, IMAGE_REF, work / "sandbox-image.tar")


@dataclass
class Node:
    """One node: a containerd, an image store and a local work dir for the engine."""

    name: str
    containerd: Containerd
    work_dir: Path
    image_ref: str = ""

    def image_digest(self) -> str:
        return self.containerd.image_digest(self.image_ref)


@dataclass
class Sandbox:
    node: Node
    container: Container
    netns: Netns
    workspace: Path
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def init_pid(self) -> int:
        return self.container.init_pid

    def ticks(self) -> list[int]:
        path = self.workspace / "ticks.log"
        if not path.exists():
            return []
        return [int(line.split()[1]) for line in path.read_text().splitlines() if line.strip()]

    def wait_ticks(self, at_least: int, timeout: float = 30.0) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            ticks = self.ticks()
            if ticks and ticks[-1] >= at_least:
                return ticks
            if time.monotonic() > deadline:
                raise TestbedError(
                    f"sandbox on {self.node.name} reached tick {ticks[-1] if ticks else None}, "
                    f"not {at_least}, within {timeout:.0f}s; "
                    f"log: {self.container.read_log()[-500:]}")
            time.sleep(0.05)

    def ask(self, timeout: float = 5.0) -> dict[str, str]:
        """Connect to the workload's TCP port; it answers ``counter=N child=PID``."""
        with socket.create_connection((self.netns.ip, WORKLOAD_PORT), timeout=timeout) as s:
            s.settimeout(timeout)
            data = b""
            while b"\n" not in data:
                chunk = s.recv(256)
                if not chunk:
                    break
                data += chunk
        # The first line is ``counter=N child=PID``; later lines (if any) are details.
        return dict(kv.split("=", 1) for kv in data.decode().split("\n")[0].split() if "=" in kv)


def start_sandbox(node: Node, network: CniNetwork, name: str, *, restore: bool = False,
                  env: Mapping[str, str] | None = None,
                  ctr_args: Sequence[str] = ()) -> Sandbox:
    """Run the sandbox on ``node``: fresh (init runs the workload) or awaiting a restore.
    ``ctr_args``: more ``ctr run`` options, e.g. ``--cap-drop CAP_NET_RAW`` or
    ``--seccomp`` (what a pod's securityContext would change)."""
    workspace = node.work_dir / f"{name}-workspace"
    shutil.rmtree(workspace, ignore_errors=True)
    workspace.mkdir(parents=True)
    netns = network.add(f"{node.name}-{name}")
    args = ([INIT, "--restore", "--restore-timeout", "300"] if restore
            else [INIT, "--", WORKLOAD])
    log_path = node.work_dir / f"{name}.log"
    container = node.containerd.run(
        name, node.image_ref, args, env=dict(env or {}),
        mounts=[Mount(workspace, "/workspace")], netns_path=netns.path, log_path=log_path,
        extra_args=ctr_args,
    )
    return Sandbox(node, container, netns, workspace, log_path)


def destroy_sandbox(sandbox: Sandbox, network: CniNetwork) -> None:
    """Remove the container, its network and its workspace: nothing of it stays local."""
    sandbox.node.containerd.delete(sandbox.container.id)
    network.delete(sandbox.netns)
    shutil.rmtree(sandbox.workspace, ignore_errors=True)


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (host pids), parents first."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        out.append(current)
        try:
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        todo.extend(int(c) for c in children)
    return out


def ns_pid(host_pid: int) -> int:
    """The pid of ``host_pid`` in its innermost pid namespace."""
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise TestbedError(f"no NSpid for {host_pid}")
