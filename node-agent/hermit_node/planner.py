"""What the node-agent should do, decided from Kubernetes objects alone (pure functions).

Objects are plain dicts in API (camelCase) form. Nothing here talks to the API,
to /proc or to the clock: callers pass ``now`` and apply what comes back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from hermit_common import api

if TYPE_CHECKING:
    from hermit_node.checkpoint import CheckpointResult

Manifest = dict[str, Any]

DEFAULT_WORKSPACE_PATH = "/workspace"
MESSAGE_LIMIT = 1024  # status.message and restore-message stay short and on one line
NAME_LIMIT = 253


@dataclass(frozen=True)
class SandboxPod:
    """A pod that runs one incarnation of an AgentSandbox, as the node-agent sees it."""

    namespace: str
    pod: str
    uid: str
    node: str
    sandbox: str
    sandbox_uid: str
    incarnation: int
    container_id: str | None  # "containerd://<id>" once the first container started
    running: bool  # the first container is running and the pod is not terminating
    image_digest: str | None
    workspace_path: str
    restore_from: str | None
    restore_phase: str | None

    @property
    def key(self) -> tuple[str, str]:
        """A sandbox is worked on by at most one job at a time."""
        return (self.namespace, self.sandbox)

    @property
    def has_live_tree(self) -> bool:
        """Its processes are the sandbox's (not an init still waiting for a restore)."""
        return self.running and (self.restore_from is None or self.restore_phase == "Restored")


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def sandbox_pod(pod: Mapping[str, Any]) -> SandboxPod | None:
    """The sandbox view of ``pod``; None when it is not a sandbox pod."""
    meta = _meta(pod)
    labels = meta.get("labels") or {}
    sandbox = labels.get(api.LABEL_SANDBOX)
    owner_uid = next((o.get("uid") for o in meta.get("ownerReferences") or []
                      if o.get("kind") == api.SANDBOX_KIND and o.get("uid")), None)
    if not sandbox or not owner_uid:
        return None
    annotations = meta.get("annotations") or {}
    status = pod.get("status") or {}
    first = _first_container_status(pod)
    try:
        incarnation = int(labels.get(api.LABEL_INCARNATION, "0"))
    except ValueError:
        incarnation = 0
    running = (status.get("phase") == "Running" and not meta.get("deletionTimestamp")
               and bool((first.get("state") or {}).get("running"))
               and bool(first.get("containerID")))
    return SandboxPod(
        namespace=str(meta.get("namespace") or "default"),
        pod=str(meta.get("name")),
        uid=str(meta.get("uid") or ""),
        node=str((pod.get("spec") or {}).get("nodeName") or ""),
        sandbox=str(sandbox),
        sandbox_uid=str(owner_uid),
        incarnation=incarnation,
        container_id=first.get("containerID") or None,
        running=running,
        image_digest=image_digest(first.get("imageID") or ""),
        workspace_path=annotations.get(api.ANNOTATION_WORKSPACE_PATH) or DEFAULT_WORKSPACE_PATH,
        restore_from=annotations.get(api.ANNOTATION_RESTORE_FROM) or None,
        restore_phase=annotations.get(api.ANNOTATION_RESTORE_PHASE) or None,
    )


def _first_container_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The status of the pod's first container (statuses are sorted by name, not spec order)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    containers = (pod.get("spec") or {}).get("containers") or []
    name = containers[0].get("name") if containers else None
    for cs in statuses:
        if cs.get("name") == name:
            return dict(cs)
    return dict(statuses[0]) if statuses else {}


def image_digest(image_id: str) -> str | None:
    """``repo@sha256:..`` (or a bare digest) -> ``sha256:..``: the same on every node."""
    digest = image_id.rpartition("@")[2]
    return digest or None


def sandbox_pods(pods: Iterable[Mapping[str, Any]], node: str) -> list[SandboxPod]:
    """The sandbox pods scheduled on ``node``."""
    return [sp for p in pods if (sp := sandbox_pod(p)) is not None and sp.node == node]


def current_pods(pods: Iterable[SandboxPod]) -> dict[tuple[str, str], SandboxPod]:
    """Per sandbox, the live pod with the highest incarnation."""
    out: dict[tuple[str, str], SandboxPod] = {}
    for sp in pods:
        if not sp.has_live_tree:
            continue
        seen = out.get(sp.key)
        if seen is None or sp.incarnation > seen.incarnation:
            out[sp.key] = sp
    return out


