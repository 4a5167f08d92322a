"""What the node-agent should do, decided from Kubernetes objects alone (pure functions).

Objects are plain dicts in API (camelCase) form. Nothing here talks to the API,
to /proc or to the clock: callers pass ``now`` and apply what comes back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from hermit_common import api, display, protocol
from hermit_common.pin import Pin
from hermit_common.protocol import KubeObject
from hermit_node.host import freezer

if TYPE_CHECKING:
    from hermit_common.store import UploadProgress
    from hermit_node.engine.checkpoint import CheckpointResult
    from hermit_node.engine.restore import RestoreResult




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
    on_preemption: bool = True  # false: no checkpoint on a notice or a drain
    created: str = ""  # metadata.creationTimestamp, as the API wrote it
    terminating: bool = False  # deletionTimestamp set: being deleted (evicted, say)
    # The first container runs, whether or not the pod is being deleted: a terminating
    # pod's tree can still be saved while its preStop hook holds it (``holds``).
    container_live: bool = False
    # The operator's preStop hook holds its termination (annotation hermit.dev/termination-
    # hold): while it is being deleted, it is saved first.
    hold: bool = False
    # Deleted with a grace period of 0 (a force delete): the API removes the object at once
    # and the kubelet kills the tree; no preStop hook runs, so nothing holds it.
    forced: bool = False

    @property
    def key(self) -> tuple[str, str]:
        """A sandbox is worked on by at most one job at a time."""
        return (self.namespace, self.sandbox)

    @property
    def has_live_tree(self) -> bool:
        """Its processes are the sandbox's (not an init still waiting for a restore)."""
        return self.running and (self.restore_from is None
                                 or self.restore_phase == protocol.RESTORED)


def sandbox_pod(pod: Mapping[str, Any]) -> SandboxPod | None:
    """The sandbox view of ``pod``; None when it is not a sandbox pod."""
    meta = protocol.meta(pod)
    labels = meta.get("labels") or {}
    sandbox = labels.get(protocol.LABEL_SANDBOX)
    owner_uid = next((o.get("uid") for o in meta.get("ownerReferences") or []
                      if o.get("kind") == api.SANDBOX_KIND and o.get("uid")), None)
    if not sandbox or not owner_uid:
        return None
    annotations = meta.get("annotations") or {}
    status = pod.get("status") or {}
    first = _first_container_status(pod)
    try:
        incarnation = int(labels.get(protocol.LABEL_INCARNATION, "0"))
    except ValueError:
        incarnation = 0
    container_live = (status.get("phase") == api.POD_RUNNING
                      and bool((first.get("state") or {}).get("running"))
                      and bool(first.get("containerID")))
    running = container_live and not meta.get("deletionTimestamp")

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
        workspace_path=(annotations.get(protocol.ANNOTATION_WORKSPACE_PATH)
                        or protocol.DEFAULT_WORKSPACE_PATH),
        restore_from=annotations.get(protocol.ANNOTATION_RESTORE_FROM) or None,
        restore_phase=annotations.get(protocol.ANNOTATION_RESTORE_PHASE) or None,
        on_preemption=annotations.get(protocol.ANNOTATION_ON_PREEMPTION) != "false",
        created=str(meta.get("creationTimestamp") or ""),
        terminating=bool(meta.get("deletionTimestamp")),
        container_live=container_live,
        hold=annotations.get(protocol.ANNOTATION_HOLD) == "true",
        forced=bool(meta.get("deletionTimestamp")) and meta.get("deletionGracePeriodSeconds") == 0,
    )


@dataclass(frozen=True)
class CheckpointView:
    """A Checkpoint as the node-agent's jobs read it (read-only). What writes or resolves
    the Checkpoint (its status, its Events, its store) still takes the object itself."""

    namespace: str  # "default" when absent, as for a pod (sandbox_pod)
    name: str
    uid: str
    reason: str  # spec.reason
    sandbox: str  # spec.sandboxRef.name; "" when absent
    phase: str  # status.phase; an empty status is Pending
    taken: bool = False  # status.phase is set: a node-agent took the request
    incarnation: int | None = None  # its incarnation label (protocol.incarnation_of)
    incarnation_label: str | None = None  # the same label as written (None: absent)
    node: str | None = None  # its node label: whose node-agent serves it
    status_node: str = ""  # status.nodeName: the node that took it
    created: str = ""  # metadata.creationTimestamp
    completed_at: str = ""  # status.completedAt: when it became Completed or Failed
    deleting: bool = False  # metadata.deletionTimestamp is set
    verified: bool = False  # the operator's mark (``verified``)
    manifest_digest: str = ""  # status.manifestDigest, once durable
    parent: str = ""  # status.parent
    lineage: tuple[str, ...] | None = None  # status.lineage, when recorded
    resource_version: str | None = None  # the version read: a claim is made on it only

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> CheckpointView:
        meta = protocol.meta(obj)
        status = obj.get("status") or {}
        label = (meta.get("labels") or {}).get(protocol.LABEL_INCARNATION)
        lineage = status.get("lineage")
        return cls(namespace=str(meta.get("namespace") or "default"),
                   name=protocol.name_of(obj), uid=str(meta.get("uid") or ""),
                   reason=protocol.reason_of(obj), sandbox=protocol.sandbox_of(obj) or "",
                   phase=protocol.phase_of(obj), taken=bool(status.get("phase")),
                   incarnation=protocol.incarnation_of(obj),
                   incarnation_label=None if label is None else str(label),
                   node=protocol.node_of(obj), status_node=str(status.get("nodeName") or ""),
                   created=str(meta.get("creationTimestamp") or ""),
                   completed_at=str(status.get("completedAt") or ""),
                   deleting=bool(meta.get("deletionTimestamp")), verified=verified(obj),
                   manifest_digest=str(status.get("manifestDigest") or ""),
                   parent=str(status.get("parent") or ""),
                   lineage=tuple(str(u) for u in lineage)
                   if isinstance(lineage, (list, tuple)) and lineage else None,
                   resource_version=str(meta.get("resourceVersion") or "") or None)

    @property
    def stopping(self) -> bool:
        """A Preemption, Eviction or Suspend checkpoint: its tree ends once it is durable."""
        return protocol.is_stopping(self.reason)

    @property
    def key(self) -> tuple[str, str]:
        """(namespace, name): how pods (restore_from) and jobs name it."""
        return self.namespace, self.name

    @property
    def sandbox_key(self) -> tuple[str, str]:
        """(namespace, sandbox): the sandbox it is of."""
        return self.namespace, self.sandbox

    def of_incarnation(self, sp: SandboxPod) -> bool:
        """Of ``sp``'s sandbox and incarnation."""
        return (self.namespace == sp.namespace and self.sandbox == sp.sandbox
                and self.incarnation == sp.incarnation)


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


