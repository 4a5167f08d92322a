"""Per-sandbox storage against a real MinIO: hermit_node.control.storage.Stores builds the store of
each sandbox (its bucket, prefix and the credentials of its Secret), a checkpoint lands only
in its own bucket, is read back from where it was recorded after the spec changed, and
wrong credentials fail with a message that names the bucket and not the secret.

The node-agent never reads the Secret: the key service hands it credentials
(test_sandbox_store_credentials.py runs that against a real API server and STS). Here
``Static`` gives what the key service answers in its "static" mode, the Secret's own
credentials; S3 is real.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import StoreUnavailable
from hermit_common.manifest import Binding
from hermit_common.pin import Pin
from hermit_common.seal import Keyring, KeyringWrapper, Sealing
from hermit_common.store import CheckpointStore
from hermit_common.storecreds import Credentials
from hermit_node.control.storage import Location, Stores
from tests.support.minio import MinioServer

pytestmark = pytest.mark.integration

NS = "team-a"
WRONG = "not-the-minio-secret-key"


def _binding(sandbox: str, checkpoint: str) -> Binding:
    return Binding(namespace=NS, sandbox=sandbox, sandbox_uid=f"uid-{sandbox}",
                   checkpoint=checkpoint, criu_version="4.2.1", kernel="6.18.0")


def _tree(root: Path, text: str) -> dict[str, Path]:
    (root / "criu").mkdir(parents=True)
    (root / "criu" / "pages-1.img").write_bytes(text.encode() * 5000)
    return {"criu": root / "criu"}


class Static:
    """The key service in "static" mode (HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS):
    the Secret's own credentials, for a minute."""

    def __init__(self) -> None:
        self.secrets: dict[str, tuple[str, str]] = {}
        self.ref = "b-s3"  # the secretRef the sandboxes below name

    def store_credentials(self, namespace: str, sandbox: str, reads: tuple[str, ...] = (),
                          *, storage: Any = None, location: Any = None) -> Credentials:
        access, secret = self.secrets[self.ref]
        return Credentials(access, secret, "", 60.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sandbox(name: str, storage: dict[str, Any] | None) -> dict[str, Any]:
    checkpoint: dict[str, Any] = {"retain": 3}
    if storage is not None:
        checkpoint["storage"] = storage
    return {"metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}"},
            "spec": {"checkpoint": checkpoint}}


def _keys(store: CheckpointStore, bucket: str) -> list[str]:
    pages = store.client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def _sandboxes_in(keys: list[str]) -> set[str]:
    """<prefix...>/<namespace>/<sandbox> of every chunk, manifest and (sealed) key object."""
    return {k.split("/chunks/")[0].split("/checkpoints/")[0].split("/keys/")[0] for k in keys}


@pytest.fixture
def buckets(minio_server: MinioServer, request: pytest.FixtureRequest) -> tuple[str, str, str]:
    """The default bucket and two sandboxes' own buckets, created empty for this test."""
    tag = hashlib.sha256(request.node.name.encode()).hexdigest()[:8]
    names = tuple(f"{n}-{tag}-{os.getpid()}" for n in ("default", "team-a", "team-b"))
    for name in names:
        CheckpointStore(minio_server.settings(name)).ensure_bucket()
    return names  # type: ignore[return-value]


