"""Manifest: canonical serialization, stable digests, strict parsing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hermit_common.errors import CheckpointRefused
from hermit_common.manifest import FORMAT_VERSION, Binding, Manifest, ManifestError, Totals
from hermit_common.tree import Entry

DIGEST = "ab" * 32


def _manifest(**overrides: Any) -> Manifest:
    fields: dict[str, Any] = dict(
        binding=Binding(namespace="ns", sandbox="box", sandbox_uid="uid-1", checkpoint="c1",
                        criu_version="4.2.1", kernel="6.18.0", cpu_flags=("avx2", "sse4_2"),
                        image_digest="sha256:" + "cd" * 32),
        created_at="2025-01-01T00:00:00.000000Z",
        chunk_size=4,
        sections={
            "criu": (Entry("pages-1.img", "file", 0o600, 0, 0, 1, size=6,
                           chunks=(DIGEST, DIGEST)),),
            "rootfs": (Entry("etc", "dir", 0o755, opaque=True),
                       Entry("etc/gone", "whiteout"),
                       Entry("etc/link", "symlink", 0o777, target="../x")),
        },
        restore={"pid": 1, "pipes": ["pipe:[1]"], "nested": {"b": 1, "a": None}},
        totals=Totals(files=1, image_bytes=6, chunks=2, unique_chunks=1, stored_bytes=3),
    )
    fields.update(overrides)
    return Manifest(**fields)


def test_round_trip() -> None:
    m = _manifest()
    assert Manifest.from_json(m.to_json()) == m
    assert Manifest.from_json(m.to_json()).to_json() == m.to_json()


def test_serialization_is_canonical() -> None:
    raw = _manifest().to_json()
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    assert json.loads(raw)["format_version"] == FORMAT_VERSION


def test_digest_is_stable_and_content_sensitive() -> None:
    a, b = _manifest(), _manifest()
    assert a.digest() == b.digest()
    assert a.digest().startswith("sha256:") and len(a.digest()) == 7 + 64
    # key order of restore data does not matter; content does
    assert _manifest(restore={"b": 1, "a": 2}).digest() == \
        _manifest(restore={"a": 2, "b": 1}).digest()
    assert _manifest(restore={"a": 3}).digest() != _manifest(restore={"a": 2}).digest()
    assert _manifest(created_at="2025-01-01T00:00:01.000000Z").digest() != a.digest()


def test_manifest_errors_are_checkpoint_refused() -> None:
    assert issubclass(ManifestError, CheckpointRefused)


def _doc(**changes: Any) -> bytes:
    data = json.loads(_manifest().to_json())
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return json.dumps(data).encode()


@pytest.mark.parametrize("raw,match", [
    (b"{not json", "not valid JSON"),
    (b"[]", "not an object"),
    (_doc(format_version=2), "format_version 2 is not supported"),
    (_doc(format_version=None), "format_version None is not supported"),
    (_doc(binding=None), r"missing fields \['binding'\]"),
    (_doc(totals=None), "missing fields"),
    (_doc(surprise=1), "unexpected fields"),
    (_doc(chunk_size=0), "chunk_size"),
    (_doc(chunk_size=-4), "chunk_size"),
    (_doc(sections={"../x": []}), "section name"),
    (_doc(sections={"fs": [{"path": "/abs", "kind": "whiteout"}]}), "absolute"),
    (_doc(sections={"fs": "nope"}), "not a list"),
    (_doc(restore=[1]), "restore"),
    (b'{"format_version": NaN}', "NaN"),
])
def test_strict_parsing(raw: bytes, match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(raw)


def test_binding_fields_are_checked() -> None:
    data = json.loads(_manifest().to_json())
    del data["binding"]["sandbox_uid"]
    with pytest.raises(ManifestError, match="sandbox_uid"):
        Manifest.from_json(json.dumps(data).encode())
    data = json.loads(_manifest().to_json())
    data["binding"]["cpu_flags"] = "avx2"
    with pytest.raises(ManifestError, match="cpu_flags"):
        Manifest.from_json(json.dumps(data).encode())


def test_chunk_count_must_match_size() -> None:
    with pytest.raises(ManifestError, match="expected 2"):
        _manifest(sections={"criu": (Entry("p", "file", size=6, chunks=(DIGEST,)),)})


def test_restore_must_be_plain_json() -> None:
    with pytest.raises(ManifestError, match="plain JSON"):
        _manifest(restore={"x": object()})


def test_helpers() -> None:
    m = _manifest()
    assert m.chunk_digests() == {DIGEST}
    assert [(s, e.path) for s, e in m.files()] == [("criu", "pages-1.img")]
