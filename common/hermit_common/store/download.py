"""Downloads: a checkpoint's manifest opened and bound, its trees made under the
destination, every chunk fetched (from the node's chunk cache first) and verified before
its bytes land; chunks a restore defers (``Deferred``), and the prefetch into the cache."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from hermit_common import chunkcache
from hermit_common.chunkcache import CacheTally, ChunkCache
from hermit_common.errors import CheckpointFailed, CheckpointRefused
from hermit_common.manifest import Manifest
from hermit_common.pin import Pin
from hermit_common.s3errors import StoreNotFound
from hermit_common.seal import ChunkCipher
from hermit_common.store.chunks import Codec, ignore, object_name, run_parallel
from hermit_common.store.datakeys import DataKeys, check_binding
from hermit_common.store.objects import Objects
from hermit_common.tree import KIND_DIR, KIND_FIFO, KIND_FILE, KIND_SYMLINK, Entry

log = logging.getLogger("hermit_common.store")

# (section, path inside it) -> True: a download leaves that file's chunks to a Deferred.
Defer = Callable[[str, str], bool]
# (file path, offset, length) of bytes that landed, verified.
Landed = Callable[[str, int, int], None]


class _Location:
    __slots__ = ("label", "length", "offset", "path")

    def __init__(self, path: str, offset: int, length: int, label: str) -> None:
        self.path, self.offset, self.length, self.label = path, offset, length, label


@dataclass(frozen=True)
class _Where:
    """The checkpoint a download fetches chunks for, and their cipher (None: plain)."""

    namespace: str
    sandbox: str
    checkpoint: str
    cipher: ChunkCipher | None
    tally: CacheTally | None = None  # chunks found in the cache, and fetched


def _write_all(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)


def _apply_metadata(path: str, entry: Entry, is_root: bool) -> None:
    if is_root:
        os.chown(path, entry.uid, entry.gid, follow_symlinks=False)
    if entry.kind != KIND_SYMLINK:
        os.chmod(path, entry.mode)
    os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)


class Deferred:
    """Chunks a download left for later (``download_deferred``), fetched while their files
    are already in use: the chunks under given ranges first (``fetch_ranges``), then the
    rest (``fetch_rest``), each as soon as someone waits for it."""

    def __init__(self, fetch_one: Callable[[str, list[_Location], threading.Event], None],
                 locations: dict[str, list[_Location]], workers: int) -> None:
        self._fetch_one = fetch_one
        self._locations = locations
        self._workers = workers
        self._order = list(locations)
        self._taken: set[str] = set()
        self._lock = threading.Lock()
        self.stop = threading.Event()

    @property
    def bytes_total(self) -> int:
        return sum(loc.length for locs in self._locations.values() for loc in locs)

    def _under(self, path: str, offset: int, length: int) -> list[str]:
        return [d for d, locs in self._locations.items() for loc in locs
                if loc.path == path and loc.offset < offset + length
                and offset < loc.offset + loc.length]

    def _fetch(self, digest: str, landed: Landed) -> None:
        locs = self._locations[digest]
        self._fetch_one(digest, locs, self.stop)
        if self.stop.is_set():
            raise CheckpointFailed("the download was stopped")
        for loc in locs:
            landed(loc.path, loc.offset, loc.length)

    def _take(self, digests: Iterable[str]) -> str | None:
        with self._lock:
            for digest in digests:
                if digest not in self._taken:
                    self._taken.add(digest)
                    return digest
        return None

    def fetch_ranges(self, ranges: Iterable[tuple[str, int, int]], landed: Landed) -> None:
        """Fetches (now, in parallel) the chunks under ``ranges`` (path, offset, length)."""
        wanted = list(dict.fromkeys(d for r in ranges for d in self._under(*r)))
        jobs = [partial(self._fetch, d, landed) for d in wanted if self._take([d])]
        run_parallel(self._workers, "hermit-download", jobs, ignore, self.stop)

    def fetch_rest(self, landed: Landed, wanted: Callable[[], tuple[str, int, int] | None], *,
                   bulk: threading.Event | None = None,
                   idle: Callable[[], None] = lambda: time.sleep(0.01)) -> None:
        """Fetches every chunk not fetched yet, a chunk under ``wanted()`` first, the others
        only once ``bulk`` is set (None: at once); ``idle()`` waits a little for either.
        Raises the first failure once the other workers stopped."""
        errors: list[BaseException] = []

        def work() -> None:
            try:
                while not self.stop.is_set():
                    want = wanted()
                    digest = want and self._take(self._under(*want))
                    if not digest and (bulk is None or bulk.is_set()):
                        digest = self._take(self._order)
                        if digest is None:
                            return
                    if digest:
                        self._fetch(digest, landed)
                    elif len(self._taken) == len(self._order):
                        return
                    else:
                        idle()
            except BaseException as exc:
                errors.append(exc)
                self.stop.set()

        threads = [threading.Thread(target=work, name=f"hermit-deferred-{i}", daemon=True)
                   for i in range(max(1, min(self._workers, len(self._order))))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]


class Downloader:
    """The download side of a CheckpointStore, with its node-local chunk cache (None:
    every chunk comes from S3)."""

    def __init__(self, objects: Objects, keys: DataKeys, codec: Codec,
                 cache: ChunkCache | None) -> None:
        self.objects, self.keys, self.codec, self.cache = objects, keys, codec, cache

    def download_deferred(self, pin: Pin, dest: Path, *, defer: Defer | None,
                          tally: CacheTally | None) -> tuple[Manifest, Deferred]:
        """``CheckpointStore.download_deferred``."""
        namespace, sandbox, checkpoint = pin.namespace, pin.sandbox, pin.checkpoint
        expect_uid = pin.bound()
        opened = self.keys.open_manifest(pin)
        manifest, cipher = opened.manifest, opened.cipher
        check_binding(manifest, namespace, sandbox, checkpoint, expect_uid)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        created: list[Path] = []
        try:
            for name in manifest.sections:
                section_root = dest / name
                try:
                    section_root.mkdir(mode=0o700)
                except FileExistsError:
                    raise CheckpointFailed(
                        f"cannot restore into {section_root}: it already exists") from None
                created.append(section_root)
            where = _Where(namespace, sandbox, checkpoint, cipher, tally)
            later = self._materialize(manifest, dest, where, defer)
        except BaseException:
            for path in created:
                shutil.rmtree(path, ignore_errors=True)
            raise
        return manifest, Deferred(
            partial(self._fetch_chunk, chunk_size=manifest.chunk_size, at=where), later,
            self.objects.settings.transfer_concurrency)

    def _materialize(self, manifest: Manifest, dest: Path, where: _Where,
                     defer: Defer | None = None) -> dict[str, list[_Location]]:
        """Writes the checkpoint under ``dest``; returns the chunks left for later."""
        locations: dict[str, list[_Location]] = {}
        later: dict[str, list[_Location]] = {}
        chunk_size = manifest.chunk_size
        for name, entries in manifest.sections.items():
            root = os.fspath(dest / name)
            for entry in entries:
                full = os.path.join(root, entry.path)
                if entry.kind == KIND_DIR:
                    os.mkdir(full, 0o700)
                elif entry.kind == KIND_FILE:
                    fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600)
                    try:
                        os.ftruncate(fd, entry.size)
                    finally:
                        os.close(fd)
                    into = later if defer is not None and defer(name, entry.path) \
                        else locations
                    for digest, (offset, length) in zip(entry.chunks,
                                                        entry.chunk_spans(chunk_size),
                                                        strict=True):
                        into.setdefault(digest, []).append(
                            _Location(full, offset, length, f"{name}/{entry.path}"))
        self._fetch_chunks(locations, chunk_size, where)
        is_root = os.geteuid() == 0
        dirs: list[tuple[str, Entry]] = []
        for name, entries in manifest.sections.items():
            root = os.fspath(dest / name)
            for entry in entries:
                full = os.path.join(root, entry.path)
                if entry.kind == KIND_SYMLINK:
                    assert entry.target is not None
                    os.symlink(entry.target, full)
                elif entry.kind == KIND_FIFO:
                    os.mkfifo(full, 0o600)
                elif entry.kind == KIND_DIR:
                    dirs.append((full, entry))
                    continue
                elif entry.kind != KIND_FILE:
                    continue  # whiteouts stay manifest entries
                _apply_metadata(full, entry, is_root)
        for full, entry in sorted(dirs, key=lambda d: d[0].count("/"), reverse=True):
            _apply_metadata(full, entry, is_root)
        return later

    def _fetch_chunks(self, locations: Mapping[str, list[_Location]], chunk_size: int,
                      where: _Where) -> None:
        stop = threading.Event()
        jobs = [partial(self._fetch_chunk, digest, locs, stop, chunk_size=chunk_size, at=where)
                for digest, locs in locations.items()]
        run_parallel(self.objects.settings.transfer_concurrency, "hermit-download", jobs,
                     ignore, stop)

    def _fetch_chunk(self, digest: str, locs: list[_Location], stop: threading.Event, *,
                     chunk_size: int, at: _Where) -> None:
        if stop.is_set():
            return
        name = object_name(at.cipher, digest)
        key = self.objects.chunk_key(at.namespace, at.sandbox, name)
        where = f"checkpoint {at.namespace}/{at.checkpoint}: chunk {digest} of {locs[0].label}"
        data = self._cached_chunk(key, name, digest, chunk_size, at, where)
        if data is None:
            data = self._fetch_once(key, name, digest, chunk_size, at, where, stop)
        for loc in locs:
            if len(data) != loc.length:
                raise CheckpointRefused(
                    f"checkpoint {at.namespace}/{at.checkpoint}: chunk {digest} of {loc.label} "
                    f"has {len(data)} bytes, the manifest expects {loc.length}")
            _write_all(loc.path, loc.offset, data)

    def _fetch_once(self, key: str, name: str, digest: str, chunk_size: int, at: _Where,
                    where: str, stop: threading.Event) -> bytes:
        """The chunk, fetched from S3 once on this node for every download that wants it
        at the same time (single-flight through the cache): a thread that finds another
        fetching it waits, then reads and verifies the cache entry itself; when that fetch
        failed or its entry is not there (refused, evicted), it fetches from S3 itself."""
        if self.cache is None:
            return self._fetch_from_s3(key, name, digest, chunk_size, at, where)
        entry = self.cache_name(key)
        pending = self.cache.claim(entry)
        if pending is not None:
            self.cache.await_fetch(pending, self._follow_seconds(), stop)
            data = self._cached_chunk(key, name, digest, chunk_size, at, where)
            if data is not None:
                return data
            return self._fetch_from_s3(key, name, digest, chunk_size, at, where)
        try:
            # A fetch that ended between our miss and our claim may have stored it.
            data = self._cached_chunk(key, name, digest, chunk_size, at, where)
            if data is not None:
                return data
            return self._fetch_from_s3(key, name, digest, chunk_size, at, where)
        finally:
            self.cache.release(entry)

    def _follow_seconds(self) -> float:
        """How long a thread waits for another's fetch of the same chunk: one S3 read
        timeout. A GET stalled that long is likely retrying, and the waiter fetching
        itself then costs one more GET, not a stuck restore."""
        return self.objects.settings.read_timeout_seconds

    def _fetch_from_s3(self, key: str, name: str, digest: str, chunk_size: int, at: _Where,
                       where: str) -> bytes:
        """The chunk from S3, verified, then kept in the cache (when there is one)."""
        compressed = self._get_chunk(key, where, chunk_size)
        data = self.codec.open_chunk(compressed, name, digest, chunk_size, at.cipher, where)
        self._cache_put(key, compressed, at.tally)
        if at.tally is not None:
            at.tally.miss()
        return data

    def _get_chunk(self, key: str, where: str, chunk_size: int) -> bytes:
        """A chunk's stored object, from S3."""
        try:
            return self.objects.get(key, "download chunk", 2 * chunk_size + (1 << 20))
        except CheckpointRefused as exc:
            raise CheckpointRefused(f"{where} is too large: {exc}") from None
        except StoreNotFound:
            raise CheckpointRefused(f"{where} is missing from the store") from None

    # -- the node-local chunk cache (chunkcache.py) ------------------------------------

    def cache_name(self, key: str) -> str:
        """The cache entry name of the object at ``key`` (its endpoint and bucket too)."""
        return chunkcache.entry_name(f"{self.objects.endpoint}\n{self.objects.settings.bucket}",
                                     key)

    def _cached_chunk(self, key: str, name: str, digest: str, chunk_size: int, at: _Where,
                      where: str) -> bytes | None:
        """The chunk's bytes from the cache, verified exactly as from S3; None when it is
        not there or fails (a failed entry is deleted: the caller fetches it from S3)."""
        if self.cache is None:
            return None
        entry = self.cache_name(key)
        compressed = self.cache.get(entry)
        if compressed is None:
            return None
        try:
            data = self.codec.open_chunk(compressed, name, digest, chunk_size, at.cipher,
                                         where)
        except CheckpointRefused as exc:
            log.warning("chunk cache: dropping a bad entry (%s); fetching it from S3", exc)
            self.cache.discard(entry)
            return None
        if at.tally is not None:
            at.tally.hit()
        return data

    def _cache_put(self, key: str, compressed: bytes, tally: CacheTally | None) -> bool:
        """Keeps a verified chunk object in the cache (when there is one)."""
        if self.cache is None or not self.cache.put(self.cache_name(key), compressed):
            return False
        if tally is not None:
            tally.stored(len(compressed))
        return True

    def prefetch(self, pin: Pin, *, stop: threading.Event, tally: CacheTally | None,
                 workers: int) -> int:
        """``CheckpointStore.prefetch``."""
        if self.cache is None:
            return 0
        cache = self.cache
        namespace, sandbox, checkpoint = pin.namespace, pin.sandbox, pin.checkpoint
        expect_uid = pin.bound()
        opened = self.keys.open_manifest(pin)
        manifest = opened.manifest
        check_binding(manifest, namespace, sandbox, checkpoint, expect_uid)
        tally = tally if tally is not None else CacheTally()
        at = _Where(namespace, sandbox, checkpoint, opened.cipher, tally)

        def one(digest: str) -> None:
            if stop.is_set() or tally.stored_bytes >= cache.max_bytes:
                return
            name = object_name(at.cipher, digest)
            key = self.objects.chunk_key(namespace, sandbox, name)
            entry = self.cache_name(key)
            # In the cache, or being fetched into it (by a restore or another prefetch).
            if entry in cache or cache.claim(entry) is not None:
                return
            where = f"checkpoint {namespace}/{checkpoint}: chunk {digest}"
            try:
                if entry in cache:  # stored by a fetch that ended before our claim
                    return
                compressed = self._get_chunk(key, where, manifest.chunk_size)
                self.codec.open_chunk(compressed, name, digest, manifest.chunk_size,
                                      at.cipher, where)
                self._cache_put(key, compressed, tally)
            except CheckpointRefused as exc:  # missing or bad: not cached, the rest goes on
                log.warning("prefetch: %s", exc)
            finally:
                cache.release(entry)

        jobs = [partial(one, d) for d in sorted(manifest.chunk_digests())]
        run_parallel(workers, "hermit-prefetch", jobs, ignore, threading.Event())
        return tally.stored_bytes
