"""A real API server set up for the key service's tests (test_key_service.py,
test_scoped_store.py): two nodes, each with a node-agent pod of the agent service
account; sandboxes box-a (pod on node A), box-b (pod on node B), source (runs nowhere)
and fork (pod on node A restoring ``source-1-manual``); and the operator's key service
served over TLS on 127.0.0.1 (``KeyWorld.start_service``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from hermit_common import api, hardhttp, protocol
from hermit_common.keyclient import RemoteKeyWrapper
from hermit_operator import keyservice
from tests.support.controlplane import ControlPlane, install_crds
from tests.support.tls import self_signed

AGENT_SA = "hermit-node-agent"
AUDIENCE = "hermit.dev/keys"
Obj = dict[str, Any]


def admin_client(plane: ControlPlane) -> client.ApiClient:
    from hermit_common.kubeclient import load_configuration

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(plane.kubeconfig))
        return client.ApiClient(load_configuration())


class KeyWorld:
    def __init__(self, plane: ControlPlane, tmp: Path, *, release_ns: str, tenants: str,
                 nodes: tuple[str, str]) -> None:
        self.release_ns, self.tenants, self.nodes, self.tmp = release_ns, tenants, nodes, tmp
        self.agent = f"system:serviceaccount:{release_ns}:{AGENT_SA}"
        self.admin = admin_client(plane)
        self.core = client.CoreV1Api(self.admin)
        custom = client.CustomObjectsApi(self.admin)
        install_crds(self.admin)
        for ns in (release_ns, tenants):
            self.core.create_namespace({"metadata": {"name": ns}})
        self.core.create_namespaced_service_account(release_ns, {"metadata": {"name": AGENT_SA}})
        self.core.create_namespaced_service_account(tenants, {"metadata": {"name": "default"}})
        self.agents: dict[str, Obj] = {}
        for node in nodes:
            self.core.create_node({"metadata": {"name": node}})
            pod = self.core.create_namespaced_pod(release_ns, {
                "metadata": {"name": f"agent-{node}"},
                "spec": {"nodeName": node, "serviceAccountName": AGENT_SA,
                         "containers": [{"name": "agent", "image": "busybox"}]}})
            self.agents[node] = self.admin.sanitize_for_serialization(pod)
        self.sandboxes: dict[str, Obj] = {
            name: custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, tenants, api.SANDBOX_PLURAL, {
                    "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.SANDBOX_KIND,
                    "metadata": {"name": name},
                    "spec": {"podTemplate": {"spec": {"containers": [
                        {"name": "agent", "image": "busybox", "command": ["sleep", "1"]}]}}}})
            for name in ("box-a", "box-b", "source", "fork")}
        self.sandbox_pod("box-a", nodes[0])
        self.sandbox_pod("box-b", nodes[1])
        custom.create_namespaced_custom_object(api.GROUP, api.VERSION, tenants,
                                               api.CHECKPOINT_PLURAL, {
            "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": "Checkpoint",
            "metadata": {"name": "source-1-manual"},
            "spec": {"sandboxRef": {"name": "source"}, "reason": protocol.MANUAL}})
        self.sandbox_pod("fork", nodes[0], restore_from="source-1-manual")
        self.url, self.ca = "", ""
        self.server: Any = None

    def sandbox_pod(self, sandbox: str, node: str, restore_from: str | None = None,
                    pod: str | None = None) -> None:
        """An operator-made pod of ``sandbox`` (incarnation 1) bound to ``node``."""
        meta: Obj = {"name": pod or f"{sandbox}-1",
                     "labels": {protocol.LABEL_SANDBOX: sandbox,
                                protocol.LABEL_INCARNATION: "1"},
                     "ownerReferences": [protocol.owner_reference(self.sandboxes[sandbox])]}
        if restore_from:
            meta["annotations"] = {protocol.ANNOTATION_RESTORE_FROM: restore_from}
        self.core.create_namespaced_pod(self.tenants, {"metadata": meta, "spec": {
            "nodeName": node, "containers": [{"name": "agent", "image": "busybox"}]}})

    def start_service(self, service: keyservice.KeyService) -> None:
        cert, key = self_signed(self.tmp, "keys.hermit.internal")
        self.ca = str(cert)
        self.server = hardhttp.serve(0, service.handle, admit=service.admit,
                                     max_body=keyservice.MAX_BODY, usage=keyservice.USAGE,
                                     name="keys", host="127.0.0.1",
                                     tls=hardhttp.TlsFiles(str(cert), str(key)))
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"

    def stop_service(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def token(self, node: str, audience: str = AUDIENCE, seconds: int = 3600) -> str:
        """A token of ``node``'s node-agent, bound to its pod (hence to the node)."""
        pod = self.agents[node]
        out = self.core.create_namespaced_service_account_token(AGENT_SA, self.release_ns, {
            "spec": {"audiences": [audience], "expirationSeconds": seconds,
                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                        "name": pod["metadata"]["name"],
                                        "uid": pod["metadata"]["uid"]}}})
        return str(out.status.token)

    def wrapper(self, node: str, audience: str = AUDIENCE) -> RemoteKeyWrapper:
        path = self.tmp / f"token-{node}-{audience.replace('/', '_')}"
        path.write_text(self.token(node, audience))
        return RemoteKeyWrapper(self.url, ca_file=self.ca, token_file=str(path),
                                backoff_seconds=0.01)