# -- notices --------------------------------------------------------------------------

def preempt_checkpoint_name(sandbox: str, incarnation: int) -> str:
    return f"{sandbox}-{incarnation}-preempt"[:NAME_LIMIT]


def pods_to_checkpoint_on_notice(pods: Iterable[SandboxPod]) -> list[SandboxPod]:
    """The sandbox pods to checkpoint when this node is going away, sorted by name."""
    return sorted(current_pods(pods).values(), key=lambda sp: (sp.namespace, sp.pod))


def checkpoint_object(sandbox: str, name: str, reason: str,
                      incarnation: int | None = None) -> Manifest:
    """A Checkpoint to create (status empty: Pending), labelled with its sandbox."""
    if reason not in api.REASONS:
        raise ValueError(f"unknown checkpoint reason {reason!r}")
    labels = {api.LABEL_SANDBOX: sandbox}
    if incarnation is not None:
        labels[api.LABEL_INCARNATION] = str(incarnation)
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.CHECKPOINT_KIND,
        "metadata": {"name": name, "labels": labels},
        "spec": {"sandboxRef": {"name": sandbox}, "reason": reason},
    }


def interruption_taint(kind: str) -> Manifest:
    return {"key": api.TAINT_INTERRUPTION, "value": _label_value(kind), "effect": "NoSchedule"}


def _label_value(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in text)[:63]
    return cleaned.strip("-_.")


def node_taint_patch(node: Mapping[str, Any], kind: str) -> Manifest | None:
    """The merge patch that taints and cordons ``node``; None when it already is.

    Taints are a list the API replaces whole, so the patch carries the full list and
    the resourceVersion it was computed from (a concurrent change makes it conflict).
    """
    spec = node.get("spec") or {}
    taint = interruption_taint(kind)
    taints = [t for t in spec.get("taints") or [] if t.get("key") != api.TAINT_INTERRUPTION
              or t.get("effect") != "NoSchedule"]
    current = [t for t in spec.get("taints") or [] if t.get("key") == api.TAINT_INTERRUPTION
               and t.get("effect") == "NoSchedule"]
    if spec.get("unschedulable") and current:
        return None
    return {
        "metadata": {"resourceVersion": _meta(node).get("resourceVersion")},
        "spec": {"unschedulable": True, "taints": [*taints, current[0] if current else taint]},
    }


# -- checkpoint requests ----------------------------------------------------------------

def checkpoint_phase(ckpt: Mapping[str, Any]) -> str | None:
    return (ckpt.get("status") or {}).get("phase") or None


def checkpoint_reason(ckpt: Mapping[str, Any]) -> str:
    return str((ckpt.get("spec") or {}).get("reason") or "")


def is_stopping(reason: str) -> bool:
    """Whether this checkpoint ends the current incarnation once durable."""
    return reason in api.STOPPING_REASONS


def checkpoints_to_serve(checkpoints: Iterable[Mapping[str, Any]],
                         pods: Iterable[SandboxPod]) -> list[tuple[Manifest, SandboxPod]]:
    """Pending Checkpoints (empty status) whose sandbox's current pod is on this node.

    ``pods`` are this node's sandbox pods. At most one request per sandbox is
    returned, since a sandbox is checkpointed once at a time: a stopping request
    (Preemption, Eviction, Suspend) first, else the oldest.
    """
    current = current_pods(pods)
    chosen: dict[tuple[str, str], tuple[Manifest, SandboxPod]] = {}
    pending = sorted(
        (c for c in checkpoints if checkpoint_phase(c) is None and not _meta(c).get(
            "deletionTimestamp")),
        key=lambda c: (not is_stopping(checkpoint_reason(c)),
                       str(_meta(c).get("creationTimestamp") or ""), str(_meta(c).get("name"))))
    for ckpt in pending:
        ref = ((ckpt.get("spec") or {}).get("sandboxRef") or {}).get("name")
        key = (str(_meta(ckpt).get("namespace") or "default"), str(ref))
        sp = current.get(key)
        if ref and sp is not None and key not in chosen:
            chosen[key] = (dict(ckpt), sp)
    return list(chosen.values())


