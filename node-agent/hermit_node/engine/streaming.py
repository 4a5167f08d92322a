"""Upload CRIU's page images while CRIU is still writing them.

A migrating checkpoint is durable only once CRIU has dumped and the store has every
chunk: one after the other, notice -> durable is dump + upload. CRIU writes each
process's ``pages-<id>.img`` front to back and never goes back (it appends what its
page pipes hold), and writes the matching ``pagemap-<pid>.img`` entries alongside
(buffered, so behind). So a chunk of a page image is final once the pagemap entries
written so far place a cut after it (``pagemap.chunk_lengths`` only ever appends) and
the file has grown past it: ``ImageStreamer`` follows the images directory during the
dump and hands such chunks to the upload session, which hashes, compresses and PUTs
them on other threads. The final upload then reads only what was not staged (the
tail of each page image, the other images, the files), and writes the manifest last
as always. If the dump fails, staged chunks are unreferenced chunks (garbage
collection takes them); the cuts are the ones the final upload makes (same pagemap
rules), so staged chunks are exactly the manifest's.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Final, Protocol

from hermit_node.host import pagemap

log = logging.getLogger(__name__)

POLL_SECONDS: Final = 0.05
_MAX_PAGEMAP_BYTES: Final = 64 << 20


class Stager(Protocol):
    def stage(self, path: str, offset: int, length: int) -> None: ...


def final_chunks(runs: list[pagemap.Run], pages_size: int, chunk_size: int
                 ) -> list[tuple[int, int]]:
    """From the runs a pagemap being written lists so far and its page image's current
    size: the (offset, length) of the page image's chunks that can no longer change."""
    spans, offset = [], 0
    for length in pagemap.chunk_lengths(runs, chunk_size)[:-1]:  # the last may grow
        if offset + length > pages_size:
            break
        spans.append((offset, length))
        offset += length
    return spans


class ImageStreamer:
    """Follows ``images`` on a thread of its own and stages every final chunk of the
    page images on ``workers`` threads, until ``stop``. Staging failures are left to
    the final upload (it uploads what was not staged)."""

    def __init__(self, stager: Stager, images: Path, chunk_size: int, workers: int,
                 poll_seconds: float = POLL_SECONDS) -> None:
        self._stager, self._images, self._chunk_size = stager, os.fspath(images), chunk_size
        self._poll = poll_seconds
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="hermit-stream")
        self._submitted: set[tuple[str, int]] = set()
        self._futures: list[Future[None]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="hermit-stream-follow",
                                        daemon=True)
        self.staged = 0

    def __enter__(self) -> ImageStreamer:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stops following; chunks being PUT finish, queued ones are left to the upload."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        finished = [f for f in self._futures if f.done() and not f.cancelled()]
        failed = [f.exception() for f in finished if f.exception() is not None]
        self.staged = len(finished) - len(failed)
        if failed:
            log.warning("%d chunks of %s could not be uploaded during the dump (the upload "
                        "after it sends them): %s", len(failed), self._images, failed[0])

    def _follow(self) -> None:
        while not self._stopping.is_set():
            try:
                self._scan()
            except Exception:  # never fail the dump: the final upload does it all
                log.exception("streaming the page images of %s", self._images)
                return
            self._stopping.wait(self._poll)

    def _scan(self) -> None:
        for name in os.listdir(self._images):
            if not name.startswith("pagemap-") or not name.endswith(".img"):
                continue
            try:
                with open(os.path.join(self._images, name), "rb") as f:
                    pages_id, runs = pagemap.parse_pagemap(f.read(_MAX_PAGEMAP_BYTES),
                                                           partial=True)
                pages = f"pages-{pages_id}.img"
                path = os.path.join(self._images, pages)
                spans = final_chunks(runs, os.lstat(path).st_size, self._chunk_size)
            except (OSError, pagemap.PagemapError):
                continue
            for offset, length in spans:
                if (pages, offset) not in self._submitted and not self._stopping.is_set():
                    self._submitted.add((pages, offset))
                    self._futures.append(self._pool.submit(
                        self._stager.stage, path, offset, length))
