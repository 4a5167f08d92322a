"""A sandbox's Checkpoint objects, read by the operator: pure functions.

Which checkpoints belong to a sandbox, the newest Completed one, whether one is in
flight, which stopping checkpoint ends the current pod, which ones retention deletes
and which ones still need an owner reference. Nothing here talks to the API.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from hermit_common import api

Manifest = dict[str, Any]

PENDING: Final = "Pending"
COMPLETED: Final = "Completed"
FAILED: Final = "Failed"
IN_FLIGHT: Final = ("Pending", "Dumping", "Uploading")
ACTIVE: Final = ("Dumping", "Uploading")
MIGRATING_REASONS: Final = ("Preemption", "Eviction")
DEFAULT_RETAIN: Final = 3
# A pod that is gone while a stopping checkpoint of it is in flight is replaced only
# once that checkpoint finishes, or once it has been in flight this long.
STOPPING_WAIT: Final = timedelta(seconds=300)
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def name_of(ckpt: Mapping[str, Any]) -> str:
    return str(_meta(ckpt).get("name") or "")


def sandbox_of(ckpt: Mapping[str, Any]) -> str | None:
    """The AgentSandbox a Checkpoint is of (spec.sandboxRef.name), or None."""
    ref = ((ckpt.get("spec") or {}).get("sandboxRef") or {}).get("name")
    return str(ref) if ref else None


def phase_of(ckpt: Mapping[str, Any]) -> str:
    """status.phase; an empty status is Pending."""
    return str((ckpt.get("status") or {}).get("phase") or PENDING)


def reason_of(ckpt: Mapping[str, Any]) -> str:
    return str((ckpt.get("spec") or {}).get("reason") or "")


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 timestamp as an aware datetime; None when absent or malformed."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


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
               ) -> list[Manifest]:
    """The sandbox's checkpoints, oldest first (by completion, then creation, then name).

    A checkpoint owned by another AgentSandbox (an earlier one of the same name), or an
    unowned one created before this sandbox, is not this sandbox's; neither is one that
    is being deleted.
    """
    meta = _meta(sandbox)
    name, uid = meta.get("name"), meta.get("uid")
    born = created_at(sandbox)
    out: list[Manifest] = []
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


def completed(ckpts: Sequence[Manifest]) -> list[Manifest]:
    return [c for c in ckpts if phase_of(c) == COMPLETED]


def last_completed(ckpts: Sequence[Manifest]) -> Manifest | None:
    """The newest Completed checkpoint of an ``of_sandbox`` list."""
    done = completed(ckpts)
    return done[-1] if done else None


def last_checkpoint_status(ckpt: Manifest) -> Manifest:
    """status.lastCheckpoint of the sandbox for this Completed checkpoint."""
    out: Manifest = {"name": name_of(ckpt), "reason": reason_of(ckpt) or None}
    when = (ckpt.get("status") or {}).get("completedAt") or _meta(ckpt).get("creationTimestamp")
    out["time"] = when or None
    return {k: v for k, v in out.items() if v is not None}


def newest_finished(ckpts: Sequence[Manifest]) -> Manifest | None:
    done = [c for c in ckpts if phase_of(c) in (COMPLETED, FAILED)]
    return done[-1] if done else None


def active(ckpts: Sequence[Manifest]) -> Manifest | None:
    """A checkpoint being dumped or uploaded now (the newest such), or None."""
    busy = [c for c in ckpts if phase_of(c) in ACTIVE]
    return busy[-1] if busy else None


def failure_message(ckpt: Manifest) -> str:
    message = " ".join(str((ckpt.get("status") or {}).get("message") or "").split())[:512]
    head = f"checkpoint {name_of(ckpt)} failed"
    return f"{head}: {message}" if message else head


def _pod_node(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("spec") or {}).get("nodeName") or None


def _restore_from(pod: Mapping[str, Any]) -> str | None:
    return (_meta(pod).get("annotations") or {}).get(api.ANNOTATION_RESTORE_FROM) or None


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


def stopping_completed(ckpts: Sequence[Manifest], pod: Mapping[str, Any],
                       reasons: Sequence[str] = api.STOPPING_REASONS) -> Manifest | None:
    """The newest Completed checkpoint with a stopping reason taken from ``pod``, or None."""
    found = [c for c in completed(ckpts) if reason_of(c) in reasons and taken_from(c, pod)]
    return found[-1] if found else None


def stopping_in_flight(ckpts: Sequence[Manifest], pod: Mapping[str, Any] | None,
                       now: datetime) -> Manifest | None:
    """A stopping checkpoint still in flight (of ``pod`` when known) and not older than
    STOPPING_WAIT, or None: the pod's state is not final until it finishes."""
    for ckpt in reversed(ckpts):
        if phase_of(ckpt) not in IN_FLIGHT or reason_of(ckpt) not in api.STOPPING_REASONS:
            continue
        created = created_at(ckpt)
        if created is not None and now - created > STOPPING_WAIT:
            continue
        if pod is None or taken_from(ckpt, pod):
            return ckpt
    return None


