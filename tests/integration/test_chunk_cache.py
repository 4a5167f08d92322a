"""The node-local chunk cache against a real MinIO: after a prefetch of checkpoint A, a
download of checkpoint B (sharing most chunks) fetches only B's other chunks from S3, a
corrupted cache entry is fetched again, and concurrent downloads of one checkpoint fetch
each chunk once (docs/storage.md, "Prefetch and the chunk cache")."""

from __future__ import annotations

import base64
import os
import random
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hermit_common.chunkcache import CacheTally, ChunkCache
from hermit_common.errors import CheckpointRefused
from hermit_common.manifest import Binding, Manifest
from hermit_common.pin import Pin
from hermit_common.seal import Keyring, KeyringWrapper, Sealing
from hermit_common.store import CheckpointStore
from tests.support.minio import MinioServer

pytestmark = pytest.mark.integration

CHUNK = 64 * 1024
NS, BOX, UID = "team-a", "agent-1", "7f1c0c8e-uid"


class CountingClient:
    """The real S3 client, counting the objects it GETs (by key)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.gets: Counter[str] = Counter()
        self.chunk_delay = 0.0  # seconds each chunk GET is held up (as over a slow link)
        self._lock = threading.Lock()

    def get_object(self, **kw: Any) -> Any:
        with self._lock:  # downloads GET from many threads
            self.gets[kw["Key"]] += 1
        if self.chunk_delay and "/chunks/" in kw["Key"]:
            time.sleep(self.chunk_delay)
        return self._client.get_object(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def chunk_gets(self) -> Counter[str]:
        return Counter({k: n for k, n in self.gets.items() if "/chunks/" in k})


def _binding(checkpoint: str) -> Binding:
    return Binding(namespace=NS, sandbox=BOX, sandbox_uid=UID, checkpoint=checkpoint,
                   criu_version="4.2.1", kernel="6.18.0")


def _tree(root: Path, changed: int | None = None) -> dict[str, Path]:
    """20 chunks of random pages (one of them rewritten when ``changed``) and a small
    file."""
    rng = random.Random(7)
    pages = bytearray(rng.randbytes(20 * CHUNK))
    if changed is not None:
        pages[changed * CHUNK:(changed + 1) * CHUNK] = random.Random(99).randbytes(CHUNK)
    criu = root / "criu"
    criu.mkdir(parents=True)
    (criu / "pages-1.img").write_bytes(bytes(pages))
    (criu / "core-1.img").write_bytes(b"core" if changed is None else b"core, later")
    return {"criu": criu}


@pytest.fixture
def stores(minio_server: MinioServer, request: pytest.FixtureRequest,
           tmp_path: Path) -> tuple[CheckpointStore, CheckpointStore, CountingClient]:
    """(a store that writes, a store with a chunk cache whose S3 GETs are counted)."""
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    settings = minio_server.settings(f"t-{name}-{os.getpid()}", chunk_size_bytes=CHUNK)
    writer = CheckpointStore(settings)
    writer.ensure_bucket()
    counting = CountingClient(writer.client)
    reader = CheckpointStore(settings, counting,
                             cache=ChunkCache(tmp_path / "chunk-cache", 64 * CHUNK))
    return writer, reader, counting


def _keys(store: CheckpointStore, manifest: Manifest) -> set[str]:
    return {store.chunk_key(NS, BOX, d) for d in manifest.chunk_digests()}


def test_a_download_after_a_prefetch_fetches_only_the_changed_chunks(
        stores: tuple[CheckpointStore, CheckpointStore, CountingClient], tmp_path: Path,
) -> None:
    writer, reader, counting = stores
    a = writer.upload(_binding("a"), _tree(tmp_path / "a"), {})
    b = writer.upload(_binding("b"), _tree(tmp_path / "b", changed=5), {})
    only_b = _keys(writer, b.manifest) - _keys(writer, a.manifest)
    assert len(only_b) == 2  # the rewritten page chunk and core-1.img

    prefetched = CacheTally()
    stored = reader.prefetch(Pin(NS, BOX, "a", uid=UID, digest=a.manifest_digest),
                             stop=threading.Event(), tally=prefetched)
    assert stored == prefetched.stored_bytes == a.stored_bytes > 0
    assert set(counting.chunk_gets()) == _keys(writer, a.manifest)
    counting.gets.clear()
    # A second prefetch finds everything there.
    assert reader.prefetch(Pin(NS, BOX, "a", uid=UID), stop=threading.Event()) == 0
    assert counting.chunk_gets() == Counter()

    tally = CacheTally()
    reader.download_deferred(Pin(NS, BOX, "b", uid=UID, digest=b.manifest_digest),
                             tmp_path / "restored", tally=tally)
    assert set(counting.chunk_gets()) == only_b, "a chunk in the cache was fetched from S3"
    assert (tally.hits, tally.misses) == (len(b.manifest.chunk_digests()) - 2, 2)
    assert (tmp_path / "restored" / "criu" / "pages-1.img").read_bytes() == \
        (tmp_path / "b" / "criu" / "pages-1.img").read_bytes()
    print(f"checkpoint b: {tally.hits} of {tally.chunks} chunks from the cache, "
          f"{len(counting.chunk_gets())} fetched from S3")


def test_a_corrupted_cache_entry_is_fetched_again_and_replaced(
        stores: tuple[CheckpointStore, CheckpointStore, CountingClient], tmp_path: Path,
) -> None:
    writer, reader, counting = stores
    a = writer.upload(_binding("a"), _tree(tmp_path / "a"), {})
    reader.prefetch(Pin(NS, BOX, "a", uid=UID), stop=threading.Event())
    cache = reader.cache
    assert cache is not None
    entry = next(e for e in a.manifest.sections["criu"] if e.path == "pages-1.img")
    victim = writer.chunk_key(NS, BOX, entry.chunks[3])
    name = reader._cache_name(victim)
    good = (cache.root / name).read_bytes()
    (cache.root / name).write_bytes(good[:-8] + b"garbage!")
    counting.gets.clear()

    tally = CacheTally()
    reader.download(Pin(NS, BOX, "a", uid=UID), tmp_path / "restored")
    reader.download_deferred(Pin(NS, BOX, "a", uid=UID), tmp_path / "again", tally=tally)
    assert counting.chunk_gets() == Counter({victim: 1}), "only the bad entry is re-fetched"
    assert (cache.root / name).read_bytes() == good, "the bad entry was not replaced"
    assert tally.misses == 0
    for dest in ("restored", "again"):
        assert (tmp_path / dest / "criu" / "pages-1.img").read_bytes() == \
            (tmp_path / "a" / "criu" / "pages-1.img").read_bytes()


def test_a_prefetch_opens_the_manifest_as_a_restore_does_and_stops_when_told(
        stores: tuple[CheckpointStore, CheckpointStore, CountingClient], tmp_path: Path,
) -> None:
    writer, reader, counting = stores
    writer.upload(_binding("a"), _tree(tmp_path / "a"), {})
    cache = reader.cache
    assert cache is not None
    with pytest.raises(CheckpointRefused, match="uid"):
        reader.prefetch(Pin(NS, BOX, "a", uid="someone-else"), stop=threading.Event())
    with pytest.raises(CheckpointRefused, match="manifest digest"):
        reader.prefetch(Pin(NS, BOX, "a", uid=UID, digest="sha256:" + "0" * 64),
                        stop=threading.Event())
    stop = threading.Event()
    stop.set()
    assert reader.prefetch(Pin(NS, BOX, "a", uid=UID), stop=stop) == 0
    assert len(cache) == 0 and counting.chunk_gets() == Counter()


def test_a_sealed_store_caches_sealed_objects_and_verifies_them(
        minio_server: MinioServer, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Sealed: the cache holds the objects as stored (sealed, named by HMAC); a download
    unseals and checks each one, and a prefetch opens the manifest with its signature."""
    secret = {"k1": base64.b64encode(os.urandom(32)).decode(), "current": "k1"}
    sealing = Sealing(KeyringWrapper(lambda: Keyring.from_mapping(secret, "test Secret")))
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    settings = minio_server.settings(f"s-{name}-{os.getpid()}", chunk_size_bytes=CHUNK)
    writer = CheckpointStore(settings, sealing=sealing)
    writer.ensure_bucket()
    counting = CountingClient(writer.client)
    reader = CheckpointStore(settings, counting, sealing=sealing,
                             cache=ChunkCache(tmp_path / "chunk-cache", 64 * CHUNK))
    a = writer.upload(_binding("a"), _tree(tmp_path / "a"), {})
    b = writer.upload(_binding("b"), _tree(tmp_path / "b", changed=5), {})
    assert reader.prefetch(Pin(NS, BOX, "a", uid=UID, digest=a.manifest_digest),
                           stop=threading.Event()) > 0
    cache = reader.cache
    assert cache is not None
    pages = (tmp_path / "a" / "criu" / "pages-1.img").read_bytes()
    for entry in os.listdir(cache.root):  # what is cached is sealed, not plain
        assert pages[:64] not in (cache.root / entry).read_bytes()
    counting.gets.clear()
    tally = CacheTally()
    reader.download_deferred(Pin(NS, BOX, "b", uid=UID, digest=b.manifest_digest),
                             tmp_path / "restored", tally=tally)
    assert len(counting.chunk_gets()) == 2 and tally.misses == 2 and tally.hits > 0
    assert (tmp_path / "restored" / "criu" / "pages-1.img").read_bytes() == \
        (tmp_path / "b" / "criu" / "pages-1.img").read_bytes()


