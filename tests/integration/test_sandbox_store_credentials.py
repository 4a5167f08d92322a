"""Per-sandbox store credentials end to end (docs/storage.md#per-sandbox-store-credentials):
a real kube-apiserver with RBAC on (the chart's own rendered roles applied), the operator's
key service running as the operator's service account, and a real MinIO with STS.

box-a (pod on node A) names its own bucket and a Secret in ``spec.checkpoint.storage``.
Node A's agent (its real pod-bound token) checkpoints box-a into that bucket and restores
it, with credentials the key service vends after reading the Secret itself: STS
credentials for box-a's prefix of that bucket, not the Secret's. Node B's agent is refused
(403) for box-a, and the node-agent's service account cannot GET the Secret at all."""

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
from kubernetes import client
from kubernetes.client.rest import ApiException

from hermit_common import api, protocol
from hermit_common.manifest import Binding
from hermit_common.pin import Pin
from hermit_common.seal import Keyring, KeyringWrapper, Sealing
from hermit_common.settings import KeyServiceSettings
from hermit_common.store import CheckpointStore
from hermit_common.storecreds import StoreCredentialsUnavailable
from hermit_node.control.storage import Location, Stores
from hermit_operator import keyservice
from hermit_operator.kube import Kube
from hermit_operator.storevend import SandboxStoreVendor
from hermit_testbed.controlplane import ControlPlane, start_control_plane
from hermit_testbed.errors import TestbedError
from tests.support.attacks import REFUSED, Attack
from tests.support.chart import render
from tests.support.keyworld import AGENT_SA, AUDIENCE, KeyWorld
from tests.support.minio import MinioServer

pytestmark = pytest.mark.integration

RELEASE_NS = "hermit-system"  # the chart's rendered roles name this namespace
OPERATOR_SA = "hermit-operator"
AGENT = f"system:serviceaccount:{RELEASE_NS}:{AGENT_SA}"
NS = "own-store-tenants"
NODES = ("own-node-a", "own-node-b")
SECRET = "box-a-s3"
RING = {"current": "k1", "k1": base64.b64encode(hashlib.sha256(b"own").digest()).decode()}
CHUNK = 64 * 1024
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def rbac_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """An API server of its own that authorizes with RBAC (the shared one allows all)."""
    try:
        plane = start_control_plane(tmp_path_factory.mktemp("rbac-plane"),
                                    authorization="RBAC")
    except TestbedError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield plane
    finally:
        plane.stop()


def _as(admin: client.ApiClient, token: str) -> client.ApiClient:
    """An API client that authenticates with ``token`` (a service account's)."""
    base = admin.configuration
    config = client.Configuration()
    config.host, config.ssl_ca_cert, config.verify_ssl = \
        base.host, base.ssl_ca_cert, base.verify_ssl
    config.cert_file = config.key_file = None
    config.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(config)


