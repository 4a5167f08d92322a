"""The node-local chunk cache (hermit_common.chunkcache): bounds, recency, atomic entries."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from hermit_common.chunkcache import CacheTally, ChunkCache, entry_name


def _files(root: Path) -> list[str]:
    return sorted(os.listdir(root))


def test_entry_names_are_fixed_length_hex_and_differ_by_store() -> None:
    a = entry_name("http://minio:9000\nbucket", "hermit/ns/box/chunks/" + "ab" * 32)
    b = entry_name("http://minio:9000\nother", "hermit/ns/box/chunks/" + "ab" * 32)
    assert a != b and len(a) == 64 and int(a, 16) >= 0


def test_put_then_get_round_trips_and_counts_bytes(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "c", 100)
    assert cache.get("a") is None
    assert cache.put("a", b"x" * 10)
    assert cache.get("a") == b"x" * 10
    assert "a" in cache and len(cache) == 1 and cache.bytes_used == 10
    assert cache.put("a", b"y" * 20)  # replaced, counted once
    assert cache.get("a") == b"y" * 20 and cache.bytes_used == 20
    assert _files(tmp_path / "c") == ["a"], "a temporary file was left behind"


def test_the_least_recently_used_entries_go_first(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 30)
    for name in "abc":
        assert cache.put(name, name.encode() * 10)
    assert cache.get("a") == b"a" * 10  # a is now the most recent: b is the oldest
    assert cache.put("d", b"d" * 10)
    assert "b" not in cache and not (tmp_path / "b").exists()
    assert [n for n in "acd" if n in cache] == ["a", "c", "d"]
    assert cache.bytes_used == 30
    assert cache.put("e", b"e" * 25)  # needs room of three entries
    assert [n for n in "acde" if n in cache] == ["e"] and cache.bytes_used == 25


def test_an_entry_larger_than_the_cache_is_refused(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 10)
    assert cache.put("a", b"a" * 5)
    assert not cache.put("big", b"b" * 11)
    assert "a" in cache and _files(tmp_path) == ["a"]


def test_discard_deletes_an_entry(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 100)
    cache.put("a", b"abc")
    cache.discard("a")
    cache.discard("never-there")
    assert cache.get("a") is None and cache.bytes_used == 0 and _files(tmp_path) == []


def test_an_entry_deleted_behind_its_back_is_a_miss(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 100)
    cache.put("a", b"abc")
    (tmp_path / "a").unlink()
    assert cache.get("a") is None and "a" not in cache and cache.bytes_used == 0


def test_reopening_keeps_entries_drops_partial_files_and_applies_the_bound(
        tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 100)
    for i, name in enumerate("abc"):
        cache.put(name, name.encode() * 10)
        os.utime(tmp_path / name, ns=(i * 10**9, i * 10**9))  # a oldest, c newest
    (tmp_path / ".tmp-123-4-5").write_bytes(b"half a chunk")  # a write cut short
    again = ChunkCache(tmp_path, 100)
    assert _files(tmp_path) == ["a", "b", "c"]
    assert again.get("b") == b"b" * 10 and again.bytes_used == 30
    smaller = ChunkCache(tmp_path, 20)  # the least recently used (by mtime) goes
    assert "a" not in smaller and _files(tmp_path) == ["b", "c"]


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ChunkCache(tmp_path, 100)
    cache.put("a", b"old")

    def broken(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    assert not cache.put("a", b"new bytes")
    monkeypatch.undo()
    assert cache.get("a") == b"old" and _files(tmp_path) == ["a"]


def test_concurrent_puts_and_gets_keep_the_bound(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 50 * 8)

    def work(k: int) -> None:
        for i in range(40):
            name = f"{k}-{i}"
            cache.put(name, bytes([i]) * 50)
            got = cache.get(name)
            assert got is None or got == bytes([i]) * 50

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.bytes_used <= 50 * 8
    assert sum(os.path.getsize(tmp_path / n) for n in _files(tmp_path)) == cache.bytes_used


def test_a_cache_needs_a_positive_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ChunkCache(tmp_path, 0)


def test_tally_counts() -> None:
    tally = CacheTally()
    tally.hit()
    tally.miss()
    tally.miss()
    tally.stored(7)
    assert (tally.hits, tally.misses, tally.chunks, tally.stored_bytes) == (1, 2, 3, 7)


# -- single-flight: claim / release / await_fetch -------------------------------------


def test_the_first_claim_leads_and_later_claims_wait_until_its_release(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 100)
    assert cache.claim("a") is None  # the leader
    pending = cache.claim("a")
    assert pending is not None and not pending.is_set()
    assert cache.claim("a") is pending, "followers share one event"
    assert cache.claim("b") is None, "another entry is claimed on its own"
    assert cache.put("a", b"x")
    cache.release("a")
    assert pending.is_set()
    assert cache.claim("a") is None, "a released entry can be claimed again"
    cache.release("a")
    cache.release("b")
    cache.release("never-claimed")  # harmless


def test_a_follower_waits_for_the_leader_then_reads_its_entry(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 100)
    assert cache.claim("a") is None
    started = threading.Event()
    got: list[bytes | None] = []

    def follower() -> None:
        pending = cache.claim("a")
        assert pending is not None
        started.set()
        assert ChunkCache.await_fetch(pending, 30.0)
        got.append(cache.get("a"))

    t = threading.Thread(target=follower)
    t.start()
    assert started.wait(10)
    assert not got, "the follower did not wait"
    assert cache.put("a", b"object")
    cache.release("a")
    t.join(10)
    assert got == [b"object"]


def test_a_failed_leader_still_releases_and_its_followers_find_nothing(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 100)

    def leader() -> None:
        assert cache.claim("a") is None
        try:
            raise OSError("the S3 GET failed")
        finally:
            cache.release("a")

    assert cache.claim("b") is None
    pending = cache.claim("b")
    assert pending is not None
    with pytest.raises(OSError):
        leader()
    cache.release("b")
    assert ChunkCache.await_fetch(pending, 0.0)
    assert cache.get("b") is None, "nothing stored: the follower fetches it itself"
    assert cache.claim("a") is None, "the failed leader left no claim behind"


def test_a_wait_ends_at_its_timeout_or_when_stopped(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 100)
    assert cache.claim("a") is None
    pending = cache.claim("a")
    assert pending is not None
    began = time.monotonic()
    assert not ChunkCache.await_fetch(pending, 0.3)
    assert 0.25 <= time.monotonic() - began < 5
    stop = threading.Event()
    stop.set()
    began = time.monotonic()
    assert not ChunkCache.await_fetch(pending, 60.0, stop)
    assert time.monotonic() - began < 5, "a stopped wait did not end"
    cache.release("a")
    assert ChunkCache.await_fetch(pending, 60.0, stop)
