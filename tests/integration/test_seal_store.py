"""Sealed checkpoints with the real store against a real MinIO: what lands in the bucket,
refusals before a byte is written, KEK rotation, dedup and plain-checkpoint migration."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import zstandard

from hermit_common.errors import CheckpointRefused
from hermit_common.manifest import Binding
from hermit_common.pin import Pin
from hermit_common.seal import Keyring, KeyringWrapper, Sealing
from hermit_common.store import CheckpointStore, make_s3_client
from tests.support import attacks
from tests.support.minio import MinioServer

pytestmark = pytest.mark.integration

CHUNK = 64 * 1024
NS, BOX, UID = "team-a", "agent-1", "5e2d-uid"
MARKER = b"HERMIT-SEAL-MARKER-7c1f93"


class _Secret:
    """The sealing Secret's data, edited in place as an operator rotating keys would."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def add(self, key_id: str, *, current: bool = True) -> None:
        self.data[key_id] = base64.b64encode(os.urandom(32)).decode()
        if current:
            self.data["current"] = key_id

    def sealing(self, accept_plain: bool = False) -> Sealing:
        return Sealing(KeyringWrapper(lambda: Keyring.from_mapping(self.data, "test Secret")),
                       accept_plain=accept_plain)


@pytest.fixture
def bucket(minio_server: MinioServer, request: pytest.FixtureRequest) -> str:
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    name = f"s-{name}-{os.getpid()}"
    CheckpointStore(minio_server.settings(name)).ensure_bucket()
    return name


def _store(minio: MinioServer, bucket: str, sealing: Sealing | None) -> CheckpointStore:
    return CheckpointStore(minio.settings(bucket, chunk_size_bytes=CHUNK), sealing=sealing)


def _binding(checkpoint: str, namespace: str = NS, uid: str = UID,
             sandbox: str = BOX) -> Binding:
    return Binding(namespace=namespace, sandbox=sandbox, sandbox_uid=uid,
                   checkpoint=checkpoint, criu_version="4.2.1", kernel="6.18.0")


def _sections(root: Path, seed: int = 1) -> dict[str, Path]:
    """CRIU-like images with the marker in 'memory' and a workspace file holding it."""
    rng = random.Random(seed)
    images, workspace = root / "images", root / "workspace"
    images.mkdir(parents=True)
    workspace.mkdir()
    pages = bytearray(rng.randbytes(3 * CHUNK))
    pages[1000:1000 + len(MARKER)] = MARKER
    (images / "pages-1.img").write_bytes(bytes(pages) + MARKER * 5000)  # compressible too
    (images / "zeros.img").write_bytes(bytes(2 * CHUNK))
    (workspace / "notes.txt").write_bytes(b"the marker: " + MARKER + b"\n")
    return {"images": images, "workspace": workspace}


def _raw_objects(minio: MinioServer, bucket: str) -> dict[str, bytes]:
    client = make_s3_client(minio.settings(bucket))
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def _reveals(data: bytes, needle: bytes) -> bool:
    """Whether ``data`` shows ``needle`` as stored, or once zstd-decompressed."""
    if needle in data:
        return True
    try:
        return needle in zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 26)
    except zstandard.ZstdError:
        return False


def _copy(minio: MinioServer, bucket: str, src: str, dst: str) -> None:
    client = make_s3_client(minio.settings(bucket))
    client.copy_object(Bucket=bucket, Key=dst, CopySource={"Bucket": bucket, "Key": src})


def _put(minio: MinioServer, bucket: str, key: str, body: bytes) -> None:
    make_s3_client(minio.settings(bucket)).put_object(Bucket=bucket, Key=key, Body=body)


def _get(minio: MinioServer, bucket: str, key: str) -> bytes:
    client = make_s3_client(minio.settings(bucket))
    data: bytes = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    return data


