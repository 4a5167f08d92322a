"""Node-agent test doubles and objects: a fake Kubernetes API, engine, stores and
manifests, the pods, Checkpoints and notices the planner and agent tests build, and
``make_agent`` to run an agent against them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from hermit_common import api, protocol
from hermit_common.store import UploadProgress
from hermit_node.control import planner
from hermit_node.control.agent import NodeAgent
from hermit_node.control.kube import KubeConflict, KubeError
from hermit_node.control.watchers import Notice
from hermit_node.engine.checkpoint import NO_PROGRESS, CheckpointProgress, CheckpointResult
from hermit_node.engine.restore import RestoreResult

NODE = "node-a"

NOW = datetime(2026, 1, 2, 3, 4, 5, 600000, tzinfo=UTC)

DIGEST = "sha256:" + "ab" * 32

IMAGE_DIGEST = "sha256:" + "cd" * 32


def pod(name: str = "box-1", *, sandbox: str | None = "box", incarnation: int = 1,
        node: str = NODE, running: bool = True, phase: str = "Running",
        annotations: dict[str, str] | None = None, owner: bool = True,
        terminating: bool = False, namespace: str = "agents") -> dict[str, Any]:
    labels = {protocol.LABEL_INCARNATION: str(incarnation)}
    if sandbox is not None:
        labels[protocol.LABEL_SANDBOX] = sandbox
    meta: dict[str, Any] = {
        "name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": labels,
        "annotations": annotations or {},
        "ownerReferences": [{"kind": api.SANDBOX_KIND, "name": sandbox, "uid": "sbx-uid"}]
        if owner else [{"kind": "ReplicaSet", "name": "rs", "uid": "rs-uid"}],
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-01-02T03:04:00Z"
    state = {"running": {"startedAt": "2026-01-02T03:00:00Z"}} if running else \
        {"waiting": {"reason": "PodInitializing"}}
    return {
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": "sandbox"}, {"name": "aaa-sidecar"}]},
        "status": {"phase": phase, "containerStatuses": [
            # Sorted by name, as the kubelet reports them: the sidecar comes first.
            {"name": "aaa-sidecar", "containerID": "containerd://" + "ee" * 32,
             "imageID": "docker.io/library/side@sha256:" + "ff" * 32,
             "state": {"running": {}}},
            {"name": "sandbox", "containerID": "containerd://" + "12" * 32,
             "imageID": f"registry.local/agent@{IMAGE_DIGEST}", "state": state},
        ]},
    }


def ckpt(name: str, *, sandbox: str = "box", reason: str = "Manual",
         status: dict[str, Any] | None = None, created: str = "2026-01-02T03:00:00Z",
         namespace: str = "agents", node: str | None = NODE,
         incarnation: int | None = None, verified: bool = True) -> dict[str, Any]:
    """A Checkpoint; ``verified``: the operator's hermit.dev/node-verified mark on it."""
    labels = {protocol.LABEL_SANDBOX: sandbox}
    if node is not None:
        labels[protocol.LABEL_NODE] = node
    if incarnation is not None:
        labels[protocol.LABEL_INCARNATION] = str(incarnation)
    out: dict[str, Any] = {
        "apiVersion": api.API_VERSION, "kind": api.CHECKPOINT_KIND,
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                     "creationTimestamp": created, "labels": labels,
                     "annotations": {protocol.ANNOTATION_NODE_VERIFIED: "true"}
                     if verified else {}},
        "spec": {"sandboxRef": {"name": sandbox}, "reason": reason},
    }
    if status is not None:
        out["status"] = status
    return out


def sps(*pods: dict[str, Any]) -> list[planner.SandboxPod]:
    return planner.sandbox_pods(pods, NODE)


RESULT = CheckpointResult(
    frozen_ms=120, dump_ms=100, capture_ms=15, upload_ms=300, image_bytes=20_000_000,
    uploaded_bytes=5_000_000, stored_bytes=6_000_000,
    manifest_uri="s3://hermit/hermit/agents/box/checkpoints/m/manifest.json",
    manifest_digest=DIGEST, criu_version="4.2.1", kernel="6.18.0", cpu_flags=("avx2", "sse4_2"),
    chunks_total=5, chunks_uploaded=2,
)


def with_status(*patches: dict[str, Any]) -> dict[str, Any]:
    status: dict[str, Any] = {}
    for p in patches:
        status.update(p)
    return ckpt("m", status=status)


