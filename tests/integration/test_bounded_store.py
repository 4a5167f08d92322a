"""A bucket writer plants huge objects where the node-agent reads manifests and key
records (bounded.py, docs/storage.md#bounded-parsing): against a real MinIO, each read is
refused quickly and the reading process's memory grows by at most the kind's limit plus a
few MiB (never the ~25x of parsing it).

The reads run in a fresh process each, its peak RSS (VmHWM) reset just before the read
(/proc/self/clear_refs), so the growth measured is that read's alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hermit_common import bounded
from hermit_common.manifest import Binding, Manifest, Totals
from hermit_common.store import CheckpointStore
from hermit_common.tree import Entry
from tests.support.attacks import REFUSED, Attack
from tests.support.minio import MinioServer

NS, BOX, UID = "team-a", "agent-1", "7f1c0c8e-uid"
MIB = 1024 * 1024
SLACK = 8 * MIB  # what "a few MiB" allows: buffers, the HTTP client, the allocator

_READER = r"""
import json, sys, time, tracemalloc
from hermit_common.pin import Pin
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore

settings, what, args = StoreSettings(**json.loads(sys.argv[1])), sys.argv[2], sys.argv[3:]
store = CheckpointStore(settings)
store.client.list_objects_v2(Bucket=settings.bucket, MaxKeys=1)  # connect and warm up

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS (VmHWM) starts again from the RSS now
rss0 = status("VmRSS")
tracemalloc.start()
started = time.monotonic()
outcome = "returned"
try:
    if what == "manifest":
        store.read_manifest(Pin(*args))
    elif what == "key":
        outcome = "key: " + repr(store._read_sandbox_key(args[0]))
    elif what == "collect":
        result = store.collect(*args, keep=None)
        outcome = f"collected {sorted(result.chunks)}"
except Exception as exc:
    outcome = f"{type(exc).__name__}: {exc}"
seconds = time.monotonic() - started
peak = tracemalloc.get_traced_memory()[1]
rss1 = status("VmHWM")
print(json.dumps({"outcome": outcome, "seconds": seconds, "rss_growth": rss1 - rss0,
                  "traced_peak": peak}))
"""


@pytest.fixture
def store(minio_server: MinioServer, request: pytest.FixtureRequest) -> CheckpointStore:
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    s = CheckpointStore(minio_server.settings(f"b-{name}-{os.getpid()}"))
    s.ensure_bucket()
    return s


def _read_in_fresh_process(store: CheckpointStore, what: str, *args: str) -> dict[str, Any]:
    fields = {k: v for k, v in vars(store.settings).items()}
    proc = subprocess.run([sys.executable, "-c", _READER, json.dumps(fields), what, *args],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{what}: {out['outcome'][:160]} in {out['seconds'] * 1000:.0f} ms, peak RSS "
          f"+{out['rss_growth'] / MIB:.1f} MiB, Python allocations peak "
          f"{out['traced_peak'] / MIB:.1f} MiB")
    return out


def _plant(store: CheckpointStore, key: str, path: Path) -> None:
    store.client.upload_file(str(path), store.settings.bucket, key)


def _bomb(path: Path, size: int) -> Path:
    """``[{},{},...]`` of ``size`` bytes: about 24x its size in memory, were it parsed."""
    unit = b"{}," * (MIB // 3)
    with path.open("wb") as f:
        f.write(b"[")
        left = size - 2
        while left > 0:
            piece = unit[:left - (left % 3)] if left < len(unit) else unit
            if not piece:
                break
            f.write(piece)
            left -= len(piece)
        f.write(b"{}]"[-(size - f.tell()):] if size > f.tell() else b"")
    return path


def _good_manifest(checkpoint: str, digest: str) -> bytes:
    files = (Entry("f", "file", 0o644, size=1, chunks=(digest,)),)
    return Manifest(Binding(NS, BOX, UID, checkpoint, "4.2.1", "6.18.0"),
                    "2026-01-01T00:00:00Z", 1, {"fs": files}, {}, Totals()).to_json()


@pytest.mark.attack
def test_a_planted_256_mib_manifest_is_refused_quickly_with_bounded_memory(
        store: CheckpointStore, tmp_path: Path, attack: Attack) -> None:
    big = _bomb(tmp_path / "big.json", 256 * MIB)
    _plant(store, store.manifest_key(NS, BOX, "planted"), big)
    out = _read_in_fresh_process(store, "manifest", NS, BOX, "planted")
    assert out["outcome"].startswith("TooLarge") and "larger than the limit" in out["outcome"]
    assert out["seconds"] < 2.0
    assert out["rss_growth"] < SLACK and out["traced_peak"] < SLACK
    attack.record("bucket: a 256 MiB manifest", tried="a 256 MiB JSON manifest planted in real "
                  "MinIO, read as a restore reads it", outcome=REFUSED,
                  evidence=f"refused on its Content-Length in {out['seconds'] * 1000:.0f} ms, "
                           f"reader's RSS +{out['rss_growth'] / MIB:.1f} MiB")


def test_a_dense_manifest_under_the_limit_is_refused_unparsed(
        store: CheckpointStore, tmp_path: Path) -> None:
    # Under the stored limit, so it is read; but `[{},{},...]` would take ~1.4 GiB
    # parsed: it is refused by its count of JSON containers, before json.loads.
    size = 60 * MIB
    _plant(store, store.manifest_key(NS, BOX, "dense"), _bomb(tmp_path / "d.json", size))
    out = _read_in_fresh_process(store, "manifest", NS, BOX, "dense")
    assert "JSON objects and arrays" in out["outcome"], out
    assert out["rss_growth"] < size + SLACK, "more than the bytes themselves"
    assert out["traced_peak"] < size + SLACK


def test_a_big_key_record_is_refused_and_replaced(store: CheckpointStore,
                                                   tmp_path: Path) -> None:
    key = store.sandbox_key_key(NS, BOX, UID)
    _plant(store, key, _bomb(tmp_path / "key.json", 32 * MIB))
    out = _read_in_fresh_process(store, "key", key)
    assert out["outcome"] == "key: None", out  # unusable: a new key replaces it
    assert out["seconds"] < 2.0
    assert out["rss_growth"] < SLACK and out["traced_peak"] < SLACK


def test_gc_skips_a_planted_manifest_and_collects_the_rest(store: CheckpointStore,
                                                           tmp_path: Path) -> None:
    keep, doomed = "1" * 64, "2" * 64
    client, bucket = store.client, store.settings.bucket
    client.put_object(Bucket=bucket, Key=store.manifest_key(NS, BOX, "good"),
                      Body=_good_manifest("good", keep))
    for digest in (keep, doomed):
        client.put_object(Bucket=bucket, Key=store.chunk_key(NS, BOX, digest), Body=b"c")
    _plant(store, store.manifest_key(NS, BOX, "planted"),
           _bomb(tmp_path / "big.json", 256 * MIB))
    started = time.monotonic()
    out = _read_in_fresh_process(store, "collect", NS, BOX)
    assert out["outcome"] == f"collected {[doomed]}", out
    assert time.monotonic() - started < 30
    assert out["rss_growth"] < SLACK and out["traced_peak"] < SLACK
    assert store.list_chunks(NS, BOX) == {keep: 1}, "the good manifest's chunk stays"
    assert bounded.STORED_MANIFEST_MAX_BYTES < 256 * MIB