def _refused(store: CheckpointStore, dest: Path, checkpoint: str, match: str,
             namespace: str = NS, uid: str = UID, **kwargs: Any) -> None:
    with pytest.raises(CheckpointRefused, match=match):
        store.read_manifest(Pin(namespace, BOX, checkpoint, uid=uid))
    with pytest.raises(CheckpointRefused, match=match):
        store.download(Pin(namespace, BOX, checkpoint, uid=uid), dest, **kwargs)
    assert not dest.exists() or not any(dest.iterdir()), "nothing may be written"


def test_sealed_round_trip_leaves_no_plaintext(minio_server: MinioServer, bucket: str,
                                               tmp_path: Path) -> None:
    secret = _Secret()
    secret.add("k1")
    store = _store(minio_server, bucket, secret.sealing())
    sections = _sections(tmp_path / "src")
    result = store.upload(_binding("c1"), sections, {"engine": 1})
    assert result.chunks_uploaded == result.chunks_total - 1  # the two zero chunks: one
    objects = _raw_objects(minio_server, bucket)
    digests = {hashlib.sha256(d).hexdigest() for d in objects.values()}
    assert len(objects) == result.chunks_uploaded + 2  # + the manifest + the sandbox key
    for key, data in objects.items():
        assert not _reveals(data, MARKER), f"{key} holds the marker"
        assert not _reveals(data, b"notes.txt"), f"{key} names a file"
    chunk_names = {k.rsplit("/", 1)[1] for k in objects if "/chunks/" in k}
    assert not chunk_names & result.manifest.chunk_digests()  # no plaintext digest exposed
    assert not chunk_names & digests

    dest = tmp_path / "out"
    manifest = store.download(Pin(NS, BOX, "c1", uid=UID, digest=result.manifest_digest), dest)
    assert manifest == result.manifest
    for name, root in sections.items():
        for path in root.rglob("*"):
            if path.is_file():
                assert (dest / name / path.relative_to(root)).read_bytes() == path.read_bytes()

    # dedup within the sandbox: a second checkpoint of the same content adds no chunk
    again = store.upload(_binding("c2"), sections, {"engine": 1})
    assert again.chunks_uploaded == 0
    assert again.stored_bytes == result.stored_bytes


def test_tampered_swapped_and_foreign_manifests_are_refused(
        minio_server: MinioServer, bucket: str, tmp_path: Path) -> None:
    secret = _Secret()
    secret.add("k1")
    store = _store(minio_server, bucket, secret.sealing())
    store.upload(_binding("c1"), _sections(tmp_path / "a", seed=1), {"engine": 1})
    store.upload(_binding("c2"), _sections(tmp_path / "b", seed=2), {"engine": 1})
    key1, key2 = (store.manifest_key(NS, BOX, c) for c in ("c1", "c2"))

    # a flipped byte in the middle of the stored manifest
    original = _get(minio_server, bucket, key2)
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    _put(minio_server, bucket, key2, bytes(flipped))
    _refused(store, tmp_path / "d1", "c2", "checkpoint team-a/c2 is refused: ")

    # c2's manifest swapped for c1's
    _copy(minio_server, bucket, key1, key2)
    _refused(store, tmp_path / "d2", "c2", "sealed for checkpoint team-a/c1")

    # c1's objects copied into namespace team-b (same sandbox name and uid)
    for key in _raw_objects(minio_server, bucket):
        _copy(minio_server, bucket, key, key.replace(f"/{NS}/", "/team-b/", 1))
    _refused(store, tmp_path / "d3", "c1", "sealed for checkpoint team-a/c1",
             namespace="team-b")

    # a sandbox recreated with the same name (another uid) does not get c1
    _refused(store, tmp_path / "d4", "c1", "uid 5e2d-uid", uid="other-uid")

    # another cluster's keys, or none: refused
    stranger = _Secret()
    stranger.add("k1")
    # (format 3: its wrapped data key does not open under another KEK of the same id)
    _refused(_store(minio_server, bucket, stranger.sealing()), tmp_path / "d5", "c1",
             "data key wrapped by sealing key 'k1' does not open for this sandbox")
    _refused(_store(minio_server, bucket, None), tmp_path / "d6", "c1",
             "is sealed, and this node-agent has no sealing keys")