RESTORES = 6


def test_concurrent_downloads_of_one_checkpoint_fetch_each_chunk_once(
        stores: tuple[CheckpointStore, CheckpointStore, CountingClient], tmp_path: Path,
) -> None:
    """Forks restored at once on one node: every chunk is fetched from S3 by one download
    while the others wait for it and read it from the cache (verifying it themselves)."""
    writer, reader, counting = stores
    a = writer.upload(_binding("a"), _tree(tmp_path / "a"), {})
    keys = _keys(writer, a.manifest)
    counting.gets.clear()
    counting.chunk_delay = 0.05  # keeps each fetch in flight while the others ask for it
    start = threading.Barrier(RESTORES)
    tallies = [CacheTally() for _ in range(RESTORES)]
    failures: list[BaseException] = []

    def restore(i: int) -> None:
        try:
            start.wait(30)
            reader.download_deferred(Pin(NS, BOX, "a", uid=UID, digest=a.manifest_digest),
                                     tmp_path / f"fork-{i}", tally=tallies[i])
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=restore, args=(i,)) for i in range(RESTORES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    assert counting.chunk_gets() == Counter(dict.fromkeys(keys, 1)), \
        "a chunk was fetched from S3 more than once"
    assert sum(t.misses for t in tallies) == len(keys)
    assert sum(t.hits for t in tallies) == (RESTORES - 1) * len(keys)
    for i in range(RESTORES):
        for f in ("pages-1.img", "core-1.img"):
            assert (tmp_path / f"fork-{i}" / "criu" / f).read_bytes() == \
                (tmp_path / "a" / "criu" / f).read_bytes()
    print(f"{RESTORES} concurrent downloads of {len(keys)} chunks: "
          f"{sum(counting.chunk_gets().values())} chunk GETs from S3")


def test_when_the_fetching_download_fails_the_waiting_ones_fetch_for_themselves(
        stores: tuple[CheckpointStore, CheckpointStore, CountingClient], tmp_path: Path,
) -> None:
    """The first GET of one chunk fails (after the others started waiting for it): its
    download fails, the waiting downloads fetch that chunk from S3 themselves."""
    writer, reader, counting = stores
    a = writer.upload(_binding("a"), _tree(tmp_path / "a"), {})
    entry = next(e for e in a.manifest.sections["criu"] if e.path == "pages-1.img")
    victim = writer.chunk_key(NS, BOX, entry.chunks[3])
    counting.gets.clear()
    waiting = threading.Event()
    real_get = CountingClient.get_object
    failed = threading.Lock()

    def get_object(self: CountingClient, **kw: Any) -> Any:
        if kw["Key"] == victim and failed.acquire(blocking=False):
            waiting.wait(10)  # until another download waits for this fetch
            raise CheckpointRefused("injected: this GET fails")
        return real_get(self, **kw)

    cache = reader.cache
    assert cache is not None
    real_claim = cache.claim

    def claim(name: str) -> threading.Event | None:
        pending = real_claim(name)
        if pending is not None and name == reader._cache_name(victim):
            waiting.set()
        return pending

    start = threading.Barrier(3)
    results: dict[int, BaseException | None] = {}

    def restore(i: int) -> None:
        try:
            start.wait(30)
            reader.download_deferred(Pin(NS, BOX, "a", uid=UID), tmp_path / f"fork-{i}",
                                     tally=CacheTally())
            results[i] = None
        except BaseException as exc:
            results[i] = exc

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CountingClient, "get_object", get_object)
        mp.setattr(cache, "claim", claim)
        threads = [threading.Thread(target=restore, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    failures = [e for e in results.values() if e is not None]
    assert len(results) == 3 and len(failures) == 1, results
    assert "injected" in str(failures[0])
    assert waiting.is_set(), "no download waited for the failing fetch"
    # The failed GET is not counted (it never reached S3). A waiting download fetched the
    # chunk itself; a download that came to it later may read that fetch from the cache
    # instead (both seen under load: 1 or 2 GETs), so at least one GET, not two.
    assert counting.gets[victim] >= 1, "the waiting downloads did not fetch it themselves"
    for i, exc in results.items():
        if exc is None:
            assert (tmp_path / f"fork-{i}" / "criu" / "pages-1.img").read_bytes() == \
                (tmp_path / "a" / "criu" / "pages-1.img").read_bytes()
