"""Bounded parsing of the bucket's bytes (bounded.py, store readers, seal parsing), with a
fake S3 client that counts what is read (the real MinIO: tests/integration/
test_bounded_store.py)."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from hermit_common import bounded
from hermit_common.errors import CheckpointRefused
from hermit_common.manifest import Binding, Manifest, ManifestError, Totals, digest_bytes
from hermit_common.pin import Pin
from hermit_common.seal import Wrapped, is_sealed
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore
from hermit_common.tree import Entry


class _Body(io.BytesIO):
    def __init__(self, data: bytes, reads: list[int]) -> None:
        super().__init__(data)
        self._reads = reads

    def read(self, size: int | None = -1) -> bytes:
        out = super().read(size)
        self._reads.append(len(out))
        return out


class FakeS3:
    """Just what the readers use: get, list, delete; ``lie`` sends a Content-Length
    smaller than the object (a broken or hostile endpoint)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.reads: list[int] = []
        self.deleted: list[str] = []
        self.lie = False

    def get_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        data = self.objects[Key]
        return {"ContentLength": 10 if self.lie else len(data),
                "Body": _Body(data, self.reads)}

    def list_objects_v2(self, Bucket: str, Prefix: str, **kw: Any) -> dict[str, Any]:
        old = datetime(2020, 1, 1, tzinfo=UTC)
        return {"Contents": [{"Key": k, "Size": len(v), "LastModified": old}
                             for k, v in sorted(self.objects.items()) if k.startswith(Prefix)]}

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> dict[str, Any]:
        for obj in Delete["Objects"]:
            self.deleted.append(obj["Key"])
            self.objects.pop(obj["Key"], None)
        return {}


def _store() -> tuple[CheckpointStore, FakeS3]:
    s3 = FakeS3()
    return CheckpointStore(StoreSettings(bucket="b", prefix="p"), s3), s3


def _manifest(checkpoint: str, digests: tuple[str, ...]) -> bytes:
    files = (Entry("f", "file", 0o644, size=len(digests), chunks=digests),)
    return Manifest(Binding("ns", "sbx", "uid-1", checkpoint, "3.19", "6.8"),
                    "2026-01-01T00:00:00Z", 1, {"fs": files}, {}, Totals()).to_json()


# -- load_json ------------------------------------------------------------------------------

def test_load_json_refuses_what_is_too_large_or_too_dense_unparsed() -> None:
    assert bounded.load_json(b'{"a": [1, 2]}', limit=100, what="x") == {"a": [1, 2]}
    with pytest.raises(bounded.TooLarge, match="x is larger than the limit of 10"):
        bounded.load_json(b"[" + b"0," * 10 + b"0]", limit=10, what="x")
    bomb = b"[" + b"{}," * 100_000 + b"{}]"  # ~24x its size in memory once parsed
    with pytest.raises(CheckpointRefused, match="JSON objects and arrays"):
        bounded.load_json(bomb, limit=len(bomb), what="x")


def test_a_nesting_bomb_is_a_refusal_not_a_recursion_error() -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(CheckpointRefused, match="nested too deeply"):
        bounded.load_json(deep, limit=len(deep), what="x", max_containers=10 ** 6)
    with pytest.raises(ManifestError):
        Manifest.from_json(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    with pytest.raises(CheckpointRefused):
        Wrapped.from_bytes(b"[" * 50_000)
    assert not is_sealed(b"[" * 100_000)


def test_the_limits_are_named_and_cover_a_sealed_manifest() -> None:
    assert bounded.MANIFEST_MAX_BYTES == 64 * 1024 * 1024
    # A manifest at the limit, encrypted (16-byte tag) and in base64, fits the stored limit.
    assert bounded.STORED_MANIFEST_MAX_BYTES >= \
        4 * -(-(bounded.MANIFEST_MAX_BYTES + 16) // 3) + 4096
    assert bounded.KEY_RECORD_MAX_BYTES == 64 * 1024
    real = _manifest("c", ("a" * 64,))
    assert real.count(b"{") + real.count(b"[") <= bounded.containers_allowed(len(real))


def test_a_plain_manifest_is_not_parsed_to_tell_it_is_not_sealed() -> None:
    many = json.dumps({"sections": [{"path": str(i)} for i in range(100)]}).encode()
    assert not is_sealed(many)  # over an envelope's few containers: not one, unparsed


# -- the store's readers ---------------------------------------------------------------------

def test_an_oversize_manifest_is_refused_on_its_length_before_its_body_is_read() -> None:
    store, s3 = _store()
    key = store.manifest_key("ns", "sbx", "big")
    s3.objects[key] = b" " * (bounded.STORED_MANIFEST_MAX_BYTES + 1)
    with pytest.raises(bounded.TooLarge, match="larger than the limit"):
        store.read_manifest(Pin("ns", "sbx", "big"))
    assert s3.reads == [], "not a byte of the body was read"


def test_a_lying_content_length_still_reads_at_most_limit_plus_one() -> None:
    store, s3 = _store()
    s3.lie = True
    key = store.sandbox_key_key("ns", "sbx", "uid-1")
    s3.objects[key] = b"x" * (bounded.KEY_RECORD_MAX_BYTES * 4)
    assert store._read_sandbox_key(key) is None  # unusable: a new key replaces it
    assert sum(s3.reads) == bounded.KEY_RECORD_MAX_BYTES + 1


def test_the_pinned_digest_is_checked_before_the_manifest_is_parsed() -> None:
    store, s3 = _store()
    raw = _manifest("c1", ("a" * 64,))
    s3.objects[store.manifest_key("ns", "sbx", "c1")] = raw
    manifest, digest = store.read_manifest(Pin("ns", "sbx", "c1", digest=digest_bytes(raw)))
    assert digest == digest_bytes(raw) and manifest.binding.checkpoint == "c1"
    # Bytes that would be costly to parse, with a digest other than the pinned one: refused
    # on the digest, unparsed (the nesting would otherwise be the error).
    s3.objects[store.manifest_key("ns", "sbx", "c1")] = b"[" * 100_000
    with pytest.raises(CheckpointRefused, match="does not match the expected"):
        store.read_manifest(Pin("ns", "sbx", "c1", digest=digest_bytes(raw)))


def test_gc_skips_an_oversize_manifest_with_a_warning_and_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    store, s3 = _store()
    keep, gone = "1" * 64, "2" * 64
    s3.objects[store.manifest_key("ns", "sbx", "good")] = _manifest("good", (keep,))
    s3.objects[store.manifest_key("ns", "sbx", "planted")] = \
        b" " * (bounded.STORED_MANIFEST_MAX_BYTES + 1)
    for digest in (keep, gone):
        s3.objects[store.chunk_key("ns", "sbx", digest)] = b"chunk"
    result = store.collect("ns", "sbx", keep=None)
    assert result.chunks == (gone,) and not result.aborted
    assert store.chunk_key("ns", "sbx", keep) in s3.objects
    assert "manifest of planted skipped" in caplog.text
    assert max(s3.reads) < 10_000, "the planted manifest's body was not read"


def test_a_manifest_too_large_to_read_back_fails_its_upload() -> None:
    import inspect

    from hermit_common.store import upload

    # The upload refuses to write what no reader would accept (checked on the JSON).
    assert "MAX_MANIFEST_BYTES" in inspect.getsource(upload.Uploader.finish)