def as_operator_wrote(sandbox: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """``sandbox`` as the operator keeps it for ``pods`` (the pods of the tests are the
    operator's): the owner uid they carry, and a status naming the newest of them."""
    name = sandbox["metadata"]["name"]
    mine = [p for p in pods
            if (p["metadata"].get("labels") or {}).get(protocol.LABEL_SANDBOX) == name]
    if not mine:
        return sandbox
    newest = max(mine, key=lambda p: int(p["metadata"]["labels"][protocol.LABEL_INCARNATION]))
    owner = newest["metadata"]["ownerReferences"][0]["uid"]
    return {**sandbox, "metadata": {**sandbox["metadata"], "uid": owner},
            "status": {**(sandbox.get("status") or {}), "podName": newest["metadata"]["name"],
                       "incarnation": int(newest["metadata"]["labels"][
                           protocol.LABEL_INCARNATION])}}


class FakeKube:
    def __init__(self, pods: list[dict[str, Any]], checkpoints: list[dict[str, Any]]) -> None:
        self.node_name = NODE
        self.pods = pods
        self.checkpoints = {c["metadata"]["name"]: c for c in checkpoints}
        self.node: dict[str, Any] = {"metadata": {"resourceVersion": "7"}, "spec": {}}
        self.statuses: list[tuple[str, dict[str, Any]]] = []
        self.annotations: list[tuple[str, dict[str, str | None]]] = []
        self.events: list[tuple[str, str, str]] = []
        self.fail_lists = 0
        self.claims: list[tuple[str, str | None]] = []  # (name, resourceVersion precondition)
        self.node_patches: list[dict[str, Any]] = []
        self.fail_node_patches = 0

    def list_node_pods(self) -> list[dict[str, Any]]:
        if self.fail_lists:
            self.fail_lists -= 1
            raise KubeError("listing pods on node node-a failed: HTTP 503")
        return self.pods

    def list_node_checkpoints(self) -> list[dict[str, Any]]:
        return list(self.checkpoints.values())

    # The agent's NodeView (its watches' local copy), read straight from this fake.
    def pods_now(self) -> list[dict[str, Any]]:
        return self.list_node_pods()

    def checkpoints_now(self) -> list[dict[str, Any]]:
        return self.list_node_checkpoints()

    def node_now(self) -> dict[str, Any]:
        return self.node

    def healthy(self) -> bool:
        return True

    def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.checkpoints.get(name)

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        return as_operator_wrote({"metadata": {"name": name, "uid": f"uid-of-{name}"}},
                                 self.pods)

    def create_checkpoint(self, body: dict[str, Any], namespace: str) -> dict[str, Any]:
        name = body["metadata"]["name"]
        if name not in self.checkpoints:
            made = ckpt(name, reason=body["spec"]["reason"],
                        sandbox=body["spec"]["sandboxRef"]["name"], verified=False)
            made["metadata"]["labels"].update(body["metadata"].get("labels") or {})
            self.checkpoints[name] = made
        return self.checkpoints[name]

    def pod_event(self, namespace: str, name: str, uid: str, kind: str, reason: str,
                  msg: str) -> None:
        self.events.append((name, kind, reason))

    def claim_checkpoint(self, namespace: str, name: str, status: dict[str, Any],
                         resource_version: str | None) -> None:
        current = self.checkpoints[name]["metadata"].get("resourceVersion")
        if resource_version is not None and resource_version != current:
            raise KubeConflict(f"claiming Checkpoint {namespace}/{name} failed: HTTP 409")
        self.claims.append((name, resource_version))
        self.patch_checkpoint_status(namespace, name, status)

    def patch_checkpoint_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append((name, status))
        self.checkpoints[name].setdefault("status", {}).update(status)

    def annotate_pod(self, namespace: str, name: str, ann: dict[str, str | None]) -> None:
        self.annotations.append((name, ann))

    def patch_node(self, patch: dict[str, Any]) -> None:
        self.node_patches.append(patch)
        if self.fail_node_patches:
            self.fail_node_patches -= 1
            raise KubeError("patching node node-a failed: HTTP 503")
        self.node["spec"].update(patch.get("spec") or {})
        labels = (patch.get("metadata") or {}).get("labels") or {}
        if labels:
            self.node["metadata"].setdefault("labels", {}).update(labels)

    def checkpoint_event(self, c: dict[str, Any], kind: str, reason: str, msg: str) -> None:
        self.events.append((c["metadata"]["name"], kind, reason))


class FakeEngine:
    def __init__(self, error: Exception | None = None,
                 progress: list[UploadProgress] | None = None) -> None:
        self.error = error
        self.progress = progress or []  # reported after uploading(), as the store does
        self.calls: list[tuple[Any, bool]] = []
        self.stores: list[Any] = []  # the store each call was given
        self.urgent: list[bool] = []  # each checkpoint's upload class
        self.lazy = False  # restores are not lazy

    def checkpoint(self, target: Any, *, stop: bool = False,
                   keep_local: bool = False, deadline: float | None = None,
                   progress: CheckpointProgress = NO_PROGRESS,
                   store: Any = None, urgent: bool = False) -> CheckpointResult:
        self.calls.append((target, stop))
        self.stores.append(store)
        self.urgent.append(urgent)
        if self.error is None:
            progress.captured()
            progress.uploading(5, 4)
        for step in self.progress:
            progress.progressed(step)
        if self.error is not None:
            raise self.error
        progress.durable(RESULT)  # the real engine: before a stopping one kills the tree
        return RESULT

    def restore(self, target: Any, *, timeout: float = 120.0,
                store: Any = None) -> RestoreResult:
        self.calls.append((target, False))
        self.stores.append(store)
        if self.error is not None:
            raise self.error
        return RestoreResult(download_ms=1, apply_ms=1, restore_ms=1, total_ms=3,
                             restored_pid=2, downloaded_bytes=10)


def fake_proc(tmp_path: Path) -> Path:
    """A /proc with the sandbox container's init at host pid 420."""
    root = tmp_path / "proc"
    d = root / "420"
    d.mkdir(parents=True)
    (d / "cgroup").write_text(f"12:freezer:/kubepods/pod1/{'12' * 32}\n")
    (d / "stat").write_text("420 (hermit-init) S 400 420 420 0 -1\n")
    (d / "status").write_text("NSpid:\t420\t1\n")
    return root


def make_agent(tmp_path: Path, kube: FakeKube, engine: FakeEngine, *, view: Any = None,
               **collaborators: Any) -> NodeAgent:
    """An agent of ``NODE`` on ``kube`` (its view too, unless ``view``), with ``engine`` for
    both engines and any other collaborators of ``NodeAgent`` (stores, fence, ...)."""
    return NodeAgent(NODE, kube, engine, engine,  # type: ignore[arg-type]
                     view=kube if view is None else view, proc_root=fake_proc(tmp_path),
                     clock=lambda: NOW, **collaborators)


def notice(kind: str = "spot-interruption") -> Notice:
    return Notice(provider="aws", kind=kind, action="terminate",
                  deadline=NOW + timedelta(seconds=120), received_at=NOW, event_id="e1")


class FakeManifests:
    def __init__(self, durable: set[str]) -> None:
        self.durable = durable

    def read_manifest(self, pin: Any) -> tuple[Any, str]:
        from hermit_common.manifest import Binding, Manifest, Totals
        from hermit_common.s3errors import CheckpointNotFound

        namespace, sandbox, checkpoint = pin.namespace, pin.sandbox, pin.checkpoint
        if checkpoint not in self.durable:
            raise CheckpointNotFound(f"checkpoint {namespace}/{checkpoint} not found")
        binding = Binding(namespace=namespace, sandbox=sandbox, sandbox_uid="sbx-uid",
                          checkpoint=checkpoint, criu_version="4.2.1", kernel="6.18.0")
        return Manifest(binding=binding, created_at="2026-01-02T03:04:05Z", chunk_size=4096,
                        sections={}, restore={}, totals=Totals(image_bytes=10,
                                                               stored_bytes=4)), DIGEST

    def manifest_uri(self, namespace: str, sandbox: str, checkpoint: str) -> str:
        return f"s3://b/{namespace}/{sandbox}/checkpoints/{checkpoint}/manifest.json"


class FakeStores:
    """storage.Stores with one store for everything; records what it was asked."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.asked: list[tuple[str, Any]] = []

    def for_sandbox(self, sandbox: dict[str, Any]) -> tuple[Any, Any]:
        from hermit_node.control.storage import Location

        self.asked.append(("sandbox", sandbox))
        return self.store, Location(bucket="b", prefix="hermit", region="us-east-1")

    def for_checkpoint(self, c: dict[str, Any], owner: dict[str, Any] | None) -> Any:
        self.asked.append((c["metadata"]["name"], owner))
        return self.store


class FakeTrees:
    def __init__(self, left: str = "nothing-restored") -> None:
        self.settled: list[tuple[int, bool]] = []
        self.left = left  # what restore_left answers (freezer.CRIU_AT_WORK, ...)
        self.ended: list[int] = []

    def settle(self, init_pid: int, *, kill: bool) -> bool:
        self.settled.append((init_pid, kill))
        return True

    def restore_left(self, init_pid: int) -> str:
        return self.left

    def end(self, init_pid: int) -> int:
        self.ended.append(init_pid)
        return 2
