"""A move's replacement pod, created while the old pod is being checkpointed: pure.

With ``OperatorSettings.overlap_moves`` (the chart's ``operator.overlapMoves``, on by
default), the operator does not wait for a ``Preemption``/``Eviction`` Checkpoint of the
current pod (incarnation N) to be ``Completed`` before it creates incarnation N+1: it
creates that pod as soon as it sees the checkpoint in flight, annotated to restore from
it, so the scheduler (and a cluster autoscaler or Karpenter behind it) finds a node while
the checkpoint is taken. The pod's ``hermit-init --restore`` waits, the node-agent on its
node starts the restore only once the checkpoint is ``Completed``; until then the status
still names pod N (incarnation N), which the node-agent freezes and, once the checkpoint
is durable, ends as before. When the checkpoint is ``Completed`` the operator deletes
pod N and adopts the waiting pod as incarnation N+1 (reconcile._create); when it fails,
or anything else is decided, the waiting pod is deleted (reconcile._finish) and the
sandbox goes on as it would have without it.

The waiting pod is never named in the status: it is found by its name (the pod of
incarnation N+1), which the driver reads whenever a migrating checkpoint of the current
incarnation exists, so an operator that restarts mid-move finds it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hermit_common import api, protocol
from hermit_common.protocol import KubeObject
from hermit_operator import checkpoints as ck
from hermit_operator import podspec


def replacement_name(sandbox: Mapping[str, Any], checkpoints: Iterable[Mapping[str, Any]]
                     ) -> str | None:
    """The name of pod N+1 when a migrating (Preemption/Eviction) checkpoint of the current
    incarnation N exists, in any phase: the only time a replacement may wait. None: there
    is nothing to look for (the driver saves itself the read)."""
    incarnation = int((sandbox.get("status") or {}).get("incarnation") or 0)
    if incarnation <= 0:
        return None
    for ckpt in ck.of_sandbox(sandbox, checkpoints):
        if ck.reason_of(ckpt) in protocol.MIGRATING_REASONS and \
                ck.incarnation_of(ckpt) == incarnation:
            name = str((sandbox.get("metadata") or {}).get("name"))
            return podspec.pod_name(name, incarnation + 1)
    return None


def replacement_of(sandbox: Mapping[str, Any], pod: Mapping[str, Any] | None
                   ) -> KubeObject | None:
    """``pod`` when it is this sandbox's pod of incarnation N+1 (its label and controller
    owner say so), else None."""
    if pod is None:
        return None
    meta = sandbox.get("metadata") or {}
    incarnation = int((sandbox.get("status") or {}).get("incarnation") or 0)
    pmeta = pod.get("metadata") or {}
    owners = [o.get("uid") for o in pmeta.get("ownerReferences") or [] if o.get("controller")]
    labels = pmeta.get("labels") or {}
    if (labels.get(protocol.LABEL_SANDBOX) != meta.get("name") or meta.get("uid") not in owners
            or protocol.incarnation_of(pod) != incarnation + 1):
        return None
    return dict(pod)


def source_of(pod: Mapping[str, Any]) -> str | None:
    """The Checkpoint a pod restores (its hermit.dev/restore-from annotation)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    value = annotations.get(protocol.ANNOTATION_RESTORE_FROM)
    return str(value) if value else None


def terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def waiting_for(pod: Mapping[str, Any], checkpoint: str) -> bool:
    """Whether the replacement still waits, usable, for ``checkpoint``: it restores that
    checkpoint, is not being deleted, has not ended and has no failed restore."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    phase = (pod.get("status") or {}).get("phase")
    return (source_of(pod) == checkpoint and not terminating(pod)
            and phase not in api.POD_ENDED
            and annotations.get(protocol.ANNOTATION_RESTORE_PHASE) != protocol.RESTORE_FAILED)


def adoptable(pod: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether the replacement can be the new incarnation the plan would create as
    ``wanted``: it restores the same checkpoint, asks for the same capacity and the same
    checkpoint format of its node (one created before the node-agent recorded the format,
    by an older operator, could be on a node that cannot read it), and is not being
    deleted. A failed or ended one is adopted too: its failure is then handled as any
    restore pod's (a retry with backoff, or a fallback), which keeps the count."""
    return (not terminating(pod) and source_of(pod) == source_of(wanted)
            and source_of(wanted) is not None
            and podspec.capacity_of(dict(pod)) == podspec.capacity_of(dict(wanted))
            and podspec.required_format_level(dict(pod))
            == podspec.required_format_level(dict(wanted)))