def held_tree(sp: SandboxPod) -> bool:
    """A pod being deleted whose tree still runs (its preStop hook holds its termination):
    it may still be saved by a stopping checkpoint. Not a force-deleted one: the API shows
    it with its deletionTimestamp for an instant before it removes it, and a request made
    then would wait for a pod that no node-agent serves."""
    return (sp.terminating and sp.container_live and not sp.forced
            and (sp.restore_from is None or sp.restore_phase == protocol.RESTORED))


def current_pods(pods: Iterable[SandboxPod],
                 held: Set[str] = frozenset()) -> dict[tuple[str, str], SandboxPod]:
    """Per sandbox, the live pod with the highest incarnation, among the pods named as the
    operator names them (``<sandbox>-<incarnation>``): a pod someone else made with the
    sandbox's label, owner and incarnation has another name (names are unique), and is
    never checkpointed in the sandbox's stead. ``held``: uids of pods being deleted whose
    termination the preStop hook holds (``hold_verdict``); they count while their tree
    runs."""
    out: dict[tuple[str, str], SandboxPod] = {}
    for sp in pods:
        live = sp.has_live_tree or (sp.uid in held and held_tree(sp))
        if not live or sp.pod != operator_pod_name(sp.sandbox, sp.incarnation):
            continue
        seen = out.get(sp.key)
        if seen is None or sp.incarnation > seen.incarnation:
            out[sp.key] = sp
    return out


# -- notices --------------------------------------------------------------------------

# Taints other tools put on a node they are about to empty: Karpenter's disruption
# taints, aws-node-termination-handler's and the cluster autoscaler's.
DISRUPTION_TAINTS: frozenset[str] = frozenset({
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/scheduled-maintenance",
    "aws-node-termination-handler/asg-lifecycle-termination",
    "ToBeDeletedByClusterAutoscaler",
})
# Stopping requests per pod while its node stays disrupted. A failed one (the store
# unreachable, say) is made again after a backoff, so a short outage of the store is
# outlived instead of burning every attempt within a second; the notice's deadline, not
# this count, is what normally ends the tries.
STOP_ATTEMPTS = 12
STOP_BACKOFF_SECONDS = (1.0, 2.0, 4.0, 8.0)  # after the 1st, 2nd, 3rd, later failures


