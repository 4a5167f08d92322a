"""The page source without CRIU: where pages are, what arrived, and the page-xfer answers."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from hermit_node.engine.pagesource import (
    HEADER,
    PAGE_SIZE,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    PS_IOV_ADD_F,
    PS_IOV_CLOSE,
    PS_IOV_GET,
    STATUS,
    Arrivals,
    Extent,
    Extents,
    PageSourceError,
    eager_ranges,
    extents,
    serve,
)
from hermit_node.host.criu import PageMap

P = PAGE_SIZE
LAZY = PE_PRESENT | PE_LAZY
# A stack page read by criu restore itself, a lazy heap of 3 pages, a range in the parent
# checkpoint's images (no room here), and a lazy page after it.
MAP = PageMap(pid=7, pages_id=2, entries=(
    (0x1000, 1, PE_PRESENT), (0x10000, 3, LAZY), (0x20000, 2, PE_PARENT), (0x30000, 1, LAZY)))


def test_extents_place_present_ranges_back_to_back_and_skip_parent_ones() -> None:
    assert extents(MAP) == [Extent(0x1000, 1, 0, False), Extent(0x10000, 3, P, True),
                            Extent(0x30000, 1, 4 * P, True)]
    assert eager_ranges([MAP]) == [("pages-2.img", 0, P)]


def test_locate_stays_inside_one_range() -> None:
    where = Extents(MAP)
    assert where.locate(0x10000, 8) == (P, 3)
    assert where.locate(0x11000, 1) == (2 * P, 1)
    assert where.locate(0x30000, 4) == (4 * P, 1)
    for vaddr in (0x0, 0x13000, 0x20000, 0x10800):
        with pytest.raises(PageSourceError, match="no page at"):
            where.locate(vaddr, 1)


def test_arrivals_merge_ranges_and_wake_a_waiter() -> None:
    arrivals = Arrivals(timeout=30)
    arrivals.mark("f", 0, 10)
    arrivals.mark("f", 20, 10)
    assert arrivals.has("f", 0, 10) and not arrivals.has("f", 5, 20)
    arrivals.mark("f", 10, 10)
    assert arrivals.has("f", 0, 30) and not arrivals.has("g", 0, 1)
    waiting = threading.Thread(target=arrivals.wait_for, args=("f", 30, 5))
    waiting.start()
    while arrivals.wanted() is None:
        waiting.join(0.01)
    assert arrivals.wanted() == ("f", 30, 5)
    arrivals.mark("f", 30, 5)
    waiting.join(10)
    assert not waiting.is_alive() and arrivals.wanted() is None


def test_a_range_that_never_arrives_fails_the_waiter() -> None:
    with pytest.raises(PageSourceError, match="did not arrive in 0 s"):
        Arrivals(timeout=0.05).wait_for("f", 0, 1)
    failed = Arrivals(timeout=30)
    failed.fail("the download failed")
    with pytest.raises(PageSourceError, match="f: the download failed"):
        failed.wait_for("f", 0, 1)


def _images(tmp_path: Path) -> Path:
    (tmp_path / "pages-2.img").write_bytes(b"".join(bytes([i]) * P for i in range(5)))
    return tmp_path


def _ask(sock: socket.socket, cmd: int, nr_pages: int = 0, vaddr: int = 0,
         pid: int = 0) -> None:
    sock.sendall(HEADER.pack(cmd, nr_pages, vaddr, pid))


def _recv(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size and (part := sock.recv(size - len(data))):
        data += part
    return data


def test_serve_answers_gets_then_close(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    arrivals = Arrivals(timeout=30)
    arrivals.mark("pages-2.img", 0, 5 * P)
    result: list[int] = []
    server = threading.Thread(target=lambda: result.append(
        serve(ours, _images(tmp_path), [MAP], arrivals.wait_for)))
    server.start()
    _ask(theirs, PS_IOV_GET, 8, 0x11000, 7)
    header = HEADER.unpack(_recv(theirs, HEADER.size))
    assert header == (PS_IOV_ADD_F | PE_PRESENT << 16, 2, 0x11000, 7)
    assert _recv(theirs, 2 * P) == bytes([2]) * P + bytes([3]) * P
    _ask(theirs, PS_IOV_CLOSE)
    assert STATUS.unpack(_recv(theirs, STATUS.size)) == (0,)
    server.join(10)
    assert result == [2]
    theirs.close()


def test_serve_waits_for_a_page_to_arrive(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    arrivals = Arrivals(timeout=30)
    server = threading.Thread(target=serve, args=(ours, _images(tmp_path), [MAP],
                                                  arrivals.wait_for))
    server.start()
    _ask(theirs, PS_IOV_GET, 1, 0x30000, 7)
    while arrivals.wanted() is None:
        server.join(0.01)
    assert arrivals.wanted() == ("pages-2.img", 4 * P, P)
    arrivals.mark("pages-2.img", 4 * P, P)
    assert HEADER.unpack(_recv(theirs, HEADER.size))[1:] == (1, 0x30000, 7)
    assert _recv(theirs, P) == bytes([4]) * P
    theirs.close()
    server.join(10)
    assert not server.is_alive()


def test_serve_refuses_an_unknown_task_and_hangs_up(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    _ask(theirs, PS_IOV_GET, 1, 0x10000, 8)
    with pytest.raises(PageSourceError, match="for task 8"):
        serve(ours, _images(tmp_path), [MAP], Arrivals().wait_for)
    assert theirs.recv(1) == b""
    theirs.close()
