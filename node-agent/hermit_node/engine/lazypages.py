"""Lazy restore: the restored tree runs before all its memory is in place (docs/criu.md).

CRIU's ``lazy-pages`` daemon serves a restored tree's anonymous private memory through
userfaultfd: ``criu restore --lazy-pages`` leaves those pages out, each restored task
hands its userfaultfd to the daemon over ``lazy-pages.socket`` in the images dir, and the
daemon copies a page in when the task touches it, and all the others in the background.
When every page is in, it exits.

This module checks that the node can do it (``unavailable``), starts the daemon for one
images dir (``LazyPages.start``) and watches it. The daemon reads the images dir's
``pages-*.img`` files, so they must be complete before it starts.

A daemon that fails or is killed before every page is in leaves the tree without the
rest of its memory: the kernel then fills a missing page with zeros. ``watch`` therefore
kills the restored tree when the daemon does not finish cleanly, so a sandbox never runs
on with memory it did not have.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hermit_common.store import Deferred
from hermit_node.engine.pagesource import Arrivals, PageServer, eager_ranges
from hermit_node.host.criu import CriuError, log_errors, read_pagemaps

log = logging.getLogger(__name__)

SOCKET = "lazy-pages.socket"  # CRIU's fixed name, in its work dir (here: the images dir)
LOG_FILE = "lazy-pages.log"


def unavailable(criu_binary: str) -> str | None:
    """Why this node cannot restore lazily (None: it can): CRIU's own check of
    non-cooperative userfaultfd (fork, remap and unmap events), which lazy restore needs."""
    try:
        proc = subprocess.run([criu_binary, "check", "--feature", "uffd-noncoop"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run {criu_binary} check: {exc}"
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).strip().splitlines()
        return f"criu check --feature uffd-noncoop: {out[-1] if out else proc.returncode}"
    return None


@dataclass(frozen=True)
class Filled:
    """How a daemon ended: ok when every page was copied in."""

    ok: bool
    seconds: float  # from the daemon's start
    message: str
    ended_at: float  # time.monotonic() when the daemon ended (or was stopped)


class LazyPages:
    """One running ``criu lazy-pages`` daemon serving ``images_dir``."""

    def __init__(self, proc: subprocess.Popen[bytes], images_dir: Path, began: float) -> None:
        self._proc = proc
        self.images_dir = images_dir
        self._began = began

    @classmethod
    def start(cls, criu_binary: str, images_dir: Path, *, timeout: float = 30.0,
              page_server: PageServer | None = None) -> LazyPages:
        """Starts the daemon and returns once it listens on its socket; CriuError if it
        does not within ``timeout`` seconds. With ``page_server`` the daemon asks it for
        the pages instead of reading the pages images itself."""
        began = time.monotonic()
        argv = [criu_binary, "lazy-pages", "--images-dir", str(images_dir),
                "--work-dir", str(images_dir), "--log-file", LOG_FILE, "-v2"]
        fds: tuple[int, ...] = ()
        if page_server is not None:
            fds = (page_server.daemon_fd,)
            argv += ["--page-server", "--ps-socket", str(page_server.daemon_fd)]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, close_fds=True, pass_fds=fds)
        if page_server is not None:
            page_server.handed_over()
        daemon = cls(proc, images_dir, began)
        deadline = began + timeout
        while not (images_dir / SOCKET).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                daemon.stop()
                raise CriuError(f"criu lazy-pages did not start: {daemon._errors()}")
            time.sleep(0.005)
        return daemon

    def _errors(self) -> str:
        found = log_errors(self.images_dir / LOG_FILE)
        if found:
            return found
        code = self._proc.poll()
        return "still running" if code is None else f"exit code {code}"

    def wait(self, timeout: float | None = None) -> Filled:
        """Waits until the daemon ends (every page in, or failed); a daemon still running
        after ``timeout`` seconds is stopped and counts as failed."""
        try:
            code = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            now = time.monotonic()
            return Filled(False, now - self._began,
                          f"not every page was in after {timeout:.0f} s", now)
        now = time.monotonic()
        if code == 0:
            return Filled(True, now - self._began, "every page is in", now)
        return Filled(False, now - self._began, f"criu lazy-pages failed: {self._errors()}",
                      now)

    def stop(self) -> None:
        """Ends the daemon (a restore that failed before the tree ran)."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def watch(daemon: LazyPages, *, tree_root: Callable[[], int | None], timeout: float,
          done: Callable[[Filled], None]) -> threading.Thread:
    """Waits for ``daemon`` in a thread. If it fails, kills the restored tree
    (``tree_root()``: the host pid of its root, PID 1 of its own pid namespace, so the
    whole tree ends with it) before anything reads memory it does not have; then calls
    ``done``."""

    def run() -> None:
        filled = daemon.wait(timeout)
        if not filled.ok:
            pid = tree_root()
            log.error("lazy restore in %s: %s; killing the restored tree (pid %s)",
                      daemon.images_dir, filled.message, pid)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        done(filled)

    thread = threading.Thread(target=run, name=f"lazy-pages {daemon.images_dir}", daemon=True)
    thread.start()
    return thread


