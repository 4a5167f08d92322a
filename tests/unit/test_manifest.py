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


def test_entries_without_links_or_xattrs_serialize_as_before() -> None:
    """Manifests written before hardlinks and xattrs were kept keep their bytes (and so
    their digests): the new fields are left out when unset."""
    sections = json.loads(_manifest().to_json())["sections"]
    assert sections == {
        "criu": [{"path": "pages-1.img", "kind": "file", "mode": 0o600, "uid": 0, "gid": 0,
                  "mtime_ns": 1, "size": 6, "chunks": [DIGEST, DIGEST]}],
        "rootfs": [{"path": "etc", "kind": "dir", "mode": 0o755, "uid": 0, "gid": 0,
                    "mtime_ns": 0, "opaque": True},
                   {"path": "etc/gone", "kind": "whiteout"},
                   {"path": "etc/link", "kind": "symlink", "mode": 0o777, "uid": 0, "gid": 0,
                    "mtime_ns": 0, "target": "../x"}],
    }


def _linked_sections() -> dict[str, tuple[Entry, ...]]:
    cap = b"\x01\x00\x00\x02 \x00\x00\x00"
    ping = Entry("bin/ping", "file", 0o755, 0, 0, 1, size=6, chunks=(DIGEST, DIGEST),
                 xattrs=(("security.capability", cap), ("user.note", b"")))
    return {"rootfs": (Entry("bin", "dir", 0o755, xattrs=(("trusted.x", b"\x00"),)), ping,
                       Entry("ping", "file", 0o755, 0, 0, 1, size=6, chunks=(DIGEST, DIGEST),
                             link="bin/ping", xattrs=ping.xattrs))}


def test_links_and_xattrs_round_trip() -> None:
    m = _manifest(sections=_linked_sections())
    raw = m.to_json()
    assert Manifest.from_json(raw) == m
    assert Manifest.from_json(raw).to_json() == raw
    entries = json.loads(raw)["sections"]["rootfs"]
    assert entries[0]["xattrs"] == {"trusted.x": "AA=="}
    assert entries[1]["xattrs"] == {"security.capability": "AQAAAiAAAAA=", "user.note": ""}
    assert "link" not in entries[1] and entries[2]["link"] == "bin/ping"
    assert [e.path for _, e in m.files()] == ["bin/ping", "ping"]  # a hardlink is a file


@pytest.mark.parametrize("change,match", [
    ({"link": "bin"}, "not an earlier file"),
    ({"link": "nope"}, "not an earlier file"),
    ({"link": "ping"}, "hardlink of itself"),
    ({"mode": 0o4755}, "differ"),
    ({"xattrs": {"user.note": ""}}, "differ"),
    ({"xattrs": {"trusted.overlay.opaque": "eQ=="}}, "never captured"),
])
def test_unsound_links_and_xattrs_are_refused(change: dict[str, Any], match: str) -> None:
    data = json.loads(_manifest(sections=_linked_sections()).to_json())
    data["sections"]["rootfs"][2].update(change)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_json(json.dumps(data).encode())


def test_chosen_chunk_lengths_round_trip_and_give_the_spans() -> None:
    entry = Entry("pages-1.img", "file", 0o600, size=7, chunks=(DIGEST, DIGEST, DIGEST),
                  chunk_lengths=(2, 4, 1))
    m = _manifest(sections={"criu": (entry,)})
    raw = m.to_json()
    assert json.loads(raw)["sections"]["criu"][0]["chunk_lengths"] == [2, 4, 1]
    assert Manifest.from_json(raw) == m
    assert entry.chunk_spans(4) == [(0, 2), (2, 4), (6, 1)]
    fixed = Entry("p", "file", size=6, chunks=(DIGEST, DIGEST))
    assert fixed.chunk_spans(4) == [(0, 4), (4, 2)]
    assert "chunk_lengths" not in json.loads(_manifest().to_json())["sections"]["criu"][0]


@pytest.mark.parametrize("lengths,match", [
    ((2, 4), "do not cut it"),  # one length short
    ((2, 4, 2), "do not cut it"),  # longer than the file
    ((1, 5, 1), "do not cut it"),  # a chunk past the chunk size
])
def test_chunk_lengths_must_cut_the_file_exactly(lengths: tuple[int, ...], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        _manifest(sections={"criu": (Entry("p", "file", size=7, chunks=(DIGEST,) * 3,
                                           chunk_lengths=lengths),)})


@pytest.mark.parametrize("value", [[], [0, 7], ["7"], [True], 7])
def test_malformed_chunk_lengths_are_refused(value: object) -> None:
    data = json.loads(_manifest().to_json())
    data["sections"]["criu"][0]["chunk_lengths"] = value
    with pytest.raises(ManifestError, match="chunk_lengths"):
        Manifest.from_json(json.dumps(data).encode())
