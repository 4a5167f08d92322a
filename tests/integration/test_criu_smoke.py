"""Real CRIU round trip through pycriu's RPC (swrk mode) on a plain process.

A counter process keeps a random token and a counter in memory and appends
"<token> <n>" lines to a file. It is dumped (and killed) by CRIU, restored,
and must carry on from where it stopped with the same token: memory, the
open file and its offset all came back. One image is decoded with pycriu.images.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    # pycriu.images uses protobuf's deprecated FieldDescriptor.label().
    pytest.mark.filterwarnings(r"ignore:label\(\) is deprecated:DeprecationWarning"),
]

COUNTER = r"""
import os, sys, time
token = os.urandom(8).hex()
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
n = 0
while True:
    os.write(fd, f"{token} {n}\n".encode())
    n += 1
    time.sleep(0.02)
"""


def read_lines(path: Path) -> list[tuple[str, int]]:
    """Complete "<token> <n>" lines of the counter file."""
    text = path.read_text() if path.exists() else ""
    out: list[tuple[str, int]] = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        token, n = line.split()
        out.append((token, int(n)))
    return out


def log_tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return f"(no {path.name})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.contextmanager
def images_dir_fd(path: Path) -> Iterator[int]:
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def new_criu(pycriu: ModuleType, criu_bin: Path, images_fd: int, log_file: str) -> Any:
    """A pycriu client that execs ``criu swrk`` and reads/writes images through ``images_fd``."""
    client = pycriu.criu()
    client.use_binary(str(criu_bin))
    # criu swrk opens /proc/<our pid>/fd/<images_fd>, so the fd only has to be open here.
    client.opts.images_dir_fd = images_fd
    client.opts.log_file = log_file  # relative to the images dir (the default work dir)
    client.opts.log_level = 4
    client.opts.shell_job = False
    return client


def test_dump_and_restore_a_counter_process(
    tmp_path: Path, criu_bin: Path, pycriu_module: ModuleType
) -> None:
    pycriu = pycriu_module
    out = tmp_path / "counter.txt"
    images = tmp_path / "images"

    proc = subprocess.Popen(
        [sys.executable, "-c", COUNTER, str(out)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    pid = proc.pid
    restored_pid: int | None = None
    try:
        wait_until("the counter to write 5 lines", 20.0, lambda: len(read_lines(out)) >= 5, 0.05)

        with images_dir_fd(images) as fd:
            dumper = new_criu(pycriu, criu_bin, fd, "dump.log")
            dumper.opts.pid = pid
            dumper.opts.leave_running = False
            t0 = time.monotonic()
            try:
                dumper.dump()
            except pycriu.CRIUException as exc:
                pytest.fail(f"criu dump failed: {exc}\n{log_tail(images / 'dump.log')}")
            dump_s = time.monotonic() - t0
        assert proc.wait(timeout=10) == -signal.SIGKILL, "criu did not kill the dumped process"
        before = read_lines(out)
        assert before, "no counter lines before the dump"
        token = before[0][0]

        # crit: decode images with pycriu.images.
        with (images / "pstree.img").open("rb") as f:
            pstree = pycriu.images.load(f)
        assert pstree["magic"] == "PSTREE"
        assert pstree["entries"][0]["pid"] == pid
        with (images / "inventory.img").open("rb") as f:
            inventory = pycriu.images.load(f)
        assert inventory["magic"] == "INVENTORY"

        with images_dir_fd(images) as fd:
            restorer = new_criu(pycriu, criu_bin, fd, "restore.log")
            # RPC restores are always detached; rst_sibling makes the restored
            # tree our child (a sibling of criu swrk) so this test can reap it.
            restorer.opts.rst_sibling = True
            t0 = time.monotonic()
            try:
                resp = restorer.restore()
            except pycriu.CRIUException as exc:
                pytest.fail(f"criu restore failed: {exc}\n{log_tail(images / 'restore.log')}")
            restore_s = time.monotonic() - t0
        restored_pid = int(resp.pid)
        assert restored_pid == pid

        wait_until("the restored counter to write 5 more lines", 20.0,
                   lambda: len(read_lines(out)) >= len(before) + 5, 0.05)
        after = read_lines(out)
        assert {t for t, _ in after} == {token}, "a different token: the process restarted"
        assert [n for _, n in after] == list(range(len(after))), "the counter did not continue"
        print(f"dump {dump_s:.2f}s restore {restore_s:.2f}s, {len(before)} -> {len(after)} lines")
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait(timeout=10)
        if restored_pid is not None and is_alive(restored_pid):
            os.kill(restored_pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(restored_pid, 0)
