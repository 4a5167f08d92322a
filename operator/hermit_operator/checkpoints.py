"""A sandbox's Checkpoint objects, read by the operator: pure functions.

Which checkpoints belong to a sandbox, the newest Completed one, whether one is in
flight, which stopping checkpoint ends the current pod, when an interval checkpoint is
due, which checkpoint a refused restore falls back to, how stale a restored one is,
which ones retention deletes and which ones still need an owner reference. Nothing
here talks to the API.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from hermit_common import api, display, metrics, protocol
from hermit_common.protocol import (  # the shared vocabulary, re-exported for the operator
    ACTIVE,
    COMPLETED,
    FAILED,
    IN_FLIGHT,
    MIGRATING_REASONS,
    PENDING,
    KubeObject,
    incarnation_of,
    name_of,
    owner_reference,
    parse_time,
    phase_of,
    reason_of,
    sandbox_of,
)
from hermit_common.protocol import meta as _meta
from hermit_operator.conditions import TRUE, get_condition

__all__ = ["ACTIVE", "COMPLETED", "FAILED", "IN_FLIGHT", "MIGRATING_REASONS", "PENDING",
           "incarnation_of", "name_of", "owner_reference", "parse_time", "phase_of",
           "reason_of", "sandbox_of"]

DEFAULT_RETAIN: Final = 3
# A pod that is gone while a stopping checkpoint of it is in flight is replaced only
# once that checkpoint finishes, or once it has been in flight this long.
STOPPING_WAIT: Final = timedelta(seconds=300)
# An in-flight checkpoint older than this no longer holds back interval checkpoints
# (its node-agent is gone); CRD minimum of spec.checkpoint.intervalSeconds.
IN_FLIGHT_LIMIT: Final = timedelta(hours=1)
MIN_INTERVAL_SECONDS: Final = 30
# A restore that failed in a way that may pass (restore-retryable not "false") is retried
# with the same checkpoint after 5 s, 10 s, 20 s ... (at most 300 s), this many times in all.
RESTORE_BACKOFF_SECONDS: Final = 5.0
RESTORE_BACKOFF_MAX_SECONDS: Final = 300.0
MAX_RESTORE_ATTEMPTS: Final = 10
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def created_at(obj: Mapping[str, Any]) -> datetime | None:
    return parse_time(_meta(obj).get("creationTimestamp"))


def finished_at(ckpt: Mapping[str, Any]) -> datetime:
    """When the checkpoint completed (or failed); its creation time when not recorded."""
    status = ckpt.get("status") or {}
    return (parse_time(status.get("completedAt")) or parse_time(status.get("startedAt"))
            or created_at(ckpt) or _EPOCH)


def _order(ckpt: Mapping[str, Any]) -> tuple[datetime, datetime, str]:
    return (finished_at(ckpt), created_at(ckpt) or _EPOCH, name_of(ckpt))


def of_sandbox(sandbox: Mapping[str, Any], checkpoints: Iterable[Mapping[str, Any]]
               ) -> list[KubeObject]:
    """The sandbox's checkpoints, oldest first (by completion, then creation, then name).

    A checkpoint owned by another AgentSandbox (an earlier one of the same name), or an
    unowned one created before this sandbox, is not this sandbox's; neither is one that
    is being deleted.
    """
    meta = _meta(sandbox)
    name, uid = meta.get("name"), meta.get("uid")
    born = created_at(sandbox)
    out: list[KubeObject] = []
    for ckpt in checkpoints:
        cmeta = _meta(ckpt)
        if sandbox_of(ckpt) != name or cmeta.get("deletionTimestamp"):
            continue
        owners = [o.get("uid") for o in cmeta.get("ownerReferences") or []
                  if o.get("kind") == api.SANDBOX_KIND]
        if owners and uid not in owners:
            continue
        created = created_at(ckpt)
        if not owners and born is not None and created is not None and created < born:
            continue
        out.append(dict(ckpt))
    return sorted(out, key=_order)


def completed(ckpts: Sequence[KubeObject]) -> list[KubeObject]:
    return [c for c in ckpts if phase_of(c) == COMPLETED]


def last_completed(ckpts: Sequence[KubeObject]) -> KubeObject | None:
    """The newest Completed checkpoint of an ``of_sandbox`` list."""
    done = completed(ckpts)
    return done[-1] if done else None


def last_checkpoint_status(ckpt: KubeObject) -> KubeObject:
    """status.lastCheckpoint of the sandbox for this Completed checkpoint (``size``: its
    storedBytes, human-readable, for the printer column)."""
    status = ckpt.get("status") or {}
    out: KubeObject = {"name": name_of(ckpt), "reason": reason_of(ckpt) or None}
    when = status.get("completedAt") or _meta(ckpt).get("creationTimestamp")
    out["time"] = when or None
    stored = status.get("storedBytes")
    if isinstance(stored, int) and not isinstance(stored, bool):
        out["size"] = display.size(stored)
    out["formatLevel"] = protocol.format_level_of(ckpt)
    return {k: v for k, v in out.items() if v is not None}


def move_downtime(record: Mapping[str, Any], ckpts: Sequence[KubeObject], now: datetime
                  ) -> tuple[str, float] | None:
    """(reason, seconds) of a move whose restore completed at ``now``: ``record`` is
    status.restoredFrom of the restored incarnation, ``ckpts`` the sandbox's own.

    A move starts when its stopping Checkpoint (Preemption or Eviction) is created: the
    notice or the drain. Only a clean restore of that checkpoint ends one (staleSeconds
    0, not a fallback; retries of the same checkpoint included). None for a resume, a
    fork (the checkpoint is another sandbox's), a loss without notice, a fallback."""
    ckpt = find(ckpts, str(record.get("name") or ""))
    if ckpt is None or record.get("fallback") or int(record.get("staleSeconds") or 0) != 0:
        return None
    reason = metrics.DOWNTIME_REASON_OF.get(reason_of(ckpt))
    began = created_at(ckpt)
    if reason is None or began is None:
        return None
    return reason, max(0.0, (now - began).total_seconds())


def newest_finished(ckpts: Sequence[KubeObject]) -> KubeObject | None:
    done = [c for c in ckpts if phase_of(c) in (COMPLETED, FAILED)]
    return done[-1] if done else None


def active(ckpts: Sequence[KubeObject]) -> KubeObject | None:
    """A checkpoint being dumped or uploaded now (the newest such), or None."""
    busy = [c for c in ckpts if phase_of(c) in ACTIVE]
    return busy[-1] if busy else None


def failure_message(ckpt: KubeObject) -> str:
    message = protocol.one_line(str((ckpt.get("status") or {}).get("message") or ""), 512,
                                mark="")
    head = f"checkpoint {name_of(ckpt)} failed"
    return f"{head}: {message}" if message else head


def _pod_node(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("spec") or {}).get("nodeName") or None


def _restore_from(pod: Mapping[str, Any]) -> str | None:
    return (_meta(pod).get("annotations") or {}).get(protocol.ANNOTATION_RESTORE_FROM) or None


def taken_from(ckpt: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether ``ckpt`` could have been taken from ``pod`` (not before it, not what it restores,
    and on its node when both are known)."""
    if _restore_from(pod) == name_of(ckpt):
        return False
    ck_created, pod_created = created_at(ckpt), created_at(pod)
    if ck_created is not None and pod_created is not None and ck_created < pod_created:
        return False
    ck_node = (ckpt.get("status") or {}).get("nodeName")
    pod_node = _pod_node(pod)
    return not (ck_node and pod_node and ck_node != pod_node)


def stopping_completed(ckpts: Sequence[KubeObject], pod: Mapping[str, Any],
                       reasons: Sequence[str] = protocol.STOPPING_REASONS) -> KubeObject | None:
    """The newest Completed checkpoint with a stopping reason taken from ``pod`` (and, when
    it is labelled with an incarnation, of ``pod``'s: a checkpoint of another pod on the
    same node never ends this one), or None."""
    found = [c for c in completed(ckpts) if reason_of(c) in reasons and taken_from(c, pod)
             and incarnation_of(c) in (None, incarnation_of(pod))]
    return found[-1] if found else None


def stopping_in_flight(ckpts: Sequence[KubeObject], pod: Mapping[str, Any] | None,
                       now: datetime) -> KubeObject | None:
    """A stopping checkpoint still in flight (of ``pod`` when known) and not older than
    STOPPING_WAIT, or None: the pod's state is not final until it finishes."""
    for ckpt in reversed(ckpts):
        if phase_of(ckpt) not in IN_FLIGHT or reason_of(ckpt) not in protocol.STOPPING_REASONS:
            continue
        created = created_at(ckpt)
        if created is not None and now - created > STOPPING_WAIT:
            continue
        if pod is None or taken_from(ckpt, pod):
            return ckpt
    return None


def find(ckpts: Iterable[Mapping[str, Any]], name: str | None) -> KubeObject | None:
    """The checkpoint called ``name``, or None."""
    if not name:
        return None
    return next((dict(c) for c in ckpts if name_of(c) == name), None)


def ended(ckpt: Mapping[str, Any], incarnation: int) -> bool:
    """Whether ``ckpt`` is a stopping checkpoint of incarnation ``incarnation``: the state
    that incarnation's pod ended in, so restoring it loses nothing."""
    return reason_of(ckpt) in protocol.STOPPING_REASONS and incarnation_of(ckpt) == incarnation


def suspend_checkpoint_name(sandbox: str, incarnation: int) -> str:
    return protocol.checkpoint_name(sandbox, incarnation, protocol.SUSPEND)


def interval_checkpoint_name(sandbox: str, incarnation: int, now: datetime) -> str:
    return protocol.checkpoint_name(sandbox, incarnation, protocol.INTERVAL,
                                    str(int(now.timestamp())))


def _request(sandbox: Mapping[str, Any], incarnation: int, name: str, reason: str,
             node: str | None) -> KubeObject:
    """A Checkpoint request (status empty: Pending) of incarnation N on ``node`` (whose
    node-agent serves it), owned by the sandbox and verified by construction."""
    out = protocol.checkpoint_object(
        str(_meta(sandbox).get("name")), name, reason, incarnation,
        namespace=_meta(sandbox).get("namespace"), node=node, owner=sandbox)
    if node is not None:
        out["metadata"]["annotations"] = {protocol.ANNOTATION_NODE_VERIFIED: "true"}
    return out


def suspend_checkpoint(sandbox: Mapping[str, Any], incarnation: int,
                       node: str | None) -> KubeObject:
    """The Suspend Checkpoint the operator requests before it releases incarnation N."""
    name = suspend_checkpoint_name(str(_meta(sandbox).get("name")), incarnation)
    return _request(sandbox, incarnation, name, protocol.SUSPEND, node)


def interval_checkpoint(sandbox: Mapping[str, Any], incarnation: int, now: datetime,
                        node: str | None) -> KubeObject:
    """The routine (Interval) Checkpoint of incarnation N requested at ``now``."""
    name = interval_checkpoint_name(str(_meta(sandbox).get("name")), incarnation, now)
    return _request(sandbox, incarnation, name, protocol.INTERVAL, node)


def interval_seconds(sandbox: Mapping[str, Any]) -> int | None:
    """spec.checkpoint.intervalSeconds (at least MIN_INTERVAL_SECONDS), or None when unset."""
    value = ((sandbox.get("spec") or {}).get("checkpoint") or {}).get("intervalSeconds")
    if value is None or isinstance(value, bool):
        return None
    try:
        return max(MIN_INTERVAL_SECONDS, int(value))
    except (TypeError, ValueError):
        return None


def ready_since(pod: Mapping[str, Any]) -> datetime | None:
    """When the pod became Ready (its Ready condition), else when it started."""
    status = pod.get("status") or {}
    ready = get_condition(status.get("conditions") or [], "Ready") or {}
    since = parse_time(ready.get("lastTransitionTime")) if ready.get("status") == TRUE else None
    return since or parse_time(status.get("startTime"))


def blocking_in_flight(ckpts: Sequence[KubeObject], pod: Mapping[str, Any], now: datetime
                       ) -> KubeObject | None:
    """A checkpoint of the sandbox still in flight that a new request would queue behind:
    Pending (whoever serves it takes the current pod), or Dumping/Uploading from ``pod``;
    not older than IN_FLIGHT_LIMIT (its node-agent is gone by then)."""
    for ckpt in reversed(ckpts):
        phase = phase_of(ckpt)
        if phase not in IN_FLIGHT or (phase != PENDING and not taken_from(ckpt, pod)):
            continue
        created = created_at(ckpt)
        if created is None or now - created <= IN_FLIGHT_LIMIT:
            return ckpt
    return None


def interval_due(ckpts: Sequence[KubeObject], pod: Mapping[str, Any], interval: int,
                 now: datetime) -> bool:
    """Whether a routine checkpoint of the running, ready ``pod`` is due: nothing in flight,
    and both the newest finished checkpoint (Completed or Failed: a failure waits a whole
    interval too) and the pod's readiness are at least ``interval`` seconds old."""
    if blocking_in_flight(ckpts, pod, now) is not None:
        return False
    due = interval_due_at(ckpts, pod, interval)
    return due is not None and now >= due


def interval_due_at(ckpts: Sequence[KubeObject], pod: Mapping[str, Any], interval: int
                    ) -> datetime | None:
    """When the newest finished checkpoint and the pod's readiness are both ``interval``
    seconds old (a checkpoint in flight holds it back further: ``blocking_in_flight``);
    None when neither time is known."""
    since = [t for t in (ready_since(pod),) if t is not None]
    newest = newest_finished(ckpts)
    if newest is not None:
        since.append(finished_at(newest))
    return max(since) + timedelta(seconds=interval) if since else None


def restore_backoff(attempts: int) -> float:
    """Seconds to wait after the ``attempts``-th failed restore of the same checkpoint."""
    exponent = min(max(attempts, 1) - 1, 16)
    return float(min(RESTORE_BACKOFF_SECONDS * 2 ** exponent, RESTORE_BACKOFF_MAX_SECONDS))


def stale_seconds(ckpt: Mapping[str, Any], now: datetime) -> int:
    """Whole seconds between the checkpoint's completion and ``now`` (0 when unknown)."""
    done = finished_at(ckpt)
    return 0 if done == _EPOCH else max(0, int((now - done).total_seconds()))


def restore_record(ckpt: Mapping[str, Any], now: datetime, *, clean: bool,
                   fallback: bool = False) -> KubeObject:
    """status.restoredFrom for a new incarnation that restores ``ckpt`` at ``now``.

    ``clean``: the checkpoint is the state the previous pod ended in (staleSeconds 0)."""
    status = ckpt.get("status") or {}
    when = status.get("completedAt") or _meta(ckpt).get("creationTimestamp")
    out: KubeObject = {"name": name_of(ckpt), "reason": reason_of(ckpt) or None,
                     "checkpointTime": when or None,
                     "staleSeconds": 0 if clean else stale_seconds(ckpt, now),
                     "fallback": fallback, "formatLevel": protocol.format_level_of(ckpt)}
    return {k: v for k, v in out.items() if v is not None}


def as_checkpoint(record: Mapping[str, Any]) -> KubeObject:
    """A stand-in Checkpoint for a status record (lastCheckpoint, restoredFrom) whose object
    is gone: name, reason, completion time and format level (a restore of it still asks
    for a node that reads that level)."""
    when = record.get("checkpointTime") or record.get("time")
    status: KubeObject = {"phase": COMPLETED, "completedAt": when} if when else {}
    level = protocol.format_level_of({"status": {"formatLevel": record.get("formatLevel")}})
    if level is not None:
        status["formatLevel"] = level
    return {"metadata": {"name": record.get("name")},
            "spec": {"reason": record.get("reason")}, "status": status}


def restore_level(ckpt: Mapping[str, Any] | None, record: Mapping[str, Any]) -> int | None:
    """The format level a restore asks its node for: the Checkpoint's status.formatLevel,
    or, when its object is gone (``ckpt`` None), that of ``record`` (status.restoredFrom,
    lastCheckpoint) that kept it. None: level 1 (no requirement)."""
    return protocol.format_level_of(ckpt if ckpt is not None else as_checkpoint(record))


def fallback_for(ckpts: Sequence[KubeObject], refused: Mapping[str, Any]) -> KubeObject | None:
    """The newest Completed checkpoint that finished before ``refused`` (a checkpoint, or a
    stand-in from ``as_checkpoint``), or None. Never ``refused`` itself."""
    limit = finished_at(refused)
    if limit == _EPOCH:
        return None
    older = [c for c in completed(ckpts)
             if name_of(c) != name_of(refused) and finished_at(c) < limit]
    return older[-1] if older else None


def orphan_status(ckpt: Mapping[str, Any], now: datetime) -> KubeObject | None:
    """The status that fails a Pending Checkpoint whose AgentSandbox does not exist; None
    when the checkpoint is no longer Pending (or is being deleted)."""
    meta = _meta(ckpt)
    if meta.get("deletionTimestamp") or phase_of(ckpt) != PENDING:
        return None
    namespace = meta.get("namespace") or "default"
    return {"phase": FAILED, "completedAt": protocol.rfc3339(now),
            "message": f"AgentSandbox {sandbox_of(ckpt)} does not exist in namespace {namespace}"}


@dataclass(frozen=True)
class Where:
    """The sandbox's current incarnation and the node it runs (or ran) on, if known."""

    incarnation: int
    node: str | None


def verified(ckpt: Mapping[str, Any]) -> bool:
    """The operator once saw this checkpoint's node label match its incarnation's node."""
    annotations = _meta(ckpt).get("annotations") or {}
    return annotations.get(protocol.ANNOTATION_NODE_VERIFIED) == "true"


def unverified_fork_message(ckpt: Mapping[str, Any]) -> str:
    """Why a fork does not restore ``ckpt``: the operator never verified its node."""
    node = protocol.node_of(ckpt)
    return (f"spec.restoreFrom names Checkpoint {_meta(ckpt).get('name')}, which the operator "
            f"has not verified: its {protocol.LABEL_NODE} label "
            f"({node or 'none'}) was never seen to match the node its sandbox "
            f"{protocol.sandbox_of(ckpt) or '(none)'} ran on, so a node-agent may have forged "
            f"it; no pod is created (it is restored once it carries "
            f"{protocol.ANNOTATION_NODE_VERIFIED})")


def _node_matches(ckpt: Mapping[str, Any], where: Where) -> bool:
    return (where.node is not None and protocol.node_of(ckpt) == where.node
            and incarnation_of(ckpt) == where.incarnation)


def trusted(ckpt: Mapping[str, Any], where: Where) -> bool:
    """Whether ``ckpt`` may be restored: verified before, or checkable now (it is of the
    current incarnation, labelled with the node that incarnation runs on). A node-agent can
    only create and complete checkpoints labelled with its own node (the API server's
    policy), so this refuses a checkpoint a node forged for a sandbox it never ran."""
    return verified(ckpt) or _node_matches(ckpt, where)


def counts(ckpt: Mapping[str, Any], where: Where) -> bool:
    """Whether the operator takes ``ckpt`` into account at all (in flight, finished, due,
    restorable, retained): verified, or unlabelled (a user's request, which the operator
    binds to the current node when it adopts it), or labelled with the node the current
    incarnation runs on. Any node-agent may create Checkpoints labelled with its own node
    for any sandbox (the API server's policy cannot tell where a sandbox runs), so one
    labelled with another node, or with a node while the sandbox runs on none, is never
    the sandbox's: it neither blocks an interval request nor stands for a stopping one."""
    if verified(ckpt):
        return True
    node = protocol.node_of(ckpt)
    return node is None or (where.node is not None and node == where.node)


def mislabelled(ckpt: Mapping[str, Any], where: Where) -> bool:
    """A checkpoint the operator fails as untrusted: never verified, labelled with another
    node than the one the current incarnation runs on, and of that incarnation, a later one
    or none. No node-agent that ran the sandbox made it: each labels its requests with the
    incarnation of the pod it serves, so only an older incarnation's may legitimately name
    an older node (those are only ignored: ``counts``)."""
    node = protocol.node_of(ckpt)
    incarnation = incarnation_of(ckpt)
    return (not verified(ckpt) and where.node is not None and node is not None
            and node != where.node and (incarnation is None or incarnation >= where.incarnation))


def untrusted_status(ckpt: Mapping[str, Any], where: Where, now: datetime) -> KubeObject:
    """The status that fails a mislabelled checkpoint."""
    return {"phase": FAILED, "completedAt": protocol.rfc3339(now),
            "message": f"refused: labelled for node {protocol.node_of(ckpt)}, but incarnation "
                       f"{where.incarnation} runs on node {where.node}; it is ignored and "
                       "never restored"}


def _label_patch(ckpt: Mapping[str, Any], where: Where) -> tuple[KubeObject, KubeObject]:
    """(labels, annotations) that bind ``ckpt`` to its node: the verified mark when it can be
    checked now; for a Pending request nobody labelled (a manual one), the current node."""
    if verified(ckpt):
        return {}, {}
    mark = {protocol.ANNOTATION_NODE_VERIFIED: "true"}
    if _node_matches(ckpt, where):
        return {}, mark
    if (phase_of(ckpt) == PENDING and protocol.node_of(ckpt) is None and where.node
            and incarnation_of(ckpt) in (None, where.incarnation)):
        return {protocol.LABEL_NODE: where.node,
                protocol.LABEL_INCARNATION: str(where.incarnation)}, mark
    return {}, {}


def adoption_patches(sandbox: Mapping[str, Any], ckpts: Sequence[KubeObject],
                     where: Where | None = None) -> list[tuple[str, KubeObject]]:
    """(name, merge patch of metadata) for each checkpoint without an owner reference to the
    sandbox, without the sandbox label, or not yet bound to its node (``where``: see
    _label_patch). The patch carries the full ownerReferences list and the resourceVersion
    it was computed from, so a concurrent change makes it conflict."""
    uid = _meta(sandbox).get("uid")
    name = str(_meta(sandbox).get("name"))
    if not uid:
        return []
    out: list[tuple[str, KubeObject]] = []
    for ckpt in ckpts:
        cmeta = _meta(ckpt)
        refs = list(cmeta.get("ownerReferences") or [])
        owned = any(r.get("uid") == uid for r in refs)
        labels, annotations = _label_patch(ckpt, where) if where else ({}, {})
        if (cmeta.get("labels") or {}).get(protocol.LABEL_SANDBOX) != name:
            labels = {**labels, protocol.LABEL_SANDBOX: name}
        if owned and not labels and not annotations:
            continue
        meta: KubeObject = {"resourceVersion": cmeta.get("resourceVersion")}
        if not owned:
            ref = owner_reference(sandbox)
            if any(r.get("controller") for r in refs):
                ref["controller"] = False
            meta["ownerReferences"] = [*refs, ref]
        if labels:
            meta["labels"] = labels
        if annotations:
            meta["annotations"] = annotations
        out.append((name_of(ckpt), {"metadata": {k: v for k, v in meta.items()
                                                 if v is not None}}))
    return out


def retain_count(sandbox: Mapping[str, Any]) -> int:
    value = ((sandbox.get("spec") or {}).get("checkpoint") or {}).get("retain", DEFAULT_RETAIN)
    try:
        return max(1, int(value))
    except (TypeError, ValueError):
        return DEFAULT_RETAIN


def to_delete(ckpts: Sequence[KubeObject], retain: int, protect: Iterable[str | None] = ()
              ) -> list[str]:
    """Names of checkpoints retention removes: Completed ones beyond the newest ``retain``,
    Failed ones older than the oldest kept Completed one, and Failed ones beyond the newest
    ``retain`` Failed ones (a failing interval checkpoint would pile them up otherwise).
    In-flight checkpoints and the names in ``protect`` (the one being restored or retried,
    status.lastCheckpoint) are kept, and do not count against ``retain``."""
    keep = {p for p in protect if p}
    retain = max(1, retain)
    kept = completed(ckpts)[-retain:]
    oldest_kept = _order(kept[0]) if kept else None
    failed = [c for c in ckpts if phase_of(c) == FAILED
              and (oldest_kept is None or _order(c) >= oldest_kept)]
    kept_names = {name_of(c) for c in [*kept, *failed[-retain:]]}
    out: list[str] = []
    for ckpt in ckpts:
        name = name_of(ckpt)
        if name in keep or name in kept_names:
            continue
        if phase_of(ckpt) in (COMPLETED, FAILED):
            out.append(name)
    return out
