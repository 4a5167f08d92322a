"""The agent sandbox of the turn benchmark: its image, starting it, running a turn's
commands in it, and reading what a recovery must keep.

The image (busybox, ``hermit-init`` and ``hermit-bench-holder``, built from
``bench/workloads/holder.c`` with ``gcc -static``) runs ``hermit-init -- holder <MiB>``:
the holder keeps <MiB> of patterned memory and sleeps, so between turns nothing in the
sandbox runs (as in an agent sandbox while the model thinks). A turn's commands arrive as
an agent harness sends them: ``exec`` in the container (``ctr tasks exec``, what ``kubectl
exec`` does); a server a command starts in the background is reparented to the
container's init and so is part of every checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import tarfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from hermit_node.host import locate
from hermit_testbed.cni import CniNetwork, Netns
from hermit_testbed.container import Container, Mount
from hermit_testbed.errors import TestbedError
from hermit_testbed.image import build_image, busybox_rootfs
from hermit_testbed.scenario import INIT, Node, hermit_bin, required_binary

IMAGE_REF: Final = "hermit.local/turn-bench:dev"
HOLDER: Final = "/usr/local/bin/hermit-bench-holder"
HOLDER_REPORT: Final = "/dev/shm/holder-check"  # a tmpfs: not a file the inspector sees
WORKSPACE: Final = "/workspace"
SERVER_PORT: Final = 8080
SERVER_PAGE: Final = "/workspace/www/index.html"
PACKAGES: Final = ("tool-a", "tool-b")
PACKAGE_MIB: Final = 8
FINGERPRINTED: Final = ("workspace", "usr/local")
SOURCE: Final = Path(__file__).resolve().parent.parent / "workloads" / "holder.c"


def build_holder() -> Path:
    """``hermit-bench-holder`` (static), cached by the hash of its source."""
    key = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    out = hermit_bin().parent / "bench-holder" / key / "hermit-bench-holder"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        proc = subprocess.run(["gcc", "-static", "-O2", "-Wall", "-o", str(tmp), str(SOURCE)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise TestbedError(f"compiling {SOURCE} failed (hack/build-init installs gcc): "
                               f"{proc.stderr.strip()}")
        tmp.replace(out)
    return out


def _package(rootfs: Path, name: str) -> None:
    """/opt/pkgs/<name>.tar.gz: a "package" (random bytes, as binaries are) to unpack
    into /usr/local."""
    src = rootfs / "opt" / "src" / name
    (src / "lib").mkdir(parents=True)
    rng = random.Random(name)
    (src / "lib" / f"lib{name}.so").write_bytes(rng.randbytes(PACKAGE_MIB << 20))
    (src / "VERSION").write_text(f"{name} 1.0\n")
    (rootfs / "opt" / "pkgs").mkdir(parents=True, exist_ok=True)
    with tarfile.open(rootfs / "opt" / "pkgs" / f"{name}.tar.gz", "w:gz",
                      compresslevel=1) as tar:
        tar.add(src, arcname=name)
    shutil.rmtree(rootfs / "opt" / "src")


def build_bench_image(work: Path) -> Path:
    """The sandbox image's tar."""
    rootfs = work / "turn-bench-rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    busybox_rootfs(rootfs)
    bindir = rootfs / "usr/local/bin"
    bindir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(required_binary("hermit-init", "hack/build-init"), bindir / "hermit-init")
    shutil.copy2(build_holder(), bindir / "hermit-bench-holder")
    for name in PACKAGES:
        _package(rootfs, name)
    (rootfs / "workspace").mkdir()
    return build_image(rootfs, IMAGE_REF, work / "turn-bench-image.tar")


@dataclass
class Box:
    """One sandbox container on one node."""

    node: Node
    container: Container
    netns: Netns
    workspace: Path

    @property
    def cid(self) -> str:
        return self.container.id

    @property
    def runtime_id(self) -> str:
        return f"containerd://{self.container.id}"


def start_box(node: Node, network: CniNetwork, mem_mb: int, *, restore: bool = False,
              timeout: float = 300.0) -> Box:
    """A fresh sandbox whose holder has filled its memory, or one awaiting a restore."""
    cid = uuid.uuid4().hex
    workspace = node.work_dir / f"ws-{cid[:12]}"
    workspace.mkdir(parents=True)
    netns = network.add(f"{node.name}-{cid[:8]}")
    args = ([INIT, "--restore", "--restore-timeout", "300"] if restore
            else [INIT, "--", HOLDER, str(mem_mb), HOLDER_REPORT])
    container = node.containerd.run(cid, node.image_ref, args,
                                    mounts=[Mount(workspace, WORKSPACE)],
                                    netns_path=netns.path,
                                    log_path=node.work_dir / f"{cid[:12]}.log")
    if not restore:
        container.wait_log(f"holding {mem_mb} MiB", timeout)
    return Box(node, container, netns, workspace)


def destroy_box(box: Box, network: CniNetwork) -> None:
    box.node.containerd.delete(box.cid)
    network.delete(box.netns)
    shutil.rmtree(box.workspace, ignore_errors=True)


def run_command(box: Box, command: str, timeout: float = 600.0) -> None:
    """One command of a turn, as a harness runs it (exec). A sandbox frozen by a
    checkpoint refuses an exec ("paused"): the harness waits and tries again, and that
    wait is part of the turn's time."""
    deadline = time.monotonic() + timeout
    while True:
        proc = box.node.containerd.exec(box.cid, ["/bin/sh", "-c", command],
                                        timeout=timeout, check=False)
        if proc.returncode == 0:
            return
        frozen = "paus" in (proc.stderr + proc.stdout).lower()
        if not frozen or time.monotonic() > deadline:
            raise TestbedError(f"command {command!r} failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-400:]}")
        time.sleep(0.02)


def fingerprint(box: Box) -> str:
    """A digest of every path, kind and file content under /workspace and /usr/local."""
    digest = hashlib.sha256()
    root = Path(f"/proc/{box.container.init_pid}/root")
    for section in FINGERPRINTED:
        base = root / section
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                digest.update(str(path.relative_to(root)).encode() + b"\0")
                if path.is_file() and not path.is_symlink():
                    digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _holder_pid(box: Box) -> int | None:
    for proc in locate.container_processes(box.cid):
        try:
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(HOLDER.encode()):
            return proc.pid
    return None


def holder_intact(box: Box, timeout: float = 120.0) -> bool:
    """The holder runs and every page of its memory holds its pattern."""
    pid = _holder_pid(box)
    if pid is None:
        return False
    report = Path(f"/proc/{pid}/root{HOLDER_REPORT}")
    report.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        os.kill(pid, signal.SIGUSR1)  # again if the first one came before its pause()
        for _ in range(20):
            text = report.read_text() if report.exists() else ""
            if text.endswith("\n"):
                return text.startswith("ok ")
            time.sleep(0.1)
    return False


def server_answers(box: Box, expected: bytes) -> bool:
    """The background server started by the trace serves its page."""
    url = f"http://{box.netns.ip}:{SERVER_PORT}/index.html"
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return bool(resp.read() == expected)
    except OSError:
        return False


def server_page(box: Box) -> bytes:
    """What the server should serve, read from the sandbox's files."""
    return Path(f"/proc/{box.container.init_pid}/root{SERVER_PAGE}").read_bytes()