@pytest.mark.attack
def test_tampered_chunk_is_refused(minio_server: MinioServer, bucket: str,
                                   tmp_path: Path, attack: attacks.Attack) -> None:
    secret = _Secret()
    secret.add("k1")
    store = _store(minio_server, bucket, secret.sealing())
    store.upload(_binding("c1"), _sections(tmp_path / "src"), {"engine": 1})
    chunk = next(k for k in _raw_objects(minio_server, bucket) if "/chunks/" in k)
    body = bytearray(_get(minio_server, bucket, chunk))
    body[-1] ^= 0x01
    _put(minio_server, bucket, chunk, bytes(body))
    with pytest.raises(CheckpointRefused, match="does not decrypt") as refused:
        store.download(Pin(NS, BOX, "c1", uid=UID), tmp_path / "out")
    left = [p for p in (tmp_path / "out").rglob("*") if not p.is_dir()]
    assert left == [], f"a refused download left files behind: {left}"
    attack.record("bucket: a tampered chunk", tried="one bit flipped in a sealed chunk in real "
                  "MinIO, then the checkpoint downloaded as a restore does",
                  outcome=attacks.REFUSED,
                  evidence=f"refused before any file was written: {str(refused.value)[:120]}")


def test_rotation(minio_server: MinioServer, bucket: str, tmp_path: Path) -> None:
    secret = _Secret()
    secret.add("1")
    store = _store(minio_server, bucket, secret.sealing())
    sections = _sections(tmp_path / "src")
    old = store.upload(_binding("c-old"), sections, {"engine": 1})

    secret.add("2")  # rotate: 2 is current, 1 stays for the old checkpoints
    store.download(Pin(NS, BOX, "c-old", uid=UID, digest=old.manifest_digest), tmp_path / "o1")
    new = store.upload(_binding("c-new"), sections, {"engine": 1})
    assert new.chunks_uploaded == 0  # the data key was re-wrapped, not replaced: dedup holds
    raw = _get(minio_server, bucket, store.manifest_key(NS, BOX, "c-new"))
    assert b'"kek":"2"' in raw
    assert b'"kek":"2"' in _get(minio_server, bucket, store.sandbox_key_key(NS, BOX, UID))

    del secret.data["1"]  # 1 removed: what it sealed is refused, naming it
    _refused(store, tmp_path / "o2", "c-old", "sealing key '1' is not in the sealing Secret")
    store.download(Pin(NS, BOX, "c-new", uid=UID), tmp_path / "o3")
    with pytest.raises(CheckpointRefused, match="sealing key '1'"):
        store.collect_garbage(NS, BOX)  # an unreadable manifest: nothing is deleted


def test_plain_checkpoints_need_the_migration_setting(
        minio_server: MinioServer, bucket: str, tmp_path: Path) -> None:
    plain = _store(minio_server, bucket, None)
    plain.upload(_binding("c-plain"), _sections(tmp_path / "src"), {"engine": 1})
    # the control of the no-plaintext checks: unsealed, the marker is there to be found
    plain_objects = _raw_objects(minio_server, bucket)
    assert any(_reveals(data, MARKER) for data in plain_objects.values())
    assert any(_reveals(data, b"notes.txt") for data in plain_objects.values())
    secret = _Secret()
    secret.add("k1")
    _refused(_store(minio_server, bucket, secret.sealing()), tmp_path / "d1", "c-plain",
             "is not sealed; .*HERMIT_SEAL_ACCEPT_PLAIN=true")
    migrating = _store(minio_server, bucket, secret.sealing(accept_plain=True))
    migrating.download(Pin(NS, BOX, "c-plain", uid=UID), tmp_path / "d2")
    sealed = migrating.upload(_binding("c-sealed"), _sections(tmp_path / "src2"),
                              {"engine": 1})
    assert b'"sealed":3' in _get(minio_server, bucket, migrating.manifest_key(NS, BOX,
                                                                              "c-sealed"))
    assert sealed.chunks_uploaded > 0  # sealed chunks are new objects, not the plain ones
    assert migrating.collect_garbage(NS, BOX) == 0  # both kinds are referenced


