"""Scoped store credentials end to end (docs/storage.md#scoped-store-credentials): a real
kube-apiserver (real pod-bound TokenRequests and TokenReviews, the operator's Kube
adapter), the operator's key service vending credentials through STS AssumeRole with a
session policy on a real MinIO (the operator holds MinIO's root credentials, which may
call AssumeRole: MinIO then ignores the role ARN), and the node-agent's sealed store
using nothing but those credentials.

Node A runs box-a and a fork restored from a checkpoint of ``source``; node B runs box-b.
Node A's credentials for box-a reach box-a's prefix and nothing else: box-b's objects
cannot be read, written, deleted or listed, nor reached by a key that climbs out of the
prefix; the source's prefix is read-only to it."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from hermit_common.manifest import Binding
from hermit_common.pin import Pin
from hermit_common.seal import Keyring, KeyringWrapper, Sealing
from hermit_common.settings import KeyServiceSettings, StoreSettings
from hermit_common.store import CheckpointStore, make_s3_client
from hermit_common.storecreds import CredentialCache, Credentials, StoreCredentialsUnavailable
from hermit_operator import keyservice
from hermit_operator.kube import Kube
from hermit_operator.storevend import StoreVendor
from tests.support.attacks import REFUSED, Attack
from tests.support.controlplane import ControlPlane, control_plane
from tests.support.keyworld import AGENT_SA, AUDIENCE, KeyWorld
from tests.support.minio import MinioServer

__all__ = ["control_plane"]

pytestmark = pytest.mark.integration

RELEASE_NS = "scoped-system"
AGENT = f"system:serviceaccount:{RELEASE_NS}:{AGENT_SA}"
NS = "scoped-tenants"
NODES = ("scoped-node-a", "scoped-node-b")
RING = {"current": "k1", "k1": base64.b64encode(hashlib.sha256(b"scoped").digest()).decode()}
CHUNK = 64 * 1024
Obj = dict[str, Any]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class World(KeyWorld):
    def __init__(self, plane: ControlPlane, minio: MinioServer, tmp: Path) -> None:
        super().__init__(plane, tmp, release_ns=RELEASE_NS, tenants=NS, nodes=NODES)
        self.minio = minio
        self.bucket = f"scoped-{os.getpid()}"
        self.settings = minio.settings(self.bucket, chunk_size_bytes=CHUNK)
        CheckpointStore(self.settings).ensure_bucket()
        self.ring = KeyringWrapper(lambda: Keyring.from_mapping(RING, "test keys"))
        # The operator: the key service with MinIO's root credentials and a vendor.
        vendor = StoreVendor(self.settings, KeyServiceSettings(
            store_credentials=True, store_credentials_seconds=900))
        self.start_service(keyservice.KeyService(self.ring, Kube(self.admin), callers=[AGENT],
                                                 audience=AUDIENCE, vendor=vendor))
        # Everything the bucket-wide credential does in this test (setting up, checking).
        self.root = CheckpointStore(self.settings, sealing=Sealing(self.ring))
        # The node-agents' default store settings: no credentials of their own.
        self.bare = dataclasses.replace(self.settings, access_key_id=None,
                                        secret_access_key=None)

    def uid(self, sandbox: str) -> str:
        return str(self.sandboxes[sandbox]["metadata"]["uid"])

    def cache(self, node: str, clock: Any = None) -> CredentialCache:
        wrapper = self.wrapper(node)
        kw = {"clock": clock} if clock is not None else {}
        return CredentialCache(wrapper.store_credentials, self.client_of, **kw)

    def client_of(self, creds: Credentials) -> Any:
        return make_s3_client(dataclasses.replace(
            self.bare, access_key_id=creds.access_key_id,
            secret_access_key=creds.secret_access_key, session_token=creds.session_token))

    def node_store(self, node: str) -> tuple[CheckpointStore, CredentialCache]:
        """The node-agent's store as build_agent makes it with scoped credentials."""
        wrapper = self.wrapper(node)
        cache = CredentialCache(wrapper.store_credentials, self.client_of)
        return CheckpointStore(self.bare, sealing=Sealing(wrapper), scoped=cache.client), cache

    def key(self, sandbox: str, rest: str) -> str:
        return f"{self.settings.prefix}/{NS}/{sandbox}/{rest}"


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, minio_server: MinioServer,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(control_plane, minio_server, tmp_path_factory.mktemp("scoped"))
    try:
        yield w
    finally:
        w.stop_service()


def _binding(sandbox: str, uid: str, checkpoint: str) -> Binding:
    return Binding(namespace=NS, sandbox=sandbox, sandbox_uid=uid, checkpoint=checkpoint,
                   criu_version="4.2.1", kernel="6.18.0")