def stale_checkpoints(checkpoints: Iterable[Mapping[str, Any]], node: str,
                      in_flight: set[tuple[str, str]]) -> list[Manifest]:
    """Checkpoints this node left Dumping/Uploading with no job running (the agent restarted)."""
    return [dict(c) for c in checkpoints
            if checkpoint_phase(c) in ("Dumping", "Uploading")
            and (c.get("status") or {}).get("nodeName") == node
            and (str(_meta(c).get("namespace")), str(_meta(c).get("name"))) not in in_flight]


# -- restores -------------------------------------------------------------------------

def pods_to_restore(pods: Iterable[SandboxPod]) -> list[SandboxPod]:
    """Running pods asking for a restore that nobody has started."""
    return [sp for sp in pods
            if sp.restore_from and sp.restore_phase is None and sp.running]


def stale_restores(pods: Iterable[SandboxPod], in_flight: set[tuple[str, str]]) -> list[SandboxPod]:
    """Pods this node left Restoring with no job running (the agent restarted)."""
    return [sp for sp in pods if sp.restore_phase == "Restoring" and sp.key not in in_flight]


@dataclass(frozen=True)
class RestoreSource:
    """Where a restore reads from and what it must match."""

    sandbox: str  # the sandbox the checkpoint was taken of (differs for a fork)
    manifest_digest: str


def restore_source(ckpt: Mapping[str, Any] | None, name: str) -> RestoreSource | str:
    """The source of a restore from Checkpoint ``name``, or why it cannot be used."""
    if ckpt is None:
        return f"Checkpoint {name} does not exist"
    status = ckpt.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase != "Completed":
        return f"Checkpoint {name} is {phase}, not Completed"
    digest = status.get("manifestDigest")
    sandbox = ((ckpt.get("spec") or {}).get("sandboxRef") or {}).get("name")
    if not digest or not sandbox:
        return f"Checkpoint {name} records no manifestDigest or sandboxRef"
    return RestoreSource(sandbox=str(sandbox), manifest_digest=str(digest))


def restore_annotations(phase: str, message: str | None = None) -> dict[str, str | None]:
    """The pod annotations for a restore phase (a None value removes the annotation)."""
    if phase not in api.RESTORE_PHASES:
        raise ValueError(f"unknown restore phase {phase!r}")
    return {api.ANNOTATION_RESTORE_PHASE: phase,
            api.ANNOTATION_RESTORE_MESSAGE: one_line(message) if message else None}


# -- Checkpoint status ----------------------------------------------------------------

def rfc3339(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def one_line(message: str, limit: int = MESSAGE_LIMIT) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def status_dumping(node: str, now: datetime) -> Manifest:
    return {"phase": "Dumping", "nodeName": node, "startedAt": rfc3339(now)}


def status_uploading(frozen_ms: int, dump_ms: int) -> Manifest:
    return {"phase": "Uploading", "frozenMs": frozen_ms, "dumpMs": dump_ms}


def status_completed(result: CheckpointResult, now: datetime, *, stopped: bool) -> Manifest:
    """From a ``CheckpointResult``: every field the CRD's Completed rule and columns want."""
    end = "the sandbox ended on this node" if stopped else "the sandbox kept running"
    return {
        "phase": "Completed",
        "frozenMs": result.frozen_ms,
        "dumpMs": result.dump_ms,
        "uploadMs": result.upload_ms,
        "imageBytes": result.image_bytes,
        "uploadedBytes": result.uploaded_bytes,
        "storedBytes": result.stored_bytes,
        "manifestURI": result.manifest_uri,
        "manifestDigest": result.manifest_digest,
        "criuVersion": result.criu_version,
        "kernel": result.kernel,
        "cpuFeatures": list(result.cpu_flags),
        "message": (f"durable in {result.frozen_ms} ms frozen, {result.uploaded_bytes} bytes "
                    f"uploaded; {end}"),
        "completedAt": rfc3339(now),
    }


def status_failed(message: str, now: datetime, node: str) -> Manifest:
    return {"phase": "Failed", "nodeName": node, "message": one_line(message),
            "completedAt": rfc3339(now)}