def _same_files(sections: dict[str, Path], dest: Path) -> None:
    for name, root in sections.items():
        for path in root.rglob("*"):
            if path.is_file():
                assert (dest / name / path.relative_to(root)).read_bytes() == path.read_bytes()


def test_a_fork_inherits_its_sources_data_key_and_uploads_almost_nothing(
        minio_server: MinioServer, bucket: str, tmp_path: Path) -> None:
    secret = _Secret()
    secret.add("k1")
    store = _store(minio_server, bucket, secret.sealing())
    sections = _sections(tmp_path / "src")
    source = store.upload(_binding("c1"), sections, {"engine": 1})
    assert source.lineage == (UID,)

    # The fork is restored from c1 (verified as a restore verifies it) and inherits its key.
    c1 = Pin(NS, BOX, "c1", UID, "", (UID,), source.manifest_digest)
    assert store.inherit_data_key(c1, store, NS, "fork", "fork-uid")
    assert not store.inherit_data_key(c1, store, NS, "fork", "fork-uid")
    (sections["workspace"] / "notes.txt").write_bytes(b"the fork wrote this\n")
    fork = store.upload(_binding("f1", uid="fork-uid", sandbox="fork"), sections,
                        {"engine": 1}, parent="c1")
    print(f"\nfork's first checkpoint: {fork.chunks_uploaded} of {fork.chunks_total} chunks "
          f"uploaded, {fork.chunks_copied} copied in the store, {fork.uploaded_bytes} bytes "
          f"sent (the source sent {source.uploaded_bytes})")
    assert fork.chunks_uploaded == 1  # the changed file only
    assert fork.chunks_copied == source.chunks_uploaded - 1  # all the others
    assert fork.uploaded_bytes < source.uploaded_bytes // 10
    assert fork.lineage == (UID, "fork-uid")
    objects = _raw_objects(minio_server, bucket)
    names = {k.rsplit("/", 1)[1] for k in objects if "/chunks/" in k}
    assert len(names) == source.chunks_uploaded + 1  # the same names: one data key

    # The fork's checkpoint restores on its own, for its lineage and parent only...
    store.delete_checkpoint(NS, BOX, "c1")
    assert store.collect_garbage(NS, BOX) == source.chunks_uploaded
    dest = tmp_path / "out"
    store.download(Pin(NS, "fork", "f1", uid="fork-uid", parent="c1", lineage=(UID, "fork-uid"),
                       digest=fork.manifest_digest), dest)
    _same_files(sections, dest)
    with pytest.raises(CheckpointRefused, match="parent checkpoint 'c1'"):
        store.read_manifest(Pin(NS, "fork", "f1", uid="fork-uid", parent="c9"))
    with pytest.raises(CheckpointRefused, match="lineage 5e2d-uid/fork-uid"):
        store.read_manifest(Pin(NS, "fork", "f1", uid="fork-uid", lineage=("fork-uid",)))

    # ...and its key record opens for no other sandbox: copied into another lineage's
    # slot it is unusable, and that sandbox gets a key of its own (other chunk names).
    _copy(minio_server, bucket, store.sandbox_key_key(NS, "fork", "fork-uid"),
          store.sandbox_key_key(NS, "other", "other-uid"))
    other = store.upload(_binding("o1", uid="other-uid", sandbox="other"), sections,
                         {"engine": 1})
    assert other.lineage == ("other-uid",) and other.chunks_copied == 0
    assert other.chunks_uploaded == fork.chunks_total - 1  # the two zero chunks: one
