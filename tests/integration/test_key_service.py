"""The key service against a real kube-apiserver (a throwaway control plane,
tests/support/controlplane.py): real TokenRequests for node-agent pods bound to two nodes,
real TokenReviews, the operator's real Kube adapter reading the nodes' pods, and the
node-agent's RemoteKeyWrapper over HTTPS; the same service with its key-encryption key
in KMS (the real local-kms, tests/support/localkms.py).

Node A's agent gets the data key of the sandbox its node runs, and of the sandbox whose
checkpoint a fork on its node restores; it is refused the key of the sandbox on node B
(an attack: a compromised node asks for what it does not serve)."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import CheckpointRefused
from hermit_common.keyclient import KeyAccessDenied
from hermit_common.seal import Context, Keyring, KeyringWrapper, new_dek
from hermit_operator import keyservice
from hermit_operator.kms import AwsKmsWrapper
from hermit_operator.kube import Kube
from tests.support.attacks import REFUSED, Attack
from tests.support.controlplane import ControlPlane, control_plane
from tests.support.keyworld import AGENT_SA, AUDIENCE, KeyWorld
from tests.support.localkms import LocalKms, local_kms

__all__ = ["control_plane", "local_kms"]

pytestmark = pytest.mark.integration

RELEASE_NS = "hermit-system"
AGENT = f"system:serviceaccount:{RELEASE_NS}:{AGENT_SA}"
TENANTS = "key-tenants"
NODES = ("keys-node-a", "keys-node-b")
RING = {"current": "k1", "k1": base64.b64encode(hashlib.sha256(b"k1").digest()).decode()}
Obj = dict[str, Any]


class World(KeyWorld):
    """box-a runs on node A, box-b on node B; fork (on node A) restores a checkpoint of
    source, which runs nowhere now; and a lookalike of box-b's pod on node A."""

    def __init__(self, plane: ControlPlane, tmp: Path) -> None:
        super().__init__(plane, tmp, release_ns=RELEASE_NS, tenants=TENANTS, nodes=NODES)
        # Someone who may create pods copies box-b's label and owner onto a pod on node A.
        self.sandbox_pod("box-b", NODES[0], pod="box-b-lookalike")
        self.ring = KeyringWrapper(lambda: Keyring.from_mapping(RING, "test keys"))
        self.start_service(keyservice.KeyService(self.ring, Kube(self.admin), callers=[AGENT],
                                                 audience=AUDIENCE))

    def context(self, sandbox: str) -> Context:
        uid = self.sandboxes[sandbox]["metadata"]["uid"]
        return Context(TENANTS, sandbox, uid, lineage=(uid,))


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[World]:
    w = World(control_plane, tmp_path_factory.mktemp("keys"))
    try:
        yield w
    finally:
        w.stop_service()


def _stored_key(world: World, sandbox: str) -> tuple[Context, Any, bytes]:
    """A data key as the sandbox's key record holds it: wrapped by the operator's keys."""
    ctx = world.context(sandbox)
    dek = new_dek()
    return ctx, world.ring.wrap(dek, ctx.sandbox_bytes()), dek


def test_a_node_agent_gets_the_keys_of_the_sandboxes_its_node_serves(world: World) -> None:
    node_a = world.wrapper(NODES[0])
    ctx, wrapped, dek = _stored_key(world, "box-a")
    assert node_a.unwrap(wrapped, ctx.sandbox_bytes()) == dek
    # A fork on node A restores a checkpoint of "source": node A reads source's key too.
    ctx, wrapped, dek = _stored_key(world, "source")
    assert node_a.unwrap(wrapped, ctx.sandbox_bytes()) == dek
    # Node B gets its own sandbox's key.
    ctx, wrapped, dek = _stored_key(world, "box-b")
    assert world.wrapper(NODES[1]).unwrap(wrapped, ctx.sandbox_bytes()) == dek


