"""Fakes for the key service's unit tests (test_keyservice.py, test_storecreds.py,
test_sandbox_store_creds.py): a node-agent's token reviews, sandbox pods, the objects
keyaccess.decide reads, a local keyring and a Kubernetes API with two nodes."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from hermit_common.seal import Keyring, KeyringWrapper
from hermit_operator import keyaccess
from hermit_operator.keyaccess import Bound

AUDIENCE = "hermit.dev/keys"
AGENT = "system:serviceaccount:hermit-system:hermit-node-agent"
A = Bound("team-a", "box", "uid-box")
B = Bound("team-a", "other", "uid-other")


def token_review(node: str | None = "node-a", user: str = AGENT, ok: bool = True,
            audiences: tuple[str, ...] = (AUDIENCE,)) -> dict[str, Any]:
    extra = {keyaccess.NODE_NAME_EXTRA: [node]} if node else {}
    return {"authenticated": ok, "audiences": list(audiences),
            "user": {"username": user, "extra": extra}}


def sandbox_pod(b: Bound, node: str, *, restore: str | None = None, controller: bool = True,
         label: str | None = None, api_version: str = "hermit.dev/v1alpha1",
         incarnation: int = 1, name: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "namespace": b.namespace, "name": name or f"{b.sandbox}-{incarnation}",
        "labels": {"hermit.dev/sandbox": label or b.sandbox,
                   "hermit.dev/incarnation": str(incarnation)},
        "ownerReferences": [{"apiVersion": api_version, "kind": "AgentSandbox",
                             "name": b.sandbox, "uid": b.sandbox_uid,
                             "controller": controller}]}
    if restore:
        meta["annotations"] = {"hermit.dev/restore-from": restore}
    return {"metadata": meta, "spec": {"nodeName": node}}


def sandbox_obj(b: Bound, incarnation: int = 1) -> dict[str, Any]:
    return {"metadata": {"namespace": b.namespace, "name": b.sandbox, "uid": b.sandbox_uid},
            "status": {"incarnation": incarnation, "podName": f"{b.sandbox}-{incarnation}"}}


FORK = Bound("team-a", "fork", "uid-fork")
SANDBOXES = {s.sandbox: sandbox_obj(s) for s in (A, B, FORK)}
CHECKPOINTS = {"box-3-manual": {"metadata": {"namespace": "team-a", "name": "box-3-manual"},
                                "spec": {"sandboxRef": {"name": "box"}}},
               "other-2-manual": {"metadata": {"namespace": "team-a"},
                                  "spec": {"sandboxRef": {"name": "other"}}}}


class Reads:
    """The objects decide may read, counted."""

    def __init__(self, sandboxes: dict[str, Any] | None = None) -> None:
        self.sandboxes = SANDBOXES if sandboxes is None else sandboxes
        self.read: list[str] = []

    def sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.read.append(f"sandbox {namespace}/{name}")
        return self.sandboxes.get(name) if namespace == "team-a" else None

    def checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.read.append(f"checkpoint {namespace}/{name}")
        return CHECKPOINTS.get(name) if namespace == "team-a" else None

    def decide(self, node: str, want: Bound, pods: list[dict[str, Any]]) -> None:
        keyaccess.decide(node, want, pods, sandbox_of=self.sandbox,
                         checkpoint_of=self.checkpoint)



def b64key(seed: bytes) -> str:
    return base64.b64encode(hashlib.sha256(seed).digest()).decode()


RING = {"current": "k1", "k1": b64key(b"k1"), "k0": b64key(b"k0")}


def keyring_wrapper() -> KeyringWrapper:
    return KeyringWrapper(lambda: Keyring.from_mapping(RING, "test keys"))


class FakeKube:
    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = [sandbox_pod(A, "node-a"), sandbox_pod(B, "node-b")]
        self.tokens = {"token-a": token_review("node-a"), "token-b": token_review("node-b"),
                       "token-user": token_review(user="system:serviceaccount:team-a:default")}
        self.reviews = 0
        self.lists = 0

    def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
        self.reviews += 1
        assert audiences == [AUDIENCE]
        return self.tokens.get(token, {"authenticated": False})

    def list_node_sandbox_pods(self, node: str, namespace: str) -> list[dict[str, Any]]:
        self.lists += 1
        return [p for p in self.pods if p["spec"]["nodeName"] == node
                and p["metadata"]["namespace"] == namespace]

    def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        return CHECKPOINTS.get(name)

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        return SANDBOXES.get(name)
