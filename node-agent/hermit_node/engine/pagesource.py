"""A page server for CRIU's lazy-pages daemon: serves a restored tree's memory from its
pages images, waiting for each page's bytes to arrive before it sends them.

``criu lazy-pages --page-server --ps-socket FD`` asks its page server for the pages a
restored task touched (and, in the background, for all the others) with CRIU's
page-xfer protocol (criu/page-xfer.c):

- request: a ``page_server_iov`` header {u32 cmd = PS_IOV_GET; u64 nr_pages; u64 vaddr;
  u64 dst_id = the task's pid in the images}; requests are answered in order;
- answer: the same header with cmd = PS_IOV_ADD_F | PE_PRESENT << 16 and nr_pages at
  most the asked number, then nr_pages * 4096 bytes of memory;
- PS_IOV_CLOSE / PS_IOV_FORCE_CLOSE: answered with an int32 0, and the session ends.

Where a page is: a task's ``pagemap-<pid>.img`` lists its memory in ranges, and the
pages image (``pages-<pages_id>.img``) holds the present ranges' bytes back to back in
that order. ``Extents`` turns a pagemap into (vaddr, pages, file offset) ranges;
``wait_for`` (the caller's) blocks until a byte range of a pages image is in place, so a
task that touches a page whose chunk has not arrived waits for it instead of reading
anything else.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hermit_common.errors import Retryable
from hermit_node.host.criu import PageMap

log = logging.getLogger(__name__)

PAGE_SIZE = 4096
HEADER = struct.Struct("=I4xQQQ")  # C layout of page_server_iov: u32, pad, 3 x u64
STATUS = struct.Struct("=i")
PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
PS_CMD_MASK = (1 << PS_CMD_BITS) - 1
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4

PAGES_IMAGE = re.compile(r"pages-\d+\.img")  # the files a lazy restore streams

# (pages image file name, byte offset, length): blocks until those bytes are in place.
WaitFor = Callable[[str, int, int], None]


class PageSourceError(Retryable):
    """The lazy-pages daemon asked for something the images do not have, or its pages did
    not arrive in time. Retryable: the checkpoint was admitted whole; the restore may work
    on a new pod."""


@dataclass(frozen=True)
class Extent:
    vaddr: int
    nr_pages: int
    offset: int  # in the pages image
    lazy: bool


def extents(pagemap: PageMap) -> list[Extent]:
    """The ranges of ``pagemap`` whose bytes are in its pages image, with their offsets
    (ranges in a parent checkpoint's images take no room in this one)."""
    out, offset = [], 0
    for vaddr, nr_pages, flags in pagemap.entries:
        if flags & PE_PARENT or not flags & PE_PRESENT:
            continue
        out.append(Extent(vaddr, nr_pages, offset, bool(flags & PE_LAZY)))
        offset += nr_pages * PAGE_SIZE
    return out


def eager_ranges(pagemaps: Iterable[PageMap]) -> list[tuple[str, int, int]]:
    """(pages image, offset, length) of the pages ``criu restore`` itself reads (those
    not left to the lazy-pages daemon): they must be in place before the restore."""
    return [(pages_file(pm), e.offset, e.nr_pages * PAGE_SIZE)
            for pm in pagemaps for e in extents(pm) if not e.lazy]


def pages_file(pagemap: PageMap) -> str:
    return f"pages-{pagemap.pages_id}.img"


class Extents:
    """One task's present ranges, looked up by address."""

    def __init__(self, pagemap: PageMap) -> None:
        self.file = pages_file(pagemap)
        self._extents = extents(pagemap)
        self._starts = [e.vaddr for e in self._extents]

    def locate(self, vaddr: int, nr_pages: int) -> tuple[int, int]:
        """(file offset, pages) of the longest run from ``vaddr`` (at most ``nr_pages``)
        inside one range; PageSourceError when ``vaddr`` is in none."""
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i >= 0:
            e = self._extents[i]
            index, rest = divmod(vaddr - e.vaddr, PAGE_SIZE)
            if rest == 0 and index < e.nr_pages:
                return e.offset + index * PAGE_SIZE, min(nr_pages, e.nr_pages - index)
        raise PageSourceError(f"no page at {vaddr:#x} in {self.file}")


class Arrivals:
    """Which byte ranges of which files are in place; ``wait_for`` blocks until a range is
    (a ``WaitFor`` for ``serve``), ``mark`` records one that landed."""

    def __init__(self, timeout: float = 300.0) -> None:
        self._timeout = timeout
        self._ranges: dict[str, list[tuple[int, int]]] = {}  # merged, sorted [start, end)
        self._changed = threading.Condition()
        self._failed: str | None = None
        self._wanted: list[tuple[str, int, int]] = []  # ranges a waiter blocks on

    def mark(self, name: str, offset: int, length: int) -> None:
        with self._changed:
            self._ranges[name] = _merge([*self._ranges.get(name, []), (offset, offset + length)])
            self._changed.notify_all()

    def fail(self, message: str) -> None:
        """Nothing more will arrive: every waiter raises PageSourceError."""
        with self._changed:
            self._failed = message
            self._changed.notify_all()

    def has(self, name: str, offset: int, length: int) -> bool:
        with self._changed:
            return self._covered(name, offset, offset + length)

    def _covered(self, name: str, start: int, end: int) -> bool:
        ranges = self._ranges.get(name, [])
        i = bisect.bisect_right(ranges, (start, float("inf"))) - 1
        return i >= 0 and ranges[i][0] <= start and end <= ranges[i][1]

    def wanted(self) -> tuple[str, int, int] | None:
        """A range someone waits for (a fetcher gets it first), or None."""
        with self._changed:
            return self._wanted[0] if self._wanted else None

    def wait_wanted(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for a range someone waits for."""
        with self._changed:
            self._changed.wait_for(lambda: bool(self._wanted) or self._failed is not None,
                                   timeout)

    def wait_for(self, name: str, offset: int, length: int) -> None:
        with self._changed:
            want = (name, offset, length)
            self._wanted.append(want)
            self._changed.notify_all()
            try:
                arrived = self._changed.wait_for(
                    lambda: self._failed is not None
                    or self._covered(name, offset, offset + length), self._timeout)
            finally:
                self._wanted.remove(want)
            if self._failed is not None:
                raise PageSourceError(f"{name}: {self._failed}")
            if not arrived:
                raise PageSourceError(f"{name} bytes {offset}+{length} did not arrive in "
                                      f"{self._timeout:.0f} s")


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            if data:
                raise PageSourceError("the lazy-pages daemon hung up inside a request")
            return b""
        data += part
    return bytes(data)


def serve(sock: socket.socket, images_dir: Path, pagemaps: Iterable[PageMap],
          wait_for: WaitFor) -> int:
    """Answers the lazy-pages daemon on ``sock`` until it closes the session; returns the
    pages served. PageSourceError (after closing ``sock``, which fails the daemon) when
    it asks for what the images do not have."""
    by_pid = {pm.pid: Extents(pm) for pm in pagemaps}
    files: dict[str, int] = {}
    served = 0
    try:
        while header := _recv_exact(sock, HEADER.size):
            cmd, nr_pages, vaddr, dst_id = HEADER.unpack(header)
            if cmd & PS_CMD_MASK in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                sock.sendall(STATUS.pack(0))
                break
            if cmd != PS_IOV_GET or dst_id not in by_pid:
                raise PageSourceError(f"unexpected request {cmd:#x} for task {dst_id}")
            task = by_pid[dst_id]
            offset, count = task.locate(vaddr, nr_pages)
            length = count * PAGE_SIZE
            wait_for(task.file, offset, length)
            if task.file not in files:
                files[task.file] = os.open(images_dir / task.file, os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(files[task.file], length, offset)
            if len(data) != length:
                raise PageSourceError(f"{task.file} ends before {offset + length}")
            sock.sendall(HEADER.pack(PS_IOV_ADD_F | PE_PRESENT << PS_CMD_BITS, count, vaddr,
                                     dst_id) + data)
            served += count
    finally:
        for fd in files.values():
            os.close(fd)
        sock.close()
    return served


class PageServer:
    """``serve`` in a thread, on one end of a socket pair; the other end is for the
    daemon (``daemon_fd``, to pass as ``--ps-socket``)."""

    def __init__(self, images_dir: Path, pagemaps: Iterable[PageMap], wait_for: WaitFor) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._theirs = theirs
        self.error: BaseException | None = None
        self.served = 0
        maps = list(pagemaps)

        def run() -> None:
            try:
                self.served = serve(ours, images_dir, maps, wait_for)
            except BaseException as exc:  # reported by the daemon's failure and here
                self.error = exc
                log.error("page source for %s: %s", images_dir, exc)

        self._thread = threading.Thread(target=run, name=f"page-source {images_dir}",
                                        daemon=True)
        self._thread.start()

    @property
    def daemon_fd(self) -> int:
        return self._theirs.fileno()

    def handed_over(self) -> None:
        """The daemon holds its end now: close ours, so its death ends the session."""
        self._theirs.close()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