@pytest.mark.attack
def test_a_node_agent_is_refused_the_keys_of_a_sandbox_on_another_node(
        world: World, attack: Attack) -> None:
    node_a = world.wrapper(NODES[0])
    ctx, wrapped, _ = _stored_key(world, "box-b")
    with pytest.raises(KeyAccessDenied) as refused:
        node_a.unwrap(wrapped, ctx.sandbox_bytes())
    assert f"node {NODES[0]} neither runs nor restores sandbox {TENANTS}/box-b" in \
        str(refused.value)
    with pytest.raises(KeyAccessDenied, match="neither runs nor restores"):
        node_a.wrap(new_dek(), ctx.sandbox_bytes())
    # The same pod's token for another audience (the API server's) is no key service token.
    with pytest.raises(KeyAccessDenied, match="not a valid service-account token"):
        world.wrapper(NODES[0], "https://kubernetes.default.svc.cluster.local") \
            .unwrap(wrapped, ctx.sandbox_bytes())
    attack.record(
        "key service: a node asks for another node's sandbox key",
        tried=f"node-agent of {NODES[0]} (real pod-bound TokenRequest, audience {AUDIENCE}) "
              f"unwraps and wraps the data key of {TENANTS}/box-b, whose pod is on "
              f"{NODES[1]} (with a lookalike pod of box-b on {NODES[0]}: its label and "
              "owner reference, not its name); and the same pod's API-server token",
        outcome=REFUSED,
        evidence=f"403 KeyAccessDenied: {str(refused.value)[:140]}; 401 for the other "
                 "audience")


def test_the_key_service_answers_from_aws_kms(world: World, local_kms: LocalKms) -> None:
    """HERMIT_SEAL_KMS_KEY_ID: the same service and rules, the KEK in KMS."""
    kms_client = local_kms.client()
    key = kms_client.create_key()["KeyMetadata"]["KeyId"]
    mac = kms_client.create_key(KeySpec="HMAC_256", KeyUsage="GENERATE_VERIFY_MAC")
    kw = AwsKmsWrapper(kms_client, key, mac["KeyMetadata"]["KeyId"])
    ring = world.server, world.url
    world.start_service(keyservice.KeyService(kw, Kube(world.admin), callers=[AGENT],
                                              audience=AUDIENCE))
    try:
        node_a = world.wrapper(NODES[0])
        assert node_a.current_key_id() == key
        ctx, dek = world.context("box-a"), new_dek()
        wrapped = node_a.wrap(dek, ctx.sandbox_bytes())
        assert wrapped.key_id == key
        assert kw.unwrap(wrapped, ctx.sandbox_bytes()) == dek  # KMS wrapped it
        assert node_a.unwrap(wrapped, ctx.sandbox_bytes()) == dek
        # What KMS refuses is refused through the service: box-a's key for "source"
        # (which node A may read), or a key record from the Secret's keyring.
        with pytest.raises(CheckpointRefused, match=f"KMS key '{key}' does not open"):
            node_a.unwrap(wrapped, world.context("source").sandbox_bytes())
        _, ring_wrapped, _ = _stored_key(world, "box-a")
        with pytest.raises(CheckpointRefused, match="KMS refused Decrypt with key 'k1'"):
            node_a.unwrap(ring_wrapped, ctx.sandbox_bytes())
        # The node rule holds before KMS is asked.
        with pytest.raises(KeyAccessDenied, match="neither runs nor restores"):
            world.wrapper(NODES[1]).unwrap(wrapped, ctx.sandbox_bytes())
        signed = b"hermit/manifest/v2\0" + json.dumps(
            {"context": {"namespace": TENANTS, "sandbox": "box-a",
                         "sandbox_uid": ctx.sandbox_uid}}).encode()
        signature = node_a.sign(key, signed)
        assert node_a.verify(key, signed, signature)
        assert not node_a.verify(key, signed + b" ", signature)
    finally:
        world.stop_service()
        world.server, world.url = ring


def test_outside_the_watched_namespaces_no_key_is_given(world: World) -> None:
    """operator.watchNamespaces: the operator serves no sandbox elsewhere (and may not
    read its pods there), so a node running box-a gets its key only while its namespace
    is watched."""
    ring = world.server, world.url
    ctx, wrapped, dek = _stored_key(world, "box-a")
    for watched, served in (((TENANTS, "other-tenants"), True), (("other-tenants",), False)):
        world.start_service(keyservice.KeyService(world.ring, Kube(world.admin, watched),
                                                  callers=[AGENT], audience=AUDIENCE))
        try:
            node_a = world.wrapper(NODES[0])
            if served:
                assert node_a.unwrap(wrapped, ctx.sandbox_bytes()) == dek
            else:
                with pytest.raises(KeyAccessDenied, match=f"node {NODES[0]} neither runs "
                                                          f"nor restores sandbox {TENANTS}/box-a"):
                    node_a.unwrap(wrapped, ctx.sandbox_bytes())
        finally:
            world.stop_service()
            world.server, world.url = ring
