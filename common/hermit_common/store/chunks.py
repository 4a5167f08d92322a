"""A chunk's stored form, for uploads and downloads alike: its object name (the digest,
or sealed its HMAC), zstd compression (zero chunks precomputed), the checks a stored
chunk passes before its bytes are used, and the worker pool chunks move in."""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Final, TypeVar

import zstandard

from hermit_common.errors import CheckpointRefused
from hermit_common.seal import ChunkCipher

ZSTD_LEVEL: Final = 3

_T = TypeVar("_T")


def object_name(cipher: ChunkCipher | None, digest: str) -> str:
    """The object name of the chunk with plaintext digest ``digest``."""
    return digest if cipher is None else cipher.name(digest)


# Zero chunks (untouched pages CRIU dumps, sparse files) skip hashing and compression:
# their digest and compressed form depend on their length only (a few lengths a run).
def is_zero(data: bytes) -> bool:
    """All zero bytes: the ends first (most chunks fail there), then one memcmp."""
    return data[:1] == b"\0" and data[-1:] == b"\0" and data == _zeros(len(data))


@functools.lru_cache(maxsize=4)
def _zeros(length: int) -> bytes:
    return bytes(length)


@functools.lru_cache(maxsize=64)
def zero_digest(length: int) -> str:
    return hashlib.sha256(_zeros(length)).hexdigest()


@functools.lru_cache(maxsize=64)
def zero_body(length: int) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(_zeros(length))


class Codec:
    """zstd compression and decompression, one (de)compressor per thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def compressor(self) -> zstandard.ZstdCompressor:
        comp = getattr(self._local, "compressor", None)
        if comp is None:
            comp = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
            self._local.compressor = comp
        return comp

    def decompressor(self) -> zstandard.ZstdDecompressor:
        dec = getattr(self._local, "decompressor", None)
        if dec is None:
            dec = zstandard.ZstdDecompressor()
            self._local.decompressor = dec
        return dec

    def open_chunk(self, compressed: bytes, name: str, digest: str, chunk_size: int,
                   cipher: ChunkCipher | None, where: str) -> bytes:
        """A chunk's bytes from its stored object: unsealed, decompressed and checked
        against ``digest``; CheckpointRefused when any of that fails."""
        if cipher is not None:
            try:
                compressed = cipher.open(name, compressed)
            except CheckpointRefused as exc:
                raise CheckpointRefused(f"{where} is refused: {exc}") from None
        try:
            data = self.decompressor().decompress(compressed, max_output_size=chunk_size)
        except zstandard.ZstdError as exc:
            raise CheckpointRefused(f"{where} is corrupt: cannot decompress ({exc})") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise CheckpointRefused(f"{where} is corrupt: its content has sha256 {actual}")
        return data


def run_parallel(max_workers: int, thread_name: str, jobs: Sequence[Callable[[], _T]],
                 on_done: Callable[[_T], None], stop: threading.Event) -> None:
    """Runs ``jobs`` on up to ``max_workers`` threads, each result to ``on_done`` as it comes.

    The first failure (of a job or of ``on_done``) sets ``stop``, cancels the jobs
    not started yet and is raised once the running ones have finished.
    """
    if not jobs:
        return
    workers = max(1, min(max_workers, len(jobs)))
    with ThreadPoolExecutor(workers, thread_name_prefix=thread_name) as pool:
        pending: set[Future[_T]] = {pool.submit(job) for job in jobs}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    on_done(future.result())
        except BaseException:
            stop.set()
            for future in pending:
                future.cancel()
            raise


def ignore(_result: object) -> None:
    pass
