"""The key service against a real kube-apiserver (a throwaway control plane,
tests/support/controlplane.py): real TokenRequests for node-agent pods bound to two nodes,
real TokenReviews, the operator's real Kube adapter reading the nodes' pods, and the
node-agent's RemoteKeyWrapper over HTTPS.

Node A's agent gets the data key of the sandbox its node runs, and of the sandbox whose
checkpoint a fork on its node restores; it is refused the key of the sandbox on node B
(an attack: a compromised node asks for what it does not serve)."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from hermit_common import api, hardhttp, protocol
from hermit_common.keyclient import KeyAccessDenied, RemoteKeyWrapper
from hermit_common.seal import Context, Keyring, KeyringWrapper, new_dek
from hermit_operator import keyservice
from hermit_operator.kube import Kube
from tests.support.attacks import REFUSED, Attack
from tests.support.controlplane import ControlPlane, control_plane, install_crds
from tests.support.tls import self_signed

__all__ = ["control_plane"]

pytestmark = pytest.mark.integration

RELEASE_NS = "hermit-system"
AGENT_SA = "hermit-node-agent"
AGENT = f"system:serviceaccount:{RELEASE_NS}:{AGENT_SA}"
TENANTS = "key-tenants"
NODES = ("keys-node-a", "keys-node-b")
AUDIENCE = "hermit.dev/keys"
RING = {"current": "k1", "k1": base64.b64encode(hashlib.sha256(b"k1").digest()).decode()}
Obj = dict[str, Any]


def _admin(plane: ControlPlane) -> client.ApiClient:
    from hermit_common.kubeclient import load_configuration

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(plane.kubeconfig))
        return client.ApiClient(load_configuration())


def _sandbox(custom: client.CustomObjectsApi, name: str) -> Obj:
    obj = {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.SANDBOX_KIND,
           "metadata": {"name": name},
           "spec": {"podTemplate": {"spec": {"containers": [
               {"name": "agent", "image": "busybox", "command": ["sleep", "1"]}]}}}}
    out: Obj = custom.create_namespaced_custom_object(api.GROUP, api.VERSION, TENANTS,
                                                      api.SANDBOX_PLURAL, obj)
    return out


def _sandbox_pod(core: client.CoreV1Api, sandbox: Obj, node: str,
                 restore_from: str | None = None, pod: str | None = None) -> None:
    name = sandbox["metadata"]["name"]
    meta: Obj = {"name": pod or f"{name}-1", "labels": {protocol.LABEL_SANDBOX: name,
                                                 protocol.LABEL_INCARNATION: "1"},
                 "ownerReferences": [protocol.owner_reference(sandbox)]}
    if restore_from:
        meta["annotations"] = {protocol.ANNOTATION_RESTORE_FROM: restore_from}
    core.create_namespaced_pod(TENANTS, {"metadata": meta, "spec": {
        "nodeName": node, "containers": [{"name": "agent", "image": "busybox"}]}})


class World:
    def __init__(self, plane: ControlPlane, tmp: Path) -> None:
        self.admin = _admin(plane)
        self.core = client.CoreV1Api(self.admin)
        custom = client.CustomObjectsApi(self.admin)
        install_crds(self.admin)
        for ns in (RELEASE_NS, TENANTS):
            self.core.create_namespace({"metadata": {"name": ns}})
        self.core.create_namespaced_service_account(RELEASE_NS, {"metadata": {"name": AGENT_SA}})
        self.core.create_namespaced_service_account(TENANTS, {"metadata": {"name": "default"}})
        self.agents: dict[str, Obj] = {}
        for node in NODES:
            self.core.create_node({"metadata": {"name": node}})
            pod = self.core.create_namespaced_pod(RELEASE_NS, {
                "metadata": {"name": f"agent-{node}"},
                "spec": {"nodeName": node, "serviceAccountName": AGENT_SA,
                         "containers": [{"name": "agent", "image": "busybox"}]}})
            self.agents[node] = self.admin.sanitize_for_serialization(pod)
        # box-a runs on node A, box-b on node B; fork (on node A) restores a checkpoint
        # of source, which runs nowhere now.
        self.sandboxes = {n: _sandbox(custom, n) for n in ("box-a", "box-b", "source", "fork")}
        _sandbox_pod(self.core, self.sandboxes["box-a"], NODES[0])
        _sandbox_pod(self.core, self.sandboxes["box-b"], NODES[1])
        custom.create_namespaced_custom_object(api.GROUP, api.VERSION, TENANTS,
                                               api.CHECKPOINT_PLURAL, {
            "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": "Checkpoint",
            "metadata": {"name": "source-1-manual"},
            "spec": {"sandboxRef": {"name": "source"}, "reason": protocol.MANUAL}})
        _sandbox_pod(self.core, self.sandboxes["fork"], NODES[0], "source-1-manual")
        # Someone who may create pods copies box-b's label and owner onto a pod on node A.
        _sandbox_pod(self.core, self.sandboxes["box-b"], NODES[0], pod="box-b-lookalike")
        self.tmp = tmp
        self.ring = KeyringWrapper(lambda: Keyring.from_mapping(RING, "test keys"))
        cert, key = self_signed(tmp, "keys.hermit.internal")
        self.ca = str(cert)
        svc = keyservice.KeyService(self.ring, Kube(self.admin), callers=[AGENT],
                                    audience=AUDIENCE)
        self.server = hardhttp.serve(0, svc.handle, admit=svc.admit,
                                     max_body=keyservice.MAX_BODY, usage=keyservice.USAGE,
                                     name="keys", host="127.0.0.1",
                                     tls=hardhttp.TlsFiles(str(cert), str(key)))
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"

    def context(self, sandbox: str) -> Context:
        uid = self.sandboxes[sandbox]["metadata"]["uid"]
        return Context(TENANTS, sandbox, uid, lineage=(uid,))

    def token(self, node: str, audience: str = AUDIENCE) -> str:
        pod = self.agents[node]
        out = self.core.create_namespaced_service_account_token(AGENT_SA, RELEASE_NS, {
            "spec": {"audiences": [audience], "expirationSeconds": 600,
                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                        "name": pod["metadata"]["name"],
                                        "uid": pod["metadata"]["uid"]}}})
        return str(out.status.token)

    def wrapper(self, node: str, audience: str = AUDIENCE) -> RemoteKeyWrapper:
        path = self.tmp / f"token-{node}-{audience.replace('/', '_')}"
        path.write_text(self.token(node, audience))
        return RemoteKeyWrapper(self.url, ca_file=self.ca, token_file=str(path),
                                backoff_seconds=0.01)


@pytest.fixture(scope="module")
def world(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[World]:
    w = World(control_plane, tmp_path_factory.mktemp("keys"))
    try:
        yield w
    finally:
        w.server.shutdown()
        w.server.server_close()


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
