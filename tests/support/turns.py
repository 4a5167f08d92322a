"""The turn service against a fake API: snapshots of a sandbox (``snap``), the fake
Kubernetes calls it makes (``FakeKube``), a ``service`` and a ``post`` of one turn."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hermit_common import protocol
from hermit_node.control import planner
from hermit_node.control.planner import SandboxPod
from hermit_node.engine.inspector import FileSig, Proc, Snapshot
from hermit_node.turns import turns
from tests.support.node_agent import NODE, pod

SIG = FileSig(0o100644, 10, 1, 1, 100, 0, 0)

INIT = Proc(1, 50, "/usr/local/bin/hermit-init", ("hermit-init", "--"), (800, 4, 0, 0, 0, 4, 0),
            (0, 0, 1, 10, 0), exempt=True)

AGENT = Proc(7, 60, "/bin/sleep", ("sleep", "1000"), (2000, 500, 100, 400, 0, 300, 0),
             (3, 1, 1, 2, 0))


def snap(files: dict[str, dict[str, FileSig]] | None = None,
         procs: tuple[Proc, ...] = (INIT, AGENT),
         sockets: frozenset[str] = frozenset({"tcp 00000000:1B58"}),
         unreadable: tuple[str, ...] = ()) -> Snapshot:
    return Snapshot(files={"rootfs": {"etc/x": SIG}, "workspace": {"a.txt": SIG}}
                    if files is None else files,
                    processes={p.pid: p for p in procs}, sockets=sockets, unreadable=unreadable)


class FakeKube:
    def __init__(self) -> None:
        self.authenticated, self.allowed = True, True
        self.sandbox: dict[str, Any] | None = {
            "metadata": {"name": "box", "namespace": "agents"},
            "spec": {"checkpoint": {"onTurn": True}}, "status": {"nodeName": NODE}}
        self.pods = [pod()]
        self.checkpoints: dict[str, dict[str, Any]] = {}
        self.reviews: list[dict[str, Any]] = []
        self.audiences: list[list[str]] = []
        self.served_to = protocol.UPLOADING
        self.audience_aware = True
        # Told when a checkpoint it serves captured its tree (the node-agent's job would).
        self.on_captured: Callable[[str], None] = lambda name: None

    def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
        self.audiences.append(audiences)
        return {"authenticated": self.authenticated and token == "good",
                "audiences": list(audiences) if self.audience_aware else [],
                "user": {"username": "system:serviceaccount:agents:harness", "uid": "u1"}}

    def review_access(self, user: dict[str, Any], attributes: dict[str, Any]) -> dict[str, Any]:
        self.reviews.append(attributes)
        return {"allowed": self.allowed}

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.sandbox if name == "box" else None

    def list_node_pods(self) -> list[dict[str, Any]]:
        return self.pods

    def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.checkpoints.get(name)

    def create_checkpoint(self, manifest: dict[str, Any],
                          namespace: str | None = None) -> dict[str, Any]:
        # Served at once up to Uploading (the tree thawed): the settle step reads it then.
        # As the API server answers: the object in the namespace it was created in.
        metadata = {**manifest["metadata"]}
        if namespace is not None:
            metadata.setdefault("namespace", namespace)
        manifest = {**manifest, "metadata": metadata, "status": {"phase": self.served_to}}
        created = self.checkpoints.setdefault(manifest["metadata"]["name"], manifest)
        if self.served_to in (protocol.UPLOADING, protocol.COMPLETED):  # dumped already
            self.on_captured(manifest["metadata"]["name"])
        return created

    def patch_checkpoint_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        current = self.checkpoints[name].setdefault("status", {})
        for key, value in status.items():
            if isinstance(value, dict):
                current.setdefault(key, {}).update(value)
            else:
                current[key] = value

    def complete(self, name: str) -> None:
        self.checkpoints[name].setdefault("status", {})["phase"] = protocol.COMPLETED


PATH = "/v1/namespaces/agents/agentsandboxes/box/turns"

# Read at the dump, tree still frozen: freezing and dumping moved the context switches.
DUMPED = snap(procs=(replace(INIT, activity=(0, 0, 1, 11, 0)),
                     replace(AGENT, activity=(3, 1, 1, 8, 0))))
# Read after the thaw: each thread woke once more (inspector.thaw_only).
THAWED = snap(procs=(replace(INIT, activity=(0, 0, 1, 12, 0)),
                     replace(AGENT, activity=(3, 1, 1, 9, 0))))


def service(kube: FakeKube, states: list[Snapshot], thawed: Snapshot | None = THAWED,
            dumped: Snapshot | None = DUMPED, **kw: Any) -> turns.TurnService:
    """``states``: the turns' end states in order; ``dumped``: what is read of each
    checkpoint's processes at its dump (told through ``kube.on_captured``), ``thawed``:
    what is read after its thaw."""
    def take(sp: SandboxPod) -> Snapshot:
        return states.pop(0)

    kw.setdefault("spawn", lambda fn: fn())
    svc = turns.TurnService(NODE, kube, take, lambda sp: thawed, at_dump=lambda sp: dumped,
                            sleep=lambda s: None, **kw)

    def captured(name: str) -> None:
        for sp in planner.sandbox_pods(kube.pods, NODE):
            svc.captured(sp, name, protocol.TURN)

    kube.on_captured = captured
    return svc


def post(svc: turns.TurnService, turn: int, token: str = "good", path: str = PATH,
         **extra: Any) -> turns.Reply:
    return svc.handle(path, f"Bearer {token}", json.dumps({"turn": turn, **extra}).encode())
