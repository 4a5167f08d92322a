"""Garbage collection and the conditional manifest write against a real MinIO."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest

from hermit_common.errors import CheckpointFailed
from hermit_common.manifest import Binding
from hermit_common.pin import Pin
from hermit_common.store import CheckpointStore
from tests.support.minio import MinioServer

pytestmark = pytest.mark.integration

CHUNK = 64 * 1024
NS, BOX, UID = "team-a", "agent-1", "7f1c0c8e-uid"
RETAIN = 3


def _binding(checkpoint: str) -> Binding:
    return Binding(namespace=NS, sandbox=BOX, sandbox_uid=UID, checkpoint=checkpoint,
                   criu_version="4.2.1", kernel="6.18.0", cpu_flags=("avx2",),
                   image_digest="sha256:" + "0" * 64)


@pytest.fixture
def store(minio_server: MinioServer, request: pytest.FixtureRequest) -> CheckpointStore:
    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:40].strip("-")
    s = CheckpointStore(minio_server.settings(f"t-{name}-{os.getpid()}",
                                              chunk_size_bytes=CHUNK))
    s.ensure_bucket()
    return s


def _bucket_keys(store: CheckpointStore) -> set[str]:
    keys: set[str] = set()
    token = None
    while True:
        kwargs = {"Bucket": store.settings.bucket}
        if token:
            kwargs["ContinuationToken"] = token
        page = store.client.list_objects_v2(**kwargs)
        keys |= {o["Key"] for o in page.get("Contents", [])}
        if not page.get("IsTruncated"):
            return keys
        token = page["NextContinuationToken"]


def _sections(root: Path, step: int) -> dict[str, Path]:
    """A tree where some chunks stay across steps, some change every step."""
    criu, ws = root / "criu", root / "ws"
    criu.mkdir(parents=True, exist_ok=True)
    ws.mkdir(parents=True, exist_ok=True)
    (criu / "stable.img").write_bytes(random.Random(1).randbytes(2 * CHUNK))
    (criu / "pages.img").write_bytes(random.Random(100 + step).randbytes(3 * CHUNK))
    (ws / "notes").write_bytes(random.Random(200 + step // 2).randbytes(CHUNK + 7))
    return {"criu": criu, "workspace": ws}


def test_twenty_checkpoints_retain_three_leave_only_the_kept_ones(
        store: CheckpointStore, tmp_path: Path) -> None:
    """What the node-agent does after each checkpoint: keep the Checkpoints retention
    keeps (here the newest three), collect the rest. Then list the whole bucket."""
    names: list[str] = []
    uploads = {}
    for step in range(20):
        name = f"c{step:02d}"
        uploads[name] = store.upload(_binding(name), _sections(tmp_path / "src", step), {})
        names.append(name)
        store.collect(NS, BOX, keep=set(names[-RETAIN:]))
    kept = names[-RETAIN:]
    expected = {store.manifest_key(NS, BOX, n) for n in kept}
    for n in kept:
        expected |= {store.chunk_key(NS, BOX, d) for d in uploads[n].manifest.chunk_digests()}
    assert _bucket_keys(store) == expected
    assert store.list_checkpoints(NS, BOX) == kept
    for n in kept:  # every kept checkpoint still restores, byte for byte
        manifest = store.download(Pin(NS, BOX, n, uid=UID), tmp_path / "out" / n)
        assert manifest.binding.checkpoint == n


def test_collect_keeps_young_objects_and_stops_when_told(
        store: CheckpointStore, tmp_path: Path) -> None:
    for step in range(3):
        store.upload(_binding(f"c{step}"), _sections(tmp_path / "src", step), {})
    before = _bucket_keys(store)
    young = store.collect(NS, BOX, keep={"c2"}, min_age_seconds=3600)
    assert young.deleted == 0 and _bucket_keys(store) == before
    stopped = store.collect(NS, BOX, keep={"c2"}, may_delete=lambda: False)
    assert stopped.aborted and _bucket_keys(store) == before
    done = store.collect(NS, BOX, keep={"c2"})
    assert done.manifests == ("c0", "c1") and done.chunks and not done.aborted
    assert store.list_checkpoints(NS, BOX) == ["c2"]


def test_a_second_writer_of_a_manifest_fails_and_does_not_overwrite(
        store: CheckpointStore, tmp_path: Path) -> None:
    first = store.upload(_binding("c1"), _sections(tmp_path / "a", 1), {})
    with pytest.raises(CheckpointFailed, match="exists there already"):
        store.upload(_binding("c1"), _sections(tmp_path / "b", 2), {})
    manifest, digest = store.read_manifest(Pin(NS, BOX, "c1", uid=UID))
    assert digest == first.manifest_digest
    assert manifest.created_at == first.manifest.created_at
