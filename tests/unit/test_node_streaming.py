"""streaming: which chunks of a page image being written are final, and staging them."""

from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

from hermit_node.engine.streaming import ImageStreamer, final_chunks
from hermit_node.host.pagemap import PAGE_SIZE, PAGEMAP_MAGIC, PE_PRESENT
from hermit_node.host.protowire import IMG_COMMON_MAGIC
from tests.support.pagemap import pb_msg

P = PAGE_SIZE
CHUNK = 4 * P


def _record(message: bytes) -> bytes:
    return struct.pack("<I", len(message)) + message


def test_only_chunks_the_pagemap_closes_and_the_file_holds_are_final() -> None:
    runs = [(0, 10 * P)]  # cut at 4 and 8 pages; the last 2 pages may still grow
    assert final_chunks(runs, 10 * P, CHUNK) == [(0, CHUNK), (CHUNK, CHUNK)]
    assert final_chunks(runs, 5 * P, CHUNK) == [(0, CHUNK)]  # the file lags behind
    assert final_chunks([], 0, CHUNK) == []


class _Recorder:
    def __init__(self) -> None:
        self.staged: list[tuple[str, int, int, bytes]] = []
        self.lock = threading.Lock()

    def stage(self, path: str, offset: int, length: int) -> None:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        with self.lock:
            self.staged.append((os.path.basename(path), offset, length, data))


def test_the_streamer_stages_final_chunks_as_the_dump_writes_them(tmp_path: Path) -> None:
    """A simulated dump: the pagemap grows entry by entry (a cut-off record at times),
    the page image behind it; every staged chunk holds its final bytes."""
    pages = tmp_path / "pages-3.img"
    pagemap = tmp_path / "pagemap-42.img"
    recorder = _Recorder()
    content = bytes(range(256)) * (24 * P // 256)
    with ImageStreamer(recorder, tmp_path, CHUNK, workers=2, poll_seconds=0.001) as streamer:
        pagemap.write_bytes(struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC))
        with pagemap.open("ab") as pm, pages.open("ab") as pg:
            pm.write(_record(pb_msg((1, 3))))
            for i in range(6):  # six entries of 4 pages at 2 pages past each 16 KiB
                record = _record(pb_msg((1, 2 * P + i * CHUNK), (2, 0), (4, PE_PRESENT), (5, 4)))
                pm.write(record[:3])
                pm.flush()
                pm.write(record[3:])
                pm.flush()
                pg.write(content[i * CHUNK:(i + 1) * CHUNK])
                pg.flush()
                time.sleep(0.01)  # the dump's pace: the streamer polls in between
    assert streamer.staged == len(recorder.staged) >= 1
    final = pages.read_bytes()
    assert {(o, n) for _, o, n, _ in recorder.staged} <= \
        {(0, 2 * P)} | {(2 * P + i * CHUNK, CHUNK) for i in range(5)}
    for name, offset, length, data in recorder.staged:
        assert name == "pages-3.img" and data == final[offset:offset + length]


def test_a_failed_staged_put_is_uploaded_again_by_finish() -> None:
    """Chunk a's PUT failed after claiming its name; b (same content) took it for
    uploaded. Settling before finish forgets both, so finish uploads that content."""
    from hermit_common.store.upload import _settle_staged, _UploadState

    state = _UploadState({"old": 10}, None)
    state.claimed |= {"x", "y"}
    state.sizes["y"] = 7  # y's PUT succeeded, x's failed
    state.staged = {("p", 0, 4): "x", ("p", 4, 4): "x", ("p", 8, 4): "y"}
    _settle_staged(state)
    assert state.claimed == {"old", "y"}
    assert state.staged == {("p", 8, 4): "y"}