def test_each_sandbox_writes_only_to_its_own_bucket_and_reads_it_back(
        minio_server: MinioServer, buckets: tuple[str, str, str], tmp_path: Path) -> None:
    default, a_bucket, b_bucket = buckets
    secrets = Static()
    secrets.secrets["b-s3"] = (minio_server.access_key, minio_server.secret_key)
    stores = Stores(minio_server.settings(default), secrets, allowed=True)
    box_a = _sandbox("box-a", {"bucket": a_bucket, "prefix": "tenants/a"})
    box_b = _sandbox("box-b", {"bucket": b_bucket, "endpoint": minio_server.endpoint,
                               "secretRef": {"name": "b-s3"}})

    written: dict[str, Location] = {}
    for box, name in ((box_a, "box-a"), (box_b, "box-b")):
        store, where = stores.for_sandbox(box)
        result = store.upload(_binding(name, f"{name}-1-preempt"),
                              _tree(tmp_path / name, name), {})
        assert result.manifest_uri.startswith(f"s3://{where.bucket}/")
        written[name] = where

    assert written["box-a"] == Location(bucket=a_bucket, prefix="tenants/a",
                                        region="us-east-1", endpoint=minio_server.endpoint)
    probe = stores.default
    assert _keys(probe, default) == []
    assert _sandboxes_in(_keys(probe, a_bucket)) == {f"tenants/a/{NS}/box-a"}
    assert _sandboxes_in(_keys(probe, b_bucket)) == {f"hermit/{NS}/box-b"}

    # box-a moves to team-b's bucket: its recorded checkpoint is still read from team-a's.
    moved = _sandbox("box-a", {"bucket": b_bucket, "secretRef": {"name": "b-s3"}})
    ckpt = {"metadata": {"name": "box-a-1-preempt", "namespace": NS},
            "status": {"storage": written["box-a"].to_status()}}
    store = stores.for_checkpoint(ckpt, moved)
    assert store.settings.bucket == a_bucket
    manifest = store.download(Pin(NS, "box-a", "box-a-1-preempt", uid="uid-box-a"),
                              tmp_path / "restored")
    assert manifest.binding.sandbox == "box-a"
    assert (tmp_path / "restored" / "criu" / "pages-1.img").read_bytes() == b"box-a" * 5000


def test_wrong_credentials_fail_with_the_bucket_named_and_the_secret_kept(
        minio_server: MinioServer, buckets: tuple[str, str, str], tmp_path: Path) -> None:
    default, _, b_bucket = buckets
    secrets, clock = Static(), Clock()
    secrets.secrets["b-s3"] = (minio_server.access_key, WRONG)
    stores = Stores(minio_server.settings(default), secrets, allowed=True, clock=clock)
    box_b = _sandbox("box-b", {"bucket": b_bucket, "secretRef": {"name": "b-s3"}})
    store, _ = stores.for_sandbox(box_b)
    with pytest.raises(StoreUnavailable, match="access denied") as info:
        store.upload(_binding("box-b", "box-b-1-manual"), _tree(tmp_path / "x", "x"), {})
    assert b_bucket in str(info.value) and WRONG not in str(info.value)

    # The Secret is fixed: within the minute the key service's answer lasts, the node
    # asks again and gets a new client.
    key = f"{store.settings.prefix}/{NS}/box-b/chunks/x"
    before = store._objects.s3(key)
    secrets.secrets["b-s3"] = (minio_server.access_key, minio_server.secret_key)
    clock.now += 60
    fixed, _ = stores.for_sandbox(box_b)
    assert fixed._objects.s3(key) is not before
    fixed.upload(_binding("box-b", "box-b-2-manual"), _tree(tmp_path / "y", "y"), {})
    assert fixed.list_checkpoints(NS, "box-b") == ["box-b-2-manual"]


def test_a_sandbox_store_seals_with_the_node_agents_keys(
        minio_server: MinioServer, buckets: tuple[str, str, str], tmp_path: Path) -> None:
    default, a_bucket, _ = buckets
    keys = {"1": base64.b64encode(os.urandom(32)).decode(), "current": "1"}
    sealing = Sealing(KeyringWrapper(lambda: Keyring.from_mapping(keys, "test Secret")))
    stores = Stores(minio_server.settings(default), Static(), allowed=True, sealing=sealing)
    store, where = stores.for_sandbox(_sandbox("box-a", {"bucket": a_bucket}))
    marker = "PLAIN-MARKER-3f9a"
    store.upload(_binding("box-a", "box-a-1-manual"), _tree(tmp_path / "a", marker), {})
    raw = {k: store.client.get_object(Bucket=a_bucket, Key=k)["Body"].read()
           for k in _keys(store, a_bucket)}
    assert any("/keys/" in k for k in raw), sorted(raw)  # the sandbox's wrapped data key
    assert not any(marker.encode() in body for body in raw.values()), "stored in the clear"
    ckpt = {"metadata": {"name": "box-a-1-manual", "namespace": NS},
            "status": {"storage": where.to_status()}}
    back = stores.for_checkpoint(ckpt, None)
    back.download(Pin(NS, "box-a", "box-a-1-manual", uid="uid-box-a"), tmp_path / "restored")
    assert (tmp_path / "restored" / "criu" / "pages-1.img").read_bytes() == marker.encode() * 5000