def suspend_checkpoint_name(sandbox: str, incarnation: int) -> str:
    return f"{sandbox}-{incarnation}-suspend"[:253]


def suspend_checkpoint(sandbox: Mapping[str, Any], incarnation: int) -> Manifest:
    """The Suspend Checkpoint the operator requests before it releases incarnation N."""
    meta = _meta(sandbox)
    name = str(meta.get("name"))
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.CHECKPOINT_KIND,
        "metadata": {
            "name": suspend_checkpoint_name(name, incarnation),
            "namespace": meta.get("namespace"),
            "labels": {api.LABEL_SANDBOX: name, api.LABEL_INCARNATION: str(incarnation)},
            "ownerReferences": [owner_reference(sandbox)],
        },
        "spec": {"sandboxRef": {"name": name}, "reason": "Suspend"},
    }


def owner_reference(sandbox: Mapping[str, Any]) -> Manifest:
    meta = _meta(sandbox)
    return {"apiVersion": sandbox.get("apiVersion", api.API_VERSION),
            "kind": sandbox.get("kind", api.SANDBOX_KIND), "name": meta.get("name"),
            "uid": meta.get("uid"), "controller": True, "blockOwnerDeletion": True}


def adoption_patches(sandbox: Mapping[str, Any], ckpts: Sequence[Manifest]
                     ) -> list[tuple[str, Manifest]]:
    """(name, merge patch of metadata) for each checkpoint without an owner reference to the
    sandbox or without the sandbox label. The patch carries the full ownerReferences list and
    the resourceVersion it was computed from, so a concurrent change makes it conflict."""
    uid = _meta(sandbox).get("uid")
    name = str(_meta(sandbox).get("name"))
    if not uid:
        return []
    out: list[tuple[str, Manifest]] = []
    for ckpt in ckpts:
        cmeta = _meta(ckpt)
        refs = list(cmeta.get("ownerReferences") or [])
        owned = any(r.get("uid") == uid for r in refs)
        labelled = (cmeta.get("labels") or {}).get(api.LABEL_SANDBOX) == name
        if owned and labelled:
            continue
        meta: Manifest = {"resourceVersion": cmeta.get("resourceVersion")}
        if not owned:
            ref = owner_reference(sandbox)
            if any(r.get("controller") for r in refs):
                ref["controller"] = False
            meta["ownerReferences"] = [*refs, ref]
        if not labelled:
            meta["labels"] = {api.LABEL_SANDBOX: name}
        out.append((name_of(ckpt), {"metadata": {k: v for k, v in meta.items()
                                                 if v is not None}}))
    return out


def retain_count(sandbox: Mapping[str, Any]) -> int:
    value = ((sandbox.get("spec") or {}).get("checkpoint") or {}).get("retain", DEFAULT_RETAIN)
    try:
        return max(1, int(value))
    except (TypeError, ValueError):
        return DEFAULT_RETAIN


def to_delete(ckpts: Sequence[Manifest], retain: int, protect: Iterable[str | None] = ()
              ) -> list[str]:
    """Names of checkpoints retention removes: Completed ones beyond the newest ``retain``,
    and Failed ones older than the oldest kept Completed one. In-flight checkpoints and the
    names in ``protect`` (the one being restored, status.lastCheckpoint) are kept."""
    keep = {p for p in protect if p}
    done = completed(ckpts)
    kept = done[-retain:] if retain > 0 else []
    if not kept:
        return []
    oldest_kept = _order(kept[0])
    kept_names = {name_of(c) for c in kept}
    out: list[str] = []
    for ckpt in ckpts:
        name = name_of(ckpt)
        if name in keep or name in kept_names:
            continue
        phase = phase_of(ckpt)
        if phase == COMPLETED or (phase == FAILED and _order(ckpt) < oldest_kept):
            out.append(name)
    return out
