"""CRIU lazy restore on this machine's kernel, through Hermit's own CRIU adapter.

A process holds 256 MiB of distinct pages (and their sha256) and ticks into a file. It
is dumped once, then restored from the same images twice: fully (CRIU copies every page
in before the tree runs) and lazily (``hermit_node.engine.lazypages``: the tree runs at once and
a ``criu lazy-pages`` daemon copies its memory in). Both times the restored process must
hash its whole memory to the digest it had before the dump and go on ticking. Prints
restore -> running and -> all pages present for both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hermit_node.engine import lazypages, pagesource
from hermit_node.host.criu import Criu, DumpRequest, RestoreRequest, read_pagemaps
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MIB = 256

HOLDER = r"""
import hashlib, os, sys, time
out, mib = sys.argv[1], int(sys.argv[2])
buf = bytearray(mib << 20)
seed = os.urandom(4096)
for i in range(0, len(buf), 4096):  # every page distinct: no dedup, no zero page
    buf[i:i + 4096] = seed[:8] + i.to_bytes(8, "little") + seed[16:]
fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
os.write(fd, f"digest {hashlib.sha256(buf).hexdigest()}\n".encode())
n = 0
while True:
    if os.path.exists(out + ".check"):
        os.unlink(out + ".check")
        os.write(fd, f"check {hashlib.sha256(buf).hexdigest()}\n".encode())
    os.write(fd, f"tick {n}\n".encode())
    n += 1
    time.sleep(0.01)
