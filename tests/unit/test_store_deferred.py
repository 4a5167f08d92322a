"""A download's deferred chunks (store.Deferred) without S3: which chunk is fetched when."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hermit_common.errors import StoreUnavailable
from hermit_common.store import Deferred
from hermit_common.store.download import _Location

C = 4


def _deferred(tmp_path: Path, fetched: list[str], *, fail: str | None = None,
              workers: int = 1) -> tuple[Deferred, str]:
    """Four chunks of one file, c0..c3, each C bytes."""
    path = str(tmp_path / "pages-1.img")
    locations = {f"c{i}": [_Location(path, i * C, C, f"images/pages-1.img#{i}")]
                 for i in range(4)}

    def fetch_one(digest: str, locs: list[_Location], stop: threading.Event) -> None:
        if digest == fail:
            raise StoreUnavailable(f"chunk {digest}: the store is down")
        fetched.append(digest)

    return Deferred(fetch_one, locations, workers), path


def test_fetch_ranges_takes_only_the_chunks_under_them(tmp_path: Path) -> None:
    fetched: list[str] = []
    deferred, path = _deferred(tmp_path, fetched)
    landed: list[tuple[str, int, int]] = []
    deferred.fetch_ranges([(path, C + 1, 2), (path, 3 * C - 2, 2)],
                          lambda *r: landed.append(r))
    assert sorted(fetched) == ["c1", "c2"]
    assert sorted(landed) == [(path, C, C), (path, 2 * C, C)]
    assert deferred.bytes_total == 4 * C
    deferred.fetch_rest(lambda *r: landed.append(r), lambda: None)
    assert sorted(fetched) == ["c0", "c1", "c2", "c3"], "a chunk was fetched twice"


def test_a_wanted_chunk_goes_first_and_the_rest_waits_for_bulk(tmp_path: Path) -> None:
    fetched: list[str] = []
    deferred, path = _deferred(tmp_path, fetched)
    wants = [(path, 3 * C, 1)]
    bulk = threading.Event()

    def idle() -> None:
        assert fetched == ["c3"], "fetched more than the wanted chunk before bulk"
        bulk.set()

    deferred.fetch_rest(lambda *r: None, lambda: wants.pop() if wants else None,
                        bulk=bulk, idle=idle)
    assert fetched == ["c3", "c0", "c1", "c2"]


def test_the_first_failure_stops_the_fetch_and_is_raised(tmp_path: Path) -> None:
    fetched: list[str] = []
    deferred, _ = _deferred(tmp_path, fetched, fail="c1")
    with pytest.raises(StoreUnavailable, match="chunk c1"):
        deferred.fetch_rest(lambda *r: None, lambda: None)
    assert deferred.stop.is_set() and fetched == ["c0"]