def _sections(root: Path, seed: bytes) -> dict[str, Path]:
    images, workspace = root / "images", root / "workspace"
    images.mkdir(parents=True)
    workspace.mkdir()
    (images / "pages-1.img").write_bytes(hashlib.sha256(seed).digest() * (5 * CHUNK // 32))
    (images / "core.img").write_bytes(os.urandom(3 * CHUNK))
    (workspace / "notes.txt").write_bytes(b"notes of " + seed)
    return {"images": images, "workspace": workspace}


def _code(call: Any) -> str:
    try:
        call()
    except ClientError as exc:
        return str(exc.response.get("Error", {}).get("Code"))
    return "allowed"


def test_a_node_agent_checkpoints_restores_forks_and_collects_with_scoped_credentials_only(
        world: World, tmp_path: Path) -> None:
    """Every store call the node-agent makes (list, put, get, copy, delete) works with
    credentials for one sandbox's prefix, fetched per sandbox from the key service."""
    store, cache = world.node_store(NODES[0])
    assert store.client is None  # no bucket-wide client at all
    sections = _sections(tmp_path / "a", b"box-a")
    c1 = store.upload(_binding("box-a", world.uid("box-a"), "box-a-1"), sections,
                      {"engine": 1})
    assert c1.chunks_uploaded > 0
    (sections["workspace"] / "notes.txt").write_bytes(b"changed")
    c2 = store.upload(_binding("box-a", world.uid("box-a"), "box-a-2"), sections,
                      {"engine": 1}, parent="box-a-1")
    assert c2.chunks_uploaded == 1  # it listed box-a's chunks: only the new one went
    assert store.list_checkpoints(NS, "box-a") == ["box-a-1", "box-a-2"]
    store.download(Pin(NS, "box-a", "box-a-2", uid=world.uid("box-a"), digest=c2.manifest_digest),
                   tmp_path / "out")
    assert (tmp_path / "out" / "workspace" / "notes.txt").read_bytes() == b"changed"
    # Garbage collection: box-a-1's manifest and its own chunk go.
    gc = store.collect(NS, "box-a", keep={"box-a-2"})
    assert gc.manifests == ("box-a-1",) and len(gc.chunks) == 1, gc

    # The source's checkpoint (taken elsewhere, with the bucket-wide credential).
    src_sections = _sections(tmp_path / "s", b"source")
    src = world.root.upload(_binding("source", world.uid("source"), "source-1-manual"),
                            src_sections, {"engine": 1})
    # Node A restores the fork from it (read-only access to source's prefix), gives the
    # fork the source's data key, and the fork's first checkpoint copies the source's
    # chunks inside the bucket (credentials for fork plus read-only source).
    expect = Pin(NS, "source", "source-1-manual", world.uid("source"), "",
                 (world.uid("source"),), src.manifest_digest)
    store.download(expect, tmp_path / "fork-in")
    assert store.inherit_data_key(expect, store, NS, "fork", world.uid("fork"))
    fork = store.upload(_binding("fork", world.uid("fork"), "fork-1"), src_sections,
                        {"engine": 1}, parent="source-1-manual")
    print(f"\nfork's first checkpoint with scoped credentials: {fork.chunks_copied} chunks "
          f"copied from the source's prefix, {fork.chunks_uploaded} uploaded; "
          f"{cache.fetches} credential fetches")
    assert fork.chunks_copied == src.chunks_uploaded and fork.chunks_uploaded == 0
    # box-a; source (read-only); fork; fork + source: four scopes, each fetched once.
    assert cache.fetches == 4


@pytest.mark.attack
def test_a_node_agents_credentials_reach_only_the_prefixes_its_node_serves(
        world: World, attack: Attack) -> None:
    bucket = world.bucket
    victim = world.key("box-b", "chunks/" + "b" * 64)
    world.root.client.put_object(Bucket=bucket, Key=victim, Body=b"box-b's chunk")
    cache = world.cache(NODES[0])
    mine = cache.client(NS, "box-a")
    own = world.key("box-a", "chunks/" + "a" * 64)
    # Positive control: its own prefix, every operation.
    assert _code(lambda: mine.put_object(Bucket=bucket, Key=own, Body=b"x")) == "allowed"
    assert _code(lambda: mine.get_object(Bucket=bucket, Key=own)) == "allowed"
    assert _code(lambda: mine.list_objects_v2(
        Bucket=bucket, Prefix=world.key("box-a", ""))) == "allowed"
    assert _code(lambda: mine.delete_object(Bucket=bucket, Key=own)) == "allowed"
    # Another node's sandbox: read, write, delete, list.
    tries = {
        "read": lambda: mine.get_object(Bucket=bucket, Key=victim),
        "overwrite": lambda: mine.put_object(Bucket=bucket, Key=victim, Body=b"forged"),
        "delete": lambda: mine.delete_object(Bucket=bucket, Key=victim),
        "list": lambda: mine.list_objects_v2(Bucket=bucket, Prefix=world.key("box-b", "")),
        "list the namespace": lambda: mine.list_objects_v2(
            Bucket=bucket, Prefix=f"{world.settings.prefix}/{NS}/"),
        "list the bucket": lambda: mine.list_objects_v2(Bucket=bucket),
        "list 'box-a' without its slash": lambda: mine.list_objects_v2(
            Bucket=bucket, Prefix=world.key("box-a", "")[:-1]),
        "copy it into its own prefix": lambda: mine.copy_object(
            Bucket=bucket, Key=own, CopySource={"Bucket": bucket, "Key": victim}),
    }
    codes = {what: _code(call) for what, call in tries.items()}
    assert codes == dict.fromkeys(tries, "AccessDenied"), codes
    # A key that climbs out of its prefix: refused, and box-b's object is untouched.
    escape = world.key("box-a", "../box-b/chunks/" + "b" * 64)
    escaped = {
        "write": _code(lambda: mine.put_object(Bucket=bucket, Key=escape, Body=b"forged")),
        "read": _code(lambda: mine.get_object(Bucket=bucket, Key=escape)),
        "delete": _code(lambda: mine.delete_object(Bucket=bucket, Key=escape)),
    }
    assert "allowed" not in escaped.values(), escaped
    body = world.root.client.get_object(Bucket=bucket, Key=victim)["Body"].read()
    assert body == b"box-b's chunk"
    # Asking the key service for box-b's credentials: refused (403).
    with pytest.raises(StoreCredentialsUnavailable, match="neither runs nor restores") as no:
        cache.client(NS, "box-b")
    # The source a fork on node A restores from: read-only.
    src_key = world.key("source", "chunks/" + "c" * 64)
    world.root.client.put_object(Bucket=bucket, Key=src_key, Body=b"source chunk")
    source = cache.client(NS, "source")
    ro = {"read": _code(lambda: source.get_object(Bucket=bucket, Key=src_key)),
          "write": _code(lambda: source.put_object(Bucket=bucket, Key=src_key, Body=b"x")),
          "delete": _code(lambda: source.delete_object(Bucket=bucket, Key=src_key))}
    assert ro == {"read": "allowed", "write": "AccessDenied", "delete": "AccessDenied"}
    attack.record(
        "scoped store credentials: a node reaches another node's sandbox in the bucket",
        tried=f"node-agent of {NODES[0]} (real pod-bound token) gets STS credentials for "
              f"its sandbox box-a from the key service and, on a real MinIO, reads, "
              f"overwrites, deletes, lists and copies box-b's objects (on {NODES[1]}), lists "
              "the namespace and the bucket, climbs out with 'box-a/../box-b/...'; asks "
              "for box-b's credentials; writes to a fork's source it only restores",
        outcome=REFUSED,
        evidence=f"AccessDenied for all 8 on box-b (own prefix: allowed); escaping key: "
                 f"{escaped}, box-b's object unchanged; credentials for box-b: 403 "
                 f"({str(no.value)[:80]}...); source: read allowed, write/delete "
                 "AccessDenied")


def test_credentials_are_fetched_again_before_they_expire(world: World) -> None:
    """The cache's clock is moved past the refresh point (STS's shortest lifetime is
    15 minutes): a new set is fetched from the service, and it works."""
    clock = Clock()
    cache = world.cache(NODES[0], clock)
    first = cache.client(NS, "box-a")
    key = world.key("box-a", "checkpoints/x/manifest.json")
    first.put_object(Bucket=world.bucket, Key=key, Body=b"1")
    clock.now += 900 - 225 - 1
    assert cache.client(NS, "box-a") is first and cache.fetches == 1
    clock.now += 2
    second = cache.client(NS, "box-a")
    assert second is not first and cache.fetches == 2
    assert second._request_signer._credentials.access_key != \
        first._request_signer._credentials.access_key
    assert second.get_object(Bucket=world.bucket, Key=key)["Body"].read() == b"1"


def test_minio_lets_its_root_user_assume_a_role_with_a_session_policy(
        world: World) -> None:
    """What the operator's vendor relies on (MinIO, hack/install-minio's version)."""
    sts_settings: StoreSettings = world.settings
    vendor = StoreVendor(sts_settings, KeyServiceSettings(store_credentials=True,
                                                          store_credentials_seconds=900))
    out = vendor.credentials("n", NS, "box-a", write=False, reads=())
    assert out["access"] == "read-only" and out["sessionToken"]