"""


def lines(path: Path, word: str) -> list[str]:
    text = path.read_text() if path.exists() else ""
    return [ln.split()[1] for ln in text.splitlines() if ln.startswith(word + " ")]


def kill_tree(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def check_memory(out: Path, digest: str) -> None:
    """The running process hashes all of its memory again: the same digest, and it ticks on."""
    ticks = len(lines(out, "tick"))
    checks = len(lines(out, "check"))
    (out.parent / (out.name + ".check")).touch()
    wait_until("the restored process to hash its memory", 60.0,
               lambda: len(lines(out, "check")) > checks, 0.01)
    assert lines(out, "check")[-1] == digest, "the restored memory differs from the dumped"
    wait_until("the restored process to tick on", 60.0,
               lambda: len(lines(out, "tick")) > ticks + 3, 0.01)


def restore(criu: Criu, images: Path, log_file: str, *, lazy: bool) -> int:
    return criu.restore(RestoreRequest(images_dir=images, root=Path("/"), log_file=log_file,
                                       lazy_pages=lazy))


def dump_holder(criu: Criu, out: Path, images: Path) -> str:
    """Dumps (and ends) a holder process; returns the digest of its memory."""
    images.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), str(MIB)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until("the holder to fill its memory", 60.0, lambda: bool(lines(out, "tick")), 0.01)
        criu.dump(DumpRequest(pid=proc.pid, images_dir=images, leave_running=False))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    return lines(out, "digest")[0]


def test_lazy_restore_runs_before_its_memory_is_in(tmp_path: Path, criu_bin: Path) -> None:
    reason = lazypages.unavailable(str(criu_bin))
    assert reason is None, f"this machine cannot restore lazily: {reason}"
    criu = Criu(str(criu_bin))
    out, images = tmp_path / "out.txt", tmp_path / "images"
    digest = dump_holder(criu, out, images)

    began = time.monotonic()
    pid = restore(criu, images, "restore-full.log", lazy=False)
    full_s = time.monotonic() - began
    try:
        check_memory(out, digest)
    finally:
        kill_tree(pid)

    daemon = lazypages.LazyPages.start(str(criu_bin), images)
    began = time.monotonic()
    try:
        pid = restore(criu, images, "restore-lazy.log", lazy=True)
    except BaseException:
        daemon.stop()
        raise
    running_s = time.monotonic() - began
    try:
        filled = daemon.wait(timeout=120)
        all_in_s = time.monotonic() - began
        assert filled.ok, filled.message
        check_memory(out, digest)
    finally:
        daemon.stop()
        kill_tree(pid)
    print(f"\n{MIB} MiB: full restore -> running {full_s * 1000:.0f} ms; lazy restore -> "
          f"running {running_s * 1000:.0f} ms, -> all pages present {all_in_s * 1000:.0f} ms")


# The pace the pages image "arrives" at: a download from S3 of a few hundred MB/s.
DELIVERY_BYTES_PER_SECOND = 256 << 20
PIECE = 4 << 20  # the store's chunk size


def deliver(source: Path, dest: Path, arrivals: pagesource.Arrivals,
            stop: threading.Event) -> None:
    """Writes ``source`` into ``dest`` in store-chunk pieces at the pace of a download: a
    piece someone waits for first, then the others in order."""
    size = source.stat().st_size
    began = time.monotonic()
    sent = 0

    def missing(offsets: range) -> int | None:
        return next((o for o in offsets
                     if not arrivals.has(dest.name, o, min(PIECE, size - o))), None)

    with source.open("rb") as src, dest.open("r+b") as dst:
        while not stop.is_set():
            want = arrivals.wanted()
            offset = None if want is None else missing(
                range(want[1] // PIECE * PIECE, want[1] + want[2], PIECE))
            if offset is None:
                offset = missing(range(0, size, PIECE))
                if offset is None:
                    return
            src.seek(offset)
            data = src.read(PIECE)
            dst.seek(offset)
            dst.write(data)
            dst.flush()
            arrivals.mark(dest.name, offset, len(data))
            sent += len(data)
            # Paced like a download (a simulated bandwidth, not a wait for a condition).
            time.sleep(max(0.0, began + sent / DELIVERY_BYTES_PER_SECOND - time.monotonic()))


def test_lazy_restore_from_a_page_source_runs_before_its_pages_arrive(
        tmp_path: Path, criu_bin: Path) -> None:
    """The pages image is not there yet when the tree starts: only the pages ``criu
    restore`` reads itself are. The tree runs, and a page it touches is served by the page
    source once its bytes have arrived, never before."""
    criu = Criu(str(criu_bin))
    out, images = tmp_path / "out.txt", tmp_path / "images"
    digest = dump_holder(criu, out, images)
    maps = read_pagemaps(images)
    (name,) = {pagesource.pages_file(pm) for pm in maps}
    arrived_later = tmp_path / name
    (images / name).rename(arrived_later)
    with (images / name).open("wb") as f:  # the download's placeholder: all holes
        f.truncate(arrived_later.stat().st_size)
    arrivals = pagesource.Arrivals(timeout=120)
    with arrived_later.open("rb") as src, (images / name).open("r+b") as dst:
        for file, offset, length in pagesource.eager_ranges(maps):
            src.seek(offset)
            dst.seek(offset)
            dst.write(src.read(length))
            arrivals.mark(file, offset, length)
    eager = sum(length for _, _, length in pagesource.eager_ranges(maps))

    server = pagesource.PageServer(images, maps, arrivals.wait_for)
    daemon = lazypages.LazyPages.start(str(criu_bin), images, page_server=server)
    stop = threading.Event()
    delivery = threading.Thread(target=deliver, args=(arrived_later, images / name, arrivals,
                                                      stop))
    began = time.monotonic()
    delivery.start()
    try:
        pid = restore(criu, images, "restore-ps.log", lazy=True)
    except BaseException:
        stop.set()
        arrivals.fail("the restore failed")
        daemon.stop()
        raise
    running_s = time.monotonic() - began
    arrived_at_running = not delivery.is_alive()
    try:
        delivery.join(120)
        arrived_s = time.monotonic() - began
        filled = daemon.wait(timeout=120)
        all_in_s = time.monotonic() - began
        assert filled.ok, filled.message
        server.join(30)
        assert server.error is None, server.error
        check_memory(out, digest)
    finally:
        stop.set()
        arrivals.fail("the test ended")
        daemon.stop()
        kill_tree(pid)
    assert not arrived_at_running, "the tree only ran once its whole pages image was in"
    print(f"\n{MIB} MiB from a page source: {eager} bytes read by criu restore itself; "
          f"-> running {running_s * 1000:.0f} ms, pages image arrived "
          f"{arrived_s * 1000:.0f} ms, -> all pages present {all_in_s * 1000:.0f} ms, "
          f"{server.served} pages served")