@dataclass
class Streamed:
    """A lazy restore whose pages images are still being downloaded: the daemon, its page
    source, and the thread fetching the rest of the pages images."""

    daemon: LazyPages
    arrivals: Arrivals
    deferred: Deferred
    fetcher: threading.Thread
    # Set once the tree runs: until then only the pages a task waits for are fetched, so
    # the restore does not compete with the bulk of the download.
    bulk: threading.Event

    def abort(self, why: str) -> None:
        """Stops the fetch, fails every page wait and ends the daemon (the tree never ran)."""
        self.deferred.stop.set()
        self.arrivals.fail(why)
        self.daemon.stop()
        self.fetcher.join()


def start_streamed(criu_binary: str, images_dir: Path, deferred: Deferred) -> Streamed:
    """Fetches the pages ``criu restore`` reads itself, then starts fetching the rest of
    the pages images in a thread (a chunk a task waits for first) and a daemon that serves
    each page once its chunk is in. A failed fetch fails the waits, so the daemon, so the
    tree (``watch``)."""
    maps = read_pagemaps(images_dir)
    arrivals = Arrivals()

    def landed(path: str, offset: int, length: int) -> None:
        arrivals.mark(Path(path).name, offset, length)

    def wanted() -> tuple[str, int, int] | None:
        want = arrivals.wanted()
        return None if want is None else (str(images_dir / want[0]), want[1], want[2])

    began = time.monotonic()
    eager = eager_ranges(maps)
    deferred.fetch_ranges([(str(images_dir / name), offset, length)
                           for name, offset, length in eager], landed)
    log.info("lazy restore in %s: fetched the chunks under the %d bytes criu restore reads "
             "itself in %.0f ms", images_dir, sum(n for _, _, n in eager),
             (time.monotonic() - began) * 1000)

    bulk = threading.Event()

    def fetch() -> None:
        try:
            deferred.fetch_rest(landed, wanted, bulk=bulk,
                                idle=lambda: arrivals.wait_wanted(0.05))
        except BaseException as exc:
            log.error("lazy restore in %s: fetching its pages failed: %s", images_dir, exc)
            arrivals.fail(f"fetching the pages failed: {exc}")

    fetcher = threading.Thread(target=fetch, name=f"pages {images_dir}", daemon=True)
    fetcher.start()
    server = PageServer(images_dir, maps, arrivals.wait_for)
    try:
        daemon = LazyPages.start(criu_binary, images_dir, page_server=server)
    except BaseException:
        deferred.stop.set()
        arrivals.fail("the lazy-pages daemon did not start")
        fetcher.join()
        raise
    return Streamed(daemon, arrivals, deferred, fetcher, bulk)