class World(KeyWorld):
    def __init__(self, plane: ControlPlane, minio: MinioServer, tmp: Path) -> None:
        super().__init__(plane, tmp, release_ns=RELEASE_NS, tenants=NS, nodes=NODES)
        self.minio = minio
        self.custom = client.CustomObjectsApi(self.admin)
        self.default_bucket = f"own-default-{os.getpid()}"
        self.bucket = f"own-box-a-{os.getpid()}"
        for bucket in (self.default_bucket, self.bucket):
            CheckpointStore(minio.settings(bucket)).ensure_bucket()
        self.root = CheckpointStore(minio.settings(self.bucket))  # checks, setting up
        # The chart's RBAC, rendered with per-sandbox storage in NS, applied for real.
        self.core.create_namespaced_service_account(RELEASE_NS,
                                                    {"metadata": {"name": OPERATOR_SA}})
        self._apply_chart_rbac()
        # The sandbox's own store and its Secret (MinIO's root credentials: they may call
        # AssumeRole, and reach every bucket: what a node must never hold).
        self.core.create_namespaced_secret(NS, {
            "metadata": {"name": SECRET},
            "data": {api.STORAGE_SECRET_ACCESS_KEY_ID: _b64(minio.access_key),
                     api.STORAGE_SECRET_SECRET_ACCESS_KEY: _b64(minio.secret_key)}})
        self.sandboxes["box-a"] = self.custom.patch_namespaced_custom_object(
            api.GROUP, api.VERSION, NS, api.SANDBOX_PLURAL, "box-a",
            {"spec": {"checkpoint": {"storage": {
                "bucket": self.bucket, "endpoint": minio.endpoint,
                "secretRef": {"name": SECRET}}}}})
        # The operator: its key service, as the operator's service account (held to the
        # chart's roles), reads the Secret and vends STS credentials.
        self.defaults = minio.settings(self.default_bucket, chunk_size_bytes=CHUNK)
        vendor = SandboxStoreVendor(self.defaults, KeyServiceSettings(
            sandbox_store_credentials="sts", store_credentials_seconds=900))
        operator = _as(self.admin, self.sa_token(OPERATOR_SA))
        self.start_service(keyservice.KeyService(
            KeyringWrapper(lambda: Keyring.from_mapping(RING, "test keys")), Kube(operator),
            callers=[AGENT], audience=AUDIENCE, sandbox_vendor=vendor))
        # The node-agents hold no store credentials of their own.
        self.bare = dataclasses.replace(self.defaults, access_key_id=None,
                                        secret_access_key=None)

    def _apply_chart_rbac(self) -> None:
        rbac = client.RbacAuthorizationV1Api(self.admin)
        docs = render("nodeAgent.perSandboxStorage=true",
                      f"nodeAgent.perSandboxStorageNamespaces={{{NS}}}",
                      "s3.endpoint=http://minio:9000")
        for doc in docs:
            component = doc["metadata"].get("labels", {}).get("app.kubernetes.io/component")
            if component not in ("operator", "node-agent"):
                continue
            ns = doc["metadata"].get("namespace")
            kind = doc["kind"]
            if kind == "ClusterRole":
                rbac.create_cluster_role(doc)
            elif kind == "ClusterRoleBinding":
                rbac.create_cluster_role_binding(doc)
            elif kind == "Role" and ns in (RELEASE_NS, NS):
                rbac.create_namespaced_role(ns, doc)
            elif kind == "RoleBinding" and ns in (RELEASE_NS, NS):
                rbac.create_namespaced_role_binding(ns, doc)

    def sa_token(self, account: str) -> str:
        """A token of ``account`` for the API server itself (its default audience)."""
        out = self.core.create_namespaced_service_account_token(account, RELEASE_NS, {
            "spec": {"expirationSeconds": 3600}})
        return str(out.status.token)

    def agent_api_token(self, node: str) -> str:
        """Node ``node``'s agent's token for the API server (bound to its pod)."""
        pod = self.agents[node]
        out = self.core.create_namespaced_service_account_token(AGENT_SA, RELEASE_NS, {
            "spec": {"expirationSeconds": 3600, "boundObjectRef": {
                "kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"]}}})
        return str(out.status.token)

    def stores(self, node: str) -> Stores:
        """The node-agent's stores as build_agent makes them: the key service's client
        as the vendor of per-sandbox store credentials, no Secret reader."""
        wrapper = self.wrapper(node)
        default = CheckpointStore(self.bare, scoped=lambda *_: None)  # never used here
        return Stores(self.bare, wrapper, allowed=True, default_store=default,
                      sealing=Sealing(wrapper), scoped=True)

    def checkpoint(self, name: str, sandbox: str, where: Location) -> Obj:
        self.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, NS,
                                                    api.CHECKPOINT_PLURAL, {
            "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": "Checkpoint",
            "metadata": {"name": name},
            "spec": {"sandboxRef": {"name": sandbox}, "reason": protocol.MANUAL}})
        out: Obj = self.custom.patch_namespaced_custom_object_status(
            api.GROUP, api.VERSION, NS, api.CHECKPOINT_PLURAL, name,
            {"status": {"storage": where.to_status()}})
        return out


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture(scope="module")
def world(rbac_plane: ControlPlane, minio_server: MinioServer,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(rbac_plane, minio_server, tmp_path_factory.mktemp("own-store"))
    try:
        yield w
    finally:
        w.stop_service()


def _sections(root: Path, seed: bytes) -> dict[str, Path]:
    images, workspace = root / "images", root / "workspace"
    images.mkdir(parents=True)
    workspace.mkdir()
    (images / "pages-1.img").write_bytes(hashlib.sha256(seed).digest() * (3 * CHUNK // 32))
    (workspace / "notes.txt").write_bytes(b"notes of " + seed)
    return {"images": images, "workspace": workspace}


def _code(call: Any) -> str:
    try:
        call()
    except ClientError as exc:
        return str(exc.response.get("Error", {}).get("Code"))
    return "allowed"


def test_the_serving_node_checkpoints_and_restores_with_vended_credentials_only(
        world: World, tmp_path: Path) -> None:
    stores = world.stores(NODES[0])
    box_a = world.sandboxes["box-a"]
    store, where = stores.for_sandbox(box_a)
    assert where == Location(bucket=world.bucket, prefix="hermit", region="us-east-1",
                             endpoint=world.minio.endpoint)
    uid = str(box_a["metadata"]["uid"])
    binding = Binding(namespace=NS, sandbox="box-a", sandbox_uid=uid,
                      checkpoint="box-a-1-manual", criu_version="4.2.1", kernel="6.18.0")
    result = store.upload(binding, _sections(tmp_path / "a", b"box-a"), {"engine": 1})
    assert result.manifest_uri.startswith(f"s3://{world.bucket}/hermit/{NS}/box-a/")
    pages = world.root.client.get_paginator("list_objects_v2").paginate(Bucket=world.bucket)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    assert keys and all(k.startswith(f"hermit/{NS}/box-a/") for k in keys)

    # What the node holds: temporary credentials for box-a's prefix, not the Secret's.
    client_a = store._objects.s3(f"hermit/{NS}/box-a/chunks/x")
    held = client_a._request_signer._credentials
    assert held.access_key != world.minio.access_key and held.token
    other = f"hermit/{NS}/box-b/chunks/" + "b" * 64
    world.root.client.put_object(Bucket=world.bucket, Key=other, Body=b"box-b's")
    assert _code(lambda: client_a.get_object(Bucket=world.bucket, Key=other)) \
        == "AccessDenied"
    assert _code(lambda: client_a.list_objects_v2(Bucket=world.default_bucket)) \
        == "AccessDenied"

    # A restore (a new pod of box-a on node A) reads where the Checkpoint recorded.
    ckpt = world.checkpoint("box-a-1-manual", "box-a", where)
    reading = stores.for_checkpoint(ckpt, box_a)
    reading.download(Pin(NS, "box-a", "box-a-1-manual", uid=uid, digest=result.manifest_digest),
                     tmp_path / "restored")
    assert (tmp_path / "restored" / "workspace" / "notes.txt").read_bytes() == b"notes of box-a"
    # read-only: a restore never writes through those credentials
    ro = reading._objects.s3(f"hermit/{NS}/box-a/chunks/x")
    assert _code(lambda: ro.put_object(Bucket=world.bucket, Key=f"hermit/{NS}/box-a/x",
                                       Body=b"x")) == "AccessDenied"


@pytest.mark.attack
def test_another_node_gets_nothing_of_the_sandbox_and_no_node_agent_reads_the_secret(
        world: World, attack: Attack) -> None:
    where = Location(bucket=world.bucket, prefix="hermit", region="us-east-1",
                     endpoint=world.minio.endpoint).to_status()
    wrapper_b = world.wrapper(NODES[1])
    refusals = {}
    for what, selector in (("spec", {"storage": "spec"}),
                           ("checkpoint", {"storage": "checkpoint",
                                           "checkpoint": "box-a-2-manual"})):
        with pytest.raises(StoreCredentialsUnavailable, match="neither runs nor restores") \
                as info:
            wrapper_b.store_credentials(NS, "box-a", storage=selector, location=where)
        refusals[what] = str(info.value)
    # Through node B's own stores too: the first S3 call fails, nothing is written.
    store_b, _ = world.stores(NODES[1]).for_sandbox(world.sandboxes["box-a"])
    with pytest.raises(StoreCredentialsUnavailable, match="neither runs nor restores"):
        store_b._objects.s3(f"hermit/{NS}/box-a/chunks/x")
    # The node-agent's service account, held to the chart's roles, may not read the Secret
    # (with its real pod-bound token), in the sandbox's namespace or anywhere.
    agent = client.CoreV1Api(_as(world.admin, world.agent_api_token(NODES[0])))
    statuses = {}
    for ns, name in ((NS, SECRET), (RELEASE_NS, "anything")):
        with pytest.raises(ApiException) as denied:
            agent.read_namespaced_secret(name, ns)
        statuses[f"{ns}/{name}"] = denied.value.status
    with pytest.raises(ApiException) as listing:
        agent.list_secret_for_all_namespaces()
    assert statuses == {f"{NS}/{SECRET}": 403, f"{RELEASE_NS}/anything": 403}
    assert listing.value.status == 403
    # Positive control: the same token is the node-agent's (its roles do work).
    assert agent.list_namespaced_pod(NS).items is not None
    attack.record(
        "per-sandbox store: a node reads another node's sandbox store or its Secret",
        tried=f"node-agent of {NODES[1]} (real pod-bound token) asks the key service for "
              f"the credentials of box-a's own bucket (runs on {NODES[0]}), for its spec's "
              "store and for a Checkpoint's; the node-agent's service account, under the "
              "chart's RBAC on a real API server, GETs the Secret box-a names and lists "
              "Secrets",
        outcome=REFUSED,
        evidence=f"key service 403 for both ({refusals['spec'][:90]}...); Secret GET "
                 f"{statuses}, list {listing.value.status}; node A's credentials are STS "
                 "ones for box-a's prefix (box-b's objects and the default bucket: "
                 "AccessDenied)")