def stop_backoff(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failed stopping request of a pod."""
    return STOP_BACKOFF_SECONDS[min(failures, len(STOP_BACKOFF_SECONDS)) - 1]


def stop_requests(pods: Iterable[SandboxPod], reason: str,
                  checkpoints: Iterable[Mapping[str, Any]] | None,
                  now: datetime | None = None,
                  held: Set[str] = frozenset()) -> list[tuple[SandboxPod, str]]:
    """(pod, name tag) for each sandbox pod that needs a stopping request now: the request
    is ``protocol.checkpoint_name(sandbox, incarnation, reason, tag)`` (hermit_node.control.requests
    creates it, under a secret longer name when another node took that one).

    ``checkpoints`` are this node's (labelled with it). A pod's requests are found by their
    labels (sandbox, incarnation, reason), not their names, so a request made under the
    longer name counts as well. The first has no tag; when every one so far Failed (the
    sandbox was left running) and the node is still going away, another is made (``-r2``,
    ``-r3``, ...) once ``stop_backoff`` has passed since the last one failed (its
    ``completedAt``; at once when ``now`` is None), up to STOP_ATTEMPTS. The next number
    follows the highest one made (``request_attempt``), not their count: retention deletes
    the oldest Failed ones, and a count would name a request that exists. With no list of
    checkpoints (the API did not answer), only first requests."""
    views = [CheckpointView.from_object(c) for c in checkpoints or []]
    out = []
    for sp in pods_to_checkpoint_on_notice(pods, held):
        made = [view for view in views if _request_of(view, sp, reason)]
        if checkpoints is None:
            out.append((sp, ""))
            continue
        if any(view.phase != protocol.FAILED for view in made):
            continue  # in flight or done: nothing to add
        attempts = max((_attempt(view.name) for view in made), default=0)
        if attempts >= STOP_ATTEMPTS:
            continue
        if made and not _backed_off(max(made, key=lambda v: v.completed_at), attempts, now):
            continue
        out.append((sp, f"-r{attempts + 1}" if made else ""))
    return out


# ``-r<n>`` ends a request's name, or comes before the secret tag of one made under the
# longer name (hermit_node.control.requests.unsquatted); the sandbox part never reaches the end.
_ATTEMPT_TAG = re.compile(r"-r([0-9]+)(?:-[0-9a-f]+)?$")


def request_attempt(ckpt: Mapping[str, Any]) -> int:
    """Which attempt of its pod's stopping request ``ckpt`` is: n for ``-r<n>``, else 1."""
    return _attempt(CheckpointView.from_object(ckpt).name)


def _attempt(name: str) -> int:
    found = _ATTEMPT_TAG.search(name)
    return int(found.group(1)) if found else 1


def _request_of(view: CheckpointView, sp: SandboxPod, reason: str) -> bool:
    """Whether the Checkpoint is a request of ``reason`` for ``sp``'s incarnation."""
    return view.of_incarnation(sp) and view.reason == reason


def _backed_off(failed: CheckpointView, failures: int, now: datetime | None) -> bool:
    """The failed request's backoff has passed (or its failure time is unknown)."""
    at = protocol.parse_time(failed.completed_at or None)
    if now is None or at is None:
        return True
    return (now - at).total_seconds() >= stop_backoff(failures)


def node_disruption(node: Mapping[str, Any]) -> str | None:
    """Why sandboxes must leave ``node`` now, as a checkpoint reason; None when they need not.

    Hermit's own interruption taint means a cloud notice (Preemption, also after the
    agent restarted and forgot the notice). A cordon or another tool's disruption
    taint means the node is being drained (Eviction): ``kubectl drain``, Karpenter,
    aws-node-termination-handler, the cluster autoscaler.
    """
    spec = node.get("spec") or {}
    keys = {str(t.get("key")) for t in spec.get("taints") or []}
    if protocol.TAINT_INTERRUPTION in keys:
        return protocol.PREEMPTION
    if spec.get("unschedulable") or keys & DISRUPTION_TAINTS:
        return protocol.EVICTION
    return None


def pods_to_checkpoint_on_notice(pods: Iterable[SandboxPod],
                                 held: Set[str] = frozenset()) -> list[SandboxPod]:
    """The sandbox pods to checkpoint when this node is going away, sorted by name
    (``held``: as for ``current_pods``).

    Pods whose sandbox turned ``onPreemption`` off are left alone."""
    return sorted((sp for sp in current_pods(pods, held).values() if sp.on_preemption),
                  key=lambda sp: (sp.namespace, sp.pod))


def early_requests(pods: Iterable[SandboxPod],
                   checkpoints: Iterable[Mapping[str, Any]] | None
                   ) -> list[tuple[SandboxPod, str]]:
    """(pod, name tag: always "") for each sandbox pod that needs an early routine checkpoint
    after an advisory notice (an AWS rebalance recommendation): the node may be reclaimed
    soon, so each sandbox gets a durable base now while it keeps running, and the stopping
    checkpoint of a later interruption notice uploads only what changed since (chunks are
    deduplicated per sandbox).

    One ``Rebalance`` request per incarnation, named by it and found by its labels (so a
    repeated recommendation or a restarted agent makes none twice); none for a sandbox
    that has a checkpoint in flight (it is being checkpointed anyway, or is stopping) or
    that turned ``onPreemption`` off.
    With no list of checkpoints (the API did not answer), none: the caller tries again."""
    if checkpoints is None:
        return []
    views = [CheckpointView.from_object(c) for c in checkpoints]
    busy = {view.sandbox_key for view in views if view.phase in protocol.IN_FLIGHT}
    out = []
    for sp in pods_to_checkpoint_on_notice(pods):
        made = any(_request_of(view, sp, protocol.REBALANCE) for view in views)
        if not made and sp.key not in busy:
            out.append((sp, ""))
    return out


def interruption_taint(kind: str) -> KubeObject:
    return {"key": protocol.TAINT_INTERRUPTION, "value": _label_value(kind), "effect": "NoSchedule"}


def _label_value(text: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in text)[:63]
    return cleaned.strip("-_.")


def node_taint_patch(node: Mapping[str, Any], kind: str) -> KubeObject | None:
    """The merge patch that taints and cordons ``node``; None when it already is.

    Taints are a list the API replaces whole, so the patch carries the full list and
    the resourceVersion it was computed from (a concurrent change makes it conflict).
    """
    spec = node.get("spec") or {}
    taint = interruption_taint(kind)
    taints = [t for t in spec.get("taints") or [] if t.get("key") != protocol.TAINT_INTERRUPTION
              or t.get("effect") != "NoSchedule"]
    current = [t for t in spec.get("taints") or [] if t.get("key") == protocol.TAINT_INTERRUPTION
               and t.get("effect") == "NoSchedule"]
    if spec.get("unschedulable") and current:
        return None
    return {
        "metadata": {"resourceVersion": protocol.meta(node).get("resourceVersion")},
        "spec": {"unschedulable": True, "taints": [*taints, current[0] if current else taint]},
    }


def node_ready_labels() -> dict[str, str]:
    """The labels a ready node-agent puts on its node: that it is ready
    (protocol.LABEL_NODE_AGENT) and the checkpoint format level it reads
    (protocol.LABEL_CHECKPOINT_FORMAT), which restores of newer checkpoints require."""
    return {protocol.LABEL_NODE_AGENT: protocol.NODE_AGENT_READY,
            protocol.LABEL_CHECKPOINT_FORMAT: str(protocol.CHECKPOINT_FORMAT_LEVEL)}


def node_ready_patch(node: Mapping[str, Any]) -> KubeObject | None:
    """The merge patch that labels ``node`` with ``node_ready_labels``; None when it already
    carries them. A merge patch of these labels leaves the node's other labels as they are;
    a format label another release set is replaced by this release's level."""
    labels = protocol.meta(node).get("labels") or {}
    wanted = node_ready_labels()
    if all(labels.get(key) == value for key, value in wanted.items()):
        return None
    return {"metadata": {"labels": wanted}}


# -- checkpoint requests ----------------------------------------------------------------

def checkpoints_to_serve(checkpoints: Iterable[Mapping[str, Any]],
                         pods: Iterable[SandboxPod],
                         held: Set[str] = frozenset()) -> list[tuple[KubeObject, SandboxPod]]:
    """Pending Checkpoints (empty status) whose sandbox's current pod is on this node and
    that are labelled with this node (the operator labels requests with the pod's node;
    the API server refuses this node-agent's status writes on any other).

    ``pods`` are this node's sandbox pods. At most one request per sandbox is
    returned, since a sandbox is checkpointed once at a time: a stopping request
    (Preemption, Eviction, Suspend) first, else the oldest.
    """
    current = current_pods(pods, held)
    chosen: dict[tuple[str, str], tuple[KubeObject, SandboxPod]] = {}
    pending = sorted(
        ((CheckpointView.from_object(c), c) for c in checkpoints if claimable(c)),
        key=lambda vc: (not vc[0].stopping, vc[0].created, vc[0].name))
    for view, ckpt in pending:
        key = view.sandbox_key
        sp = current.get(key)
        if sp is not None and sp.terminating and not view.stopping:
            continue  # a held pod gets its stopping checkpoint only
        if (view.sandbox and sp is not None and key not in chosen
                and _for_incarnation(view, sp) and view.node == sp.node):
            chosen[key] = (dict(ckpt), sp)
    return list(chosen.values())


def claimable(ckpt: Mapping[str, Any]) -> bool:
    """Still a Pending request nobody took: no status phase, not being deleted."""
    view = CheckpointView.from_object(ckpt)
    return not view.taken and not view.deleting


def awaiting(checkpoints: Iterable[Mapping[str, Any]], pods: Iterable[SandboxPod]) -> set[str]:
    """The uids of what still waits for this node-agent: Pending Checkpoints (empty
    status) and pods asking for a restore nobody has started. A job's object leaves this
    set once the status or annotation the job wrote is seen."""
    out = {view.uid for view in map(CheckpointView.from_object, checkpoints)
           if not view.taken}
    out.update(sp.uid for sp in pods if sp.restore_from and sp.restore_phase is None)
    return out


def _for_incarnation(view: CheckpointView, sp: SandboxPod) -> bool:
    """A request labelled with an incarnation is for that pod only: a preemption request
    of incarnation N must never stop incarnation N+1 on another node."""
    return view.incarnation_label is None or view.incarnation_label == str(sp.incarnation)


def completed_stop_of(checkpoints: Iterable[Mapping[str, Any]], sp: SandboxPod) -> str | None:
    """The name of a Completed stopping checkpoint of this pod's incarnation, if any: the
    pod's tree must not run on (it would fork the sandbox's history)."""
    for view in map(CheckpointView.from_object, checkpoints):
        if (view.phase == protocol.COMPLETED and view.stopping
                and view.sandbox_key == (sp.namespace, sp.sandbox)
                and view.incarnation_label == str(sp.incarnation)):
            return view.name
    return None


def stale_checkpoints(checkpoints: Iterable[Mapping[str, Any]], node: str,
                      in_flight: set[tuple[str, str]]) -> list[KubeObject]:
    """Checkpoints this node left Dumping/Uploading with no job running (the agent restarted)."""
    return [dict(c) for c in checkpoints
            if (view := CheckpointView.from_object(c)).phase in protocol.ACTIVE
            and view.status_node == node and view.key not in in_flight]


def upload_deadline(notice_deadline: float | None, now: float, reason: str,
                    routine_seconds: float | None) -> float | None:
    """When a checkpoint's upload gives up (a ``time.monotonic()`` value; None: never).

    During a notice every checkpoint must be durable by the notice's deadline. Otherwise a
    routine checkpoint (Interval, Manual, Turn) gets ``routine_seconds`` from ``now``; a
    stopping one (Eviction, Suspend) has no deadline: it keeps trying while the sandbox
    waits for it."""
    if notice_deadline is not None:
        return notice_deadline
    if protocol.is_stopping(reason) or routine_seconds is None:
        return None
    return now + routine_seconds


def upload_is_urgent(reason: str) -> bool:
    """Whether a checkpoint's upload goes ahead of routine ones on the node's upload
    bandwidth (bandwidth.py): a notice's or a drain's (Preemption, Eviction: the node is
    going away). A Suspend (no deadline, the user chose it) is routine there, though the
    job queue serves it with the stopping ones (agent.Jobs); a Rebalance (early, the
    sandbox runs on) is routine in both."""
    return reason in protocol.MIGRATING_REASONS


# -- restores -------------------------------------------------------------------------

def pods_to_restore(pods: Iterable[SandboxPod],
                    checkpoints: Iterable[Mapping[str, Any]] | None) -> list[SandboxPod]:
    """Running pods asking for a restore that nobody has started, whose Checkpoint is no
    longer in flight. A move's replacement pod is created while its checkpoint is still
    taken (the operator's overlap): it waits, untouched, until that checkpoint is
    Completed; only then does its restore start, and only from that checkpoint. A missing
    or Failed one is left to the restore, which reports why (``restore_origin``).
    ``checkpoints`` None (not listed this loop): nothing starts until the next loop."""
    if checkpoints is None:
        return []
    in_flight = _in_flight(checkpoints)
    return [sp for sp in pods
            if sp.restore_from and sp.restore_phase is None and sp.running
            and (sp.namespace, sp.restore_from) not in in_flight]


def restore_sources_to_read(pods: Iterable[SandboxPod],
                            checkpoints: Iterable[Mapping[str, Any]] | None
                            ) -> list[tuple[str, str]]:
    """(namespace, name) of the Checkpoints that pods waiting for a restore name and that
    this node's copy does not hold: a move's stopping checkpoint is labelled with the old
    node. The agent reads them, so that ``pods_to_restore`` sees one still in flight and
    ``pods_to_prefetch`` starts the prefetch while it is taken."""
    if checkpoints is None:
        return []
    known = {CheckpointView.from_object(c).key for c in checkpoints}
    wanted = {(sp.namespace, str(sp.restore_from)) for sp in pods
              if sp.restore_from and sp.restore_phase is None}
    return sorted(wanted - known)


def _in_flight(checkpoints: Iterable[Mapping[str, Any]]) -> set[tuple[str, str]]:
    """(namespace, name) of the Checkpoints still being taken (protocol.IN_FLIGHT)."""
    return {view.key for view in map(CheckpointView.from_object, checkpoints)
            if view.phase in protocol.IN_FLIGHT}


def pods_to_prefetch(pods: Iterable[SandboxPod],
                     checkpoints: Iterable[Mapping[str, Any]] | None) -> list[SandboxPod]:
    """Pods on this node waiting for a restore whose Checkpoint is still in flight (the
    operator's overlap): the node can fetch the sandbox's earlier checkpoints into its
    chunk cache meanwhile (docs/storage.md, "Prefetch and the chunk cache"). A pod need not
    run yet: it is scheduled here."""
    if checkpoints is None:
        return []
    in_flight = _in_flight(checkpoints)
    return [sp for sp in pods
            if sp.restore_from and sp.restore_phase is None
            and (sp.namespace, sp.restore_from) in in_flight]


# -- who may be restored ----------------------------------------------------------------

ALLOW = "allow"
WAIT = "wait"  # not yet: the operator has not written what would allow it; look again soon
REFUSE = "refuse"
# How long a pod of the operator's may wait for the operator to name it in the sandbox's
# status, or to mark its checkpoint verified (both land within a second of the pod's
# creation when the operator is up; a failover takes about 15 s), before it is refused.
AUTHORITY_WAIT_SECONDS = 120.0


@dataclass(frozen=True)
class Authority:
    """Whether a restore into a pod may start, and why not."""

    verdict: str  # ALLOW, WAIT, REFUSE
    message: str = ""
    retryable: bool = False  # with REFUSE: whether the operator may try the same again


def operator_pod_name(sandbox: str, incarnation: int) -> str:
    """The name the operator gives a sandbox's pod of ``incarnation`` (podspec.pod_name)."""
    return f"{sandbox}-{incarnation}"


def verified(ckpt: Mapping[str, Any]) -> bool:
    """The operator marked the Checkpoint: it saw its node label match the node its
    incarnation ran on (only the operator may set the mark: the chart's policies)."""
    annotations = protocol.meta(ckpt).get("annotations") or {}
    return annotations.get(protocol.ANNOTATION_NODE_VERIFIED) == "true"


def restore_authority(sp: SandboxPod, sandbox: Mapping[str, Any] | None,
                      ckpt: Mapping[str, Any] | None, now: datetime) -> Authority:
    """Whether the restore ``sp`` asks for (its ``restore-from``) may start: only into a pod
    the operator made, and only from a checkpoint the operator verified. Anyone who may
    create pods can label one as a sandbox's, give it an owner reference and a
    ``restore-from``; only the operator writes an AgentSandbox's status and the mark.

    The pod must be the one the sandbox's status names (pod and incarnation), with the
    owner reference's uid that sandbox's; or the pod of the next incarnation, named as the
    operator names it, restoring a stopping checkpoint of the current incarnation (a move's
    replacement, created while that checkpoint is taken and named in the status only once
    it is adopted: docs/protocol.md flow 2). The Checkpoint must carry
    ``hermit.dev/node-verified``. What the operator has not written yet (the status of a
    pod it just created, the mark of a checkpoint it trusts now) is waited for, for at most
    AUTHORITY_WAIT_SECONDS from the pod's creation. A missing, unfinished or failed
    Checkpoint is left to the restore, which reports it as before (``restore_origin``)."""
    where = f"{sp.namespace}/{sp.pod}"
    if sandbox is None:
        return Authority(REFUSE, f"refused: pod {where} names AgentSandbox {sp.sandbox}, which "
                                 "does not exist; nothing is restored into it")
    uid = str(protocol.meta(sandbox).get("uid") or "")
    if uid != sp.sandbox_uid:
        return Authority(REFUSE, f"refused: pod {where} is owned by AgentSandbox uid "
                                 f"{sp.sandbox_uid}, not by {sp.sandbox} (uid {uid}); only the "
                                 "operator's pods are restored")
    status = sandbox.get("status") or {}
    try:
        incarnation = int(status.get("incarnation") or 0)
    except (TypeError, ValueError):
        incarnation = 0
    named = str(status.get("podName") or "")
    current = named == sp.pod and incarnation == sp.incarnation
    next_pod = (sp.incarnation == incarnation + 1
                and sp.pod == operator_pod_name(sp.sandbox, sp.incarnation))
    view = None if ckpt is None else CheckpointView.from_object(ckpt)
    replacement = (next_pod and view is not None and view.sandbox == sp.sandbox
                   and view.reason in protocol.MIGRATING_REASONS
                   and view.incarnation == incarnation)
    waited = _age(sp, now) >= AUTHORITY_WAIT_SECONDS
    if not (current or replacement):
        message = (f"pod {where} is not the pod of AgentSandbox {sp.sandbox} its status names "
                   f"({named or 'none'}, incarnation {incarnation}); only the operator's "
                   "pods are restored")
        if next_pod and not waited:  # just created: the status is written after the pod
            return Authority(WAIT, message)
        return Authority(REFUSE, f"refused: {message}")
    if view is None or view.phase != protocol.COMPLETED or view.verified:
        return Authority(ALLOW)
    message = (f"Checkpoint {sp.restore_from} is not marked {protocol.ANNOTATION_NODE_VERIFIED} "
               "by the operator (its node label was never seen to match the node its "
               "sandbox ran on)")
    if not waited:
        return Authority(WAIT, message)
    return Authority(REFUSE, f"refused: {message}; nothing was restored", retryable=True)


def _age(sp: SandboxPod, now: datetime) -> float:
    """Seconds since the pod was created (0 when unknown: it may still wait)."""
    created = protocol.parse_time(sp.created)
    return 0.0 if created is None else (now - created).total_seconds()


@dataclass(frozen=True)
class PrefetchSource:
    """The checkpoint a prefetch reads, pinned as a restore pins it (``restore_origin``)."""

    pin: Pin
    ckpt: Mapping[str, Any] = field(compare=False, repr=False)  # where it is stored

    @property
    def checkpoint(self) -> str:
        return self.pin.checkpoint


def prefetch_source(checkpoints: Iterable[Mapping[str, Any]],
                    sp: SandboxPod) -> PrefetchSource | None:
    """The newest Completed checkpoint of ``sp``'s sandbox other than the one it waits for
    (most of that one's chunks are usually the same) that the operator verified, or None.
    Only a cache is filled from it: the restore verifies every chunk it takes from there."""
    best: tuple[str, str, Pin, Mapping[str, Any]] | None = None
    for ckpt in checkpoints:
        view = CheckpointView.from_object(ckpt)
        name = view.name
        if view.sandbox_key != (sp.namespace, sp.sandbox) or name == sp.restore_from:
            continue
        if not view.verified:  # a node may create Checkpoints for any sandbox: not read
            continue
        origin = restore_origin(ckpt, name)
        if isinstance(origin, str) or origin.sandbox != sp.sandbox:
            continue
        done = view.completed_at
        if best is None or (done, name) > best[:2]:
            best = (done, name, origin, ckpt)
    return None if best is None else PrefetchSource(best[2], best[3])


def stale_restores(pods: Iterable[SandboxPod], in_flight: set[tuple[str, str]]) -> list[SandboxPod]:
    """Pods this node left Restoring with no job running (the agent restarted)."""
    return [sp for sp in pods if sp.restore_phase == protocol.RESTORING and sp.key not in in_flight]


# What becomes of a restore an earlier run of the agent left Restoring (cut_short_restore).
ADOPT = "adopt"  # its tree runs: it is the sandbox, Restored
END = "end"  # end what runs in the pod, then Failed (retryable): a fresh pod restores
FAIL = "fail"  # nothing runs there: Failed (retryable)
# How long a restore's CRIU may go on after the agent that started it is gone: a restore
# takes seconds; past this it is ended rather than waited for.
CUT_SHORT_PATIENCE_S = 60.0


def cut_short_restore(left: str, *, lazy: bool, waited: float,
                      patience: float = CUT_SHORT_PATIENCE_S) -> str | None:
    """What to do with a restore whose agent died, from what it left (``freezer.
    restore_left``): its CRIU runs in the pod's cgroups, not the agent's, so it may finish
    after the agent is gone, and its tree then runs. A Failed restore gets a fresh pod, so
    a tree that runs must be adopted or ended, never left beside it; adopted only when its
    pages are all in (a lazy restore's daemon died with the agent). None: CRIU is still at
    work; look again (ended once ``patience`` is spent)."""
    if left == freezer.CRIU_AT_WORK:
        return None if waited < patience else END
    if left == freezer.TREE_RESTORED:
        return END if lazy else ADOPT
    return FAIL


def restore_origin(ckpt: Mapping[str, Any] | None, name: str) -> Pin | str:
    """The source of a restore from Checkpoint ``name``, pinned to what its status
    records (manifest digest, parent, "" for none, and lineage), or why it cannot be
    used. Its ``uid`` is left to the caller: the uid of the sandbox it is of."""
    if ckpt is None:
        return f"Checkpoint {name} does not exist"
    view = CheckpointView.from_object(ckpt)
    if view.phase != protocol.COMPLETED:
        return f"Checkpoint {name} is {view.phase}, not Completed"
    if not view.manifest_digest or not view.sandbox:
        return f"Checkpoint {name} records no manifestDigest or sandboxRef"
    return Pin(view.namespace, view.sandbox, name, parent=view.parent, lineage=view.lineage,
               digest=view.manifest_digest)


def unreadable_format(ckpt: Mapping[str, Any], name: str) -> str | None:
    """Why this node-agent must not restore Checkpoint ``name``: its status.formatLevel is
    newer than the protocol.CHECKPOINT_FORMAT_LEVEL it reads; None when it reads it. The
    operator places such a restore only on a node labelled with a newer level, so this
    is a node mislabelled (a rollback that kept the label) and the restore is retryable:
    the same checkpoint on another node, never a fallback to an older one."""
    level = protocol.format_level_of(ckpt)
    if level is None or level <= protocol.CHECKPOINT_FORMAT_LEVEL:
        return None
    return (f"Checkpoint {name} is of checkpoint format {level}, newer than this node-agent "
            f"reads ({protocol.CHECKPOINT_FORMAT_LEVEL}): its node's "
            f"{protocol.LABEL_CHECKPOINT_FORMAT} label is wrong; it restores on a node whose "
            "node-agent reads that format")


def restored_message(name: str, result: RestoreResult) -> str:
    """The restore-message of a restored pod: how long it took and where its chunks came
    from (the node's chunk cache: docs/storage.md#prefetch-and-the-chunk-cache)."""
    return (f"restored from {name} in {result.total_ms} ms ({result.downloaded_bytes} bytes; "
            f"{result.chunks_cached} of {result.chunks_fetched} chunks from the local cache)")


def restore_annotations(phase: str, message: str | None = None, *,
                        retryable: bool | None = None) -> dict[str, str | None]:
    """The pod annotations for a restore phase (a None value removes the annotation).

    ``retryable`` goes with Failed: whether the same checkpoint may restore on a new pod."""
    if phase not in protocol.RESTORE_PHASES:
        raise ValueError(f"unknown restore phase {phase!r}")
    return {protocol.ANNOTATION_RESTORE_PHASE: phase,
            protocol.ANNOTATION_RESTORE_MESSAGE: protocol.one_line(message) if message else None,
            protocol.ANNOTATION_RESTORE_RETRYABLE: None if retryable is None
            else str(retryable).lower()}


# -- Checkpoint status ----------------------------------------------------------------

def status_dumping(node: str, now: datetime, parent: str | None = None,
                   storage: Mapping[str, str] | None = None) -> KubeObject:
    """Dumping has started; ``parent`` is the Checkpoint the pod was restored from (its
    ``restore-from`` annotation), recorded as ``status.parent``: the sandbox's lineage.
    ``storage`` is where the checkpoint is written (``storage.Location.to_status``),
    recorded as ``status.storage`` before anything is: restores and a restarted agent
    read it from there. ``formatLevel``: the format it is written in, known from the start
    so that a move's replacement pod (created while it is taken) asks for a node that
    reads it (protocol.CHECKPOINT_FORMAT_LEVEL)."""
    status: KubeObject = {"phase": protocol.DUMPING, "nodeName": node,
                          "startedAt": protocol.rfc3339(now), "progress": display.DUMPING,
                          "formatLevel": protocol.CHECKPOINT_FORMAT_LEVEL}
    if parent:
        status["parent"] = parent
    if storage:
        status["storage"] = dict(storage)
    return status


def status_uploading(frozen_ms: int, dump_ms: int) -> KubeObject:
    return {"phase": protocol.UPLOADING, "frozenMs": frozen_ms, "dumpMs": dump_ms,
            "progress": display.UPLOADING}


# Upload progress is written at most once a second and once per tenth of the bytes: at
# most about ten status writes per checkpoint, whatever its size.
PROGRESS_MIN_SECONDS = 1.0
PROGRESS_MIN_FRACTION = 0.1


@dataclass(frozen=True)
class ProgressMark:
    """When upload progress was last written (a ``time.monotonic()`` value) and how far."""

    at: float
    fraction: float


def upload_fraction(progress: UploadProgress) -> float:
    if progress.bytes_total > 0:
        return progress.bytes_done / progress.bytes_total
    return progress.chunks_done / progress.chunks_total if progress.chunks_total > 0 else 0.0


def progress_due(last: ProgressMark, now: float, fraction: float) -> bool:
    """Whether upload progress is worth a status write: a second since the last one (or
    since Uploading was written) and a tenth further. The end is not: Completed follows."""
    return (fraction < 1.0 and now - last.at >= PROGRESS_MIN_SECONDS
            and fraction - last.fraction >= PROGRESS_MIN_FRACTION)


def status_progress(progress: UploadProgress) -> KubeObject:
    """The status patch for a running upload: ``progress`` only (the phase is Uploading)."""
    return {"progress": display.upload_progress(progress.chunks_done, progress.chunks_total,
                                                progress.bytes_done, progress.bytes_total)}


def status_completed(result: CheckpointResult, now: datetime, *, stopped: bool,
                     seconds: float | None = None) -> KubeObject:
    """From a ``CheckpointResult``: every field the CRD's Completed rule and columns want.
    ``seconds``: from the request being taken up (Dumping) to durable, for ``duration``."""
    end = "the sandbox ended on this node" if stopped else "the sandbox kept running"
    status: KubeObject = {
        "phase": protocol.COMPLETED,
        "formatLevel": protocol.CHECKPOINT_FORMAT_LEVEL,
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
        "completedAt": protocol.rfc3339(now),
        "size": display.size(result.stored_bytes),
        "progress": display.upload_summary(result.chunks_total, result.chunks_uploaded),
    }
    if result.lineage:
        status["lineage"] = list(result.lineage)
    if seconds is not None:
        status["duration"] = display.duration(seconds)
    return status


def status_recovered(totals: Mapping[str, int], manifest_uri: str, manifest_digest: str,
                     binding: Mapping[str, Any], now: datetime) -> KubeObject:
    """Completed, for a checkpoint whose manifest an earlier run of the agent made durable
    but could not record (it was killed, or the API was down)."""
    return {
        "phase": protocol.COMPLETED,
        "imageBytes": int(totals.get("image_bytes", 0)),
        "storedBytes": int(totals.get("stored_bytes", 0)),
        "manifestURI": manifest_uri,
        "manifestDigest": manifest_digest,
        "criuVersion": str(binding.get("criu_version") or ""),
        "kernel": str(binding.get("kernel") or ""),
        "cpuFeatures": list(binding.get("cpu_flags") or []),
        "message": "durable: its manifest was found in the store after the node-agent "
                   "restarted",
        "completedAt": protocol.rfc3339(now),
        "size": display.size(int(totals.get("stored_bytes", 0))),
        "progress": display.upload_summary(int(totals.get("chunks", 0)), None),
    }


def status_failed(message: str, now: datetime, node: str) -> KubeObject:
    return {"phase": protocol.FAILED, "nodeName": node, "message": protocol.one_line(message),
            "completedAt": protocol.rfc3339(now)}


# -- the termination hold (docs/protocol.md, "Evictions") ---------------------------------

def holds(sp: SandboxPod) -> bool:
    """A pod being deleted whose termination the operator's preStop hook holds and whose
    tree still runs: it may be saved by a stopping checkpoint first."""
    return sp.hold and held_tree(sp)


def _stop_of(view: CheckpointView, sp: SandboxPod) -> bool:
    """A stopping checkpoint of ``sp``'s incarnation (any stopping reason)."""
    return view.of_incarnation(sp) and view.stopping


def hold_verdict(sp: SandboxPod, sandbox: Mapping[str, Any] | None) -> str | None:
    """For a pod being deleted under the termination hold (``holds``): None when it needs a
    stopping checkpoint (``hold_requests`` asks for an Eviction one unless one of its
    incarnation is in flight or done), else why not. Only who may delete or evict a pod can
    set its deletionTimestamp, and the checkpoint is what its deletion calls for anyway.
    ``sandbox``: the pod's AgentSandbox as read (None: gone)."""
    if sandbox is None or str(protocol.meta(sandbox).get("uid") or "") != sp.sandbox_uid:
        return f"its AgentSandbox {sp.sandbox} is gone: nothing to save"
    if protocol.meta(sandbox).get("deletionTimestamp"):
        return f"its AgentSandbox {sp.sandbox} is being deleted: nothing to save"
    if not sp.on_preemption:
        return "its sandbox saves nothing on a drain (onPreemption false)"
    if (sandbox.get("spec") or {}).get("suspend"):
        return "its sandbox is suspended: the operator released it"
    if not held_tree(sp):
        return "its tree is not running (ended, or still waiting for its restore)"
    return None


def hold_requests(pods: Iterable[SandboxPod], held: Set[str],
                  checkpoints: Iterable[Mapping[str, Any]] | None,
                  now: datetime | None = None) -> list[tuple[SandboxPod, str]]:
    """(pod, name tag) of the Eviction requests to make for held pods (being deleted under
    the termination hold, ``hold_verdict`` found nothing against it): none for a pod with a
    stopping checkpoint of its incarnation in flight or done, whatever its reason (a
    Suspend, a notice's)."""
    listed = list(checkpoints or [])
    todo = [sp for sp in pods if sp.uid in held and holds(sp)
            and not any(_stop_of(view, sp) and view.phase != protocol.FAILED
                        for view in map(CheckpointView.from_object, listed))]
    return stop_requests(todo, protocol.EVICTION, checkpoints, now, held)
