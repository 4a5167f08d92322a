"""Applies a reconcile plan for one AgentSandbox: read, plan (pure), write, report.

One sandbox is reconciled by one thread at a time (the sandbox handlers, the pod and
Checkpoint event handlers and the timers may fire together); the sandbox is re-read
inside the lock so every plan starts from the newest status. A plan that wants another
look later (a timed decision: an interval checkpoint, a restore retry, ...) ends in
``Requeue``, which the kopf handlers turn into a wakeup (wakeups.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from hermit_common import api, protocol
from hermit_common.errors import Retryable
from hermit_common.protocol import KubeObject
from hermit_common.settings import OperatorSettings
from hermit_operator import metrics, overlap, podspec
from hermit_operator.checkpoints import orphan_status, sandbox_of
from hermit_operator.kube import Kube, KubeError, KubeNamespaceTerminating, KubeTransient
from hermit_operator.podspec import InvalidSpec
from hermit_operator.reconcile import Event, Plan, plan, rejected_status
from hermit_operator.resync import Inputs, fingerprint_of

log = logging.getLogger("hermit.operator")

Poster = Callable[[KubeObject, Event], None]

# A sandbox's PodDisruptionBudget is created (or deleted) at most this often; in between
# the last outcome is trusted. A budget deleted by hand comes back at the sandbox's next
# reconcile after this time (at the latest a full resync: resync.FULL_EVERY).
PDB_RECHECK_SECONDS = 60.0

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()
_pdb_seen: dict[tuple[str, str], tuple[bool, float]] = {}  # -> (exists, time.monotonic())
_busy: set[tuple[str, str]] = set()  # a coalesced reconcile runs for these
_again: set[tuple[str, str]] = set()  # ... and must run once more when it ends


class Requeue(Retryable):
    """The plan was applied; reconcile the sandbox again after ``delay`` seconds (kopf's
    ``TemporaryError(delay=)``, which is no failure here: a timed decision is due)."""

    def __init__(self, message: str, delay: float) -> None:
        super().__init__(message)
        self.delay = delay


def _lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def forget(namespace: str, name: str) -> None:
    """Drop the lock (and the phase count) of a deleted sandbox."""
    metrics.PHASES.forget(namespace, name)
    with _locks_guard:
        _locks.pop((namespace, name), None)
        _pdb_seen.pop((namespace, name), None)


def coalesced(key: tuple[str, str], run: Callable[[], None]) -> bool:
    """``run()`` for a sandbox, unless one runs for it already: that one then runs once more
    when it ends (it may have read the objects before the change that called for this
    one). A burst of events costs one or two reconciles and never blocks a thread on the
    sandbox's lock. ``run`` must not raise. False when it was left to the running one."""
    with _locks_guard:
        if key in _busy:
            _again.add(key)
            return False
        _busy.add(key)
    try:
        while True:
            run()
            with _locks_guard:
                if key not in _again:
                    return True
                _again.discard(key)
    finally:
        with _locks_guard:
            _busy.discard(key)
            _again.discard(key)


def checkpoint_sandbox(ckpt: KubeObject) -> str | None:
    """The name of the AgentSandbox a Checkpoint is of (spec.sandboxRef.name), or None."""
    return sandbox_of(ckpt)


def owner_sandbox(pod: KubeObject) -> str | None:
    """The name of the AgentSandbox that controls this pod, or None."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if (ref.get("controller") and ref.get("kind") == api.SANDBOX_KIND
                and str(ref.get("apiVersion", "")).startswith(f"{api.GROUP}/")):
            return str(ref.get("name"))
    return None


def reconcile_sandbox(kube: Kube, settings: OperatorSettings, namespace: str, name: str,
                      post: Poster, now: Callable[[], datetime] | None = None,
                      inputs: Inputs | None = None) -> Plan | None:
    """Reconcile one sandbox; None when it no longer exists or is being deleted.

    Raises InvalidSpec after recording it in the status, KubeTransient for retries, and
    Requeue (after applying the plan) when the plan asks to be looked at again later.
    ``inputs``: where the fingerprint of what a successful reconcile read is recorded
    (resync.py: the resync skips the sandbox while it holds).
    """
    started = time.monotonic()
    result = "transient"
    try:
        with _lock(namespace, name):
            sandbox = kube.get_sandbox(namespace, name)
            if sandbox is None or (sandbox.get("metadata") or {}).get("deletionTimestamp"):
                # Gone or going (a foreground delete, a finalizer): its pods go with it, so
                # it gets no new one; those held have nothing to save.
                _cut_holds(kube, namespace, name, sandbox)
                result = "ok"
                return None
            pod_name = (sandbox.get("status") or {}).get("podName")
            pod = kube.get_pod(namespace, pod_name) if pod_name else None
            if pod is not None and podspec.held(pod) and _namespace_going(kube, namespace):
                # The namespace controller deleted the pod before its AgentSandbox: no
                # Checkpoint can be created there, the sandbox goes with the namespace.
                _cut_holds(kube, namespace, name, sandbox, namespace_terminating=True)
                result = "ok"
                return None
            ckpts = kube.list_checkpoints(namespace)
            spare = overlap.replacement_name(sandbox, ckpts)
            replacement = kube.get_pod(namespace, spare) if spare else None
            moment = (now or (lambda: datetime.now(UTC)))()
            p = plan(sandbox, pod, moment, settings=settings, checkpoints=ckpts,
                     replacement=replacement)
            try:
                _apply(kube, sandbox, p, post, moment)
            except KubeNamespaceTerminating as exc:
                # Its namespace is being deleted and it with it (the namespace controller
                # may delete pods long before AgentSandboxes): nothing can be saved, as no
                # Checkpoint can be created there either, so held pods go now.
                log.info("AgentSandbox %s/%s: %s; its namespace is being deleted",
                         namespace, name, exc)
                _cut_holds(kube, namespace, name, sandbox, namespace_terminating=True)
                result = "ok"
                return None
            if inputs is not None:
                inputs.record(namespace, name, fingerprint_of(sandbox, pod, ckpts),
                              time.monotonic())
            if p.invalid_spec is not None:
                result = "invalid"
                raise InvalidSpec(p.invalid_spec)
            result = "ok"
            if p.requeue_after is not None:
                raise Requeue(f"AgentSandbox {namespace}/{name}: a timed decision is due in "
                              f"{p.requeue_after:.0f}s", p.requeue_after)
            return p
    except InvalidSpec:
        result = "invalid"
        raise
    except KubeTransient:
        result = "transient"
        raise
    finally:
        metrics.RECONCILES.labels(result=result).inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


def _namespace_going(kube: Kube, namespace: str) -> bool:
    """Whether ``namespace`` is being deleted; False when that cannot be read (the hold
    then runs its course, as before)."""
    try:
        return kube.namespace_terminating(namespace)
    except KubeError as exc:
        log.info("cannot tell whether namespace %s is being deleted: %s", namespace, exc)
        return False


def _cut_holds(kube: Kube, namespace: str, name: str, sandbox: KubeObject | None, *,
               namespace_terminating: bool = False) -> None:
    """The AgentSandbox is gone or going (or its namespace is): its pods being deleted have
    nothing to save, so their termination holds end now (podspec.hold_to_cut) instead of
    after their grace period. Their pod events bring the sandbox's name here."""
    for pod in kube.list_sandbox_pods(namespace, name):
        if podspec.hold_to_cut(pod, sandbox, namespace_terminating=namespace_terminating):
            meta = pod["metadata"]
            log.info("pod %s/%s: its AgentSandbox %s or its namespace is gone or being "
                     "deleted; nothing to save: removing it now", namespace, meta["name"],
                     name)
            kube.delete_pod(namespace, meta["name"], 0, uid=meta.get("uid"))


def reconcile_checkpoint(kube: Kube, settings: OperatorSettings, ckpt: KubeObject, post: Poster,
                         *, deleted: bool = False, now: Callable[[], datetime] | None = None,
                         inputs: Inputs | None = None) -> Plan | None:
    """Reconcile the sandbox a Checkpoint is of. When that AgentSandbox does not exist, a
    Pending Checkpoint is failed (status written by the operator, with a Warning Event):
    no node-agent would ever take it."""
    sandbox = sandbox_of(ckpt)
    meta = ckpt.get("metadata") or {}
    namespace = meta.get("namespace")
    if sandbox is None or namespace is None:
        return None
    p = reconcile_sandbox(kube, settings, namespace, sandbox, post, now, inputs)
    if p is not None or deleted:
        return p
    status = orphan_status(ckpt, (now or (lambda: datetime.now(UTC)))())
    # Read again only for a Pending one: an AgentSandbox being deleted also plans nothing,
    # and its Checkpoints go with it.
    if status is not None and kube.get_sandbox(namespace, sandbox) is None:
        kube.patch_checkpoint_status(namespace, str(meta.get("name")), status)
        post(ckpt, Event("Warning", api.REASON_SANDBOX_NOT_FOUND, status["message"]))
    return None


def _apply_pdb(kube: Kube, sandbox: KubeObject, p: Plan) -> None:
    """Create or delete the sandbox's PodDisruptionBudget, at most every PDB_RECHECK_SECONDS."""
    meta = sandbox["metadata"]
    key = (meta["namespace"], meta["name"])
    if p.pdb is None and p.delete_pdb is None:
        return
    want = p.pdb is not None
    seen = _pdb_seen.get(key)
    if seen is not None and seen[0] == want and time.monotonic() - seen[1] < PDB_RECHECK_SECONDS:
        return
    if p.pdb is not None:
        kube.ensure_pdb(p.pdb)
    elif p.delete_pdb is not None:
        kube.delete_pdb(meta["namespace"], p.delete_pdb, meta.get("uid"))
    _pdb_seen[key] = (want, time.monotonic())


def merged(current: Any, patch: Any) -> Any:
    """``current`` after a JSON merge patch (RFC 7386): None removes, objects merge."""
    if not isinstance(patch, dict):
        return patch
    out = dict(current) if isinstance(current, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merged(out.get(key), value)
    return out


def status_changes(sandbox: KubeObject, patch: KubeObject) -> bool:
    """Whether the status patch would change anything: unchanged ones are not sent, so an
    idle sandbox costs the API server nothing on a resync."""
    current = sandbox.get("status") or {}
    return bool(merged(current, patch) != current)


def _apply(kube: Kube, sandbox: KubeObject, p: Plan, post: Poster, now: datetime) -> None:
    meta = sandbox["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    _apply_pdb(kube, sandbox, p)  # first: the new pod is never without its budget
    # The operator deletes a pod only when its tree has nothing left to save (moved,
    # suspended, a failed restore, an unwanted replacement): with the short grace period
    # of a pod without the termination hold. An evicted pod whose stopping checkpoint is
    # durable (its tree ended by the node-agent) is removed at once: the kubelet does not
    # end a preStop sleep early (docs/protocol.md "Evictions").
    if p.delete_pod is not None:
        kube.delete_pod(namespace, p.delete_pod,
                        0 if p.release_pod else podspec.TERMINATION_GRACE_SECONDS)
    if p.delete_replacement is not None:
        kube.delete_pod(namespace, p.delete_replacement, podspec.TERMINATION_GRACE_SECONDS)
    if p.create_pod is not None:
        try:
            kube.create_pod(p.create_pod)
        except InvalidSpec as exc:
            # The API rejected the pod: record it like any other invalid spec.
            kube.patch_sandbox_status(namespace, name, rejected_status(sandbox, p, str(exc), now))
            post(sandbox, Event("Warning", api.REASON_INVALID_SPEC, str(exc)))
            raise
        annotations = p.create_pod["metadata"].get("annotations") or {}
        restore = protocol.ANNOTATION_RESTORE_FROM in annotations
        metrics.PODS_CREATED.labels(mode="restore" if restore else "fresh").inc()
        if p.work_lost is not None:
            metrics.WORK_LOST.observe(p.work_lost)
    if p.create_checkpoint is not None:
        kube.create_checkpoint(p.create_checkpoint)
    if status_changes(sandbox, p.status_patch):
        kube.patch_sandbox_status(namespace, name, p.status_patch)
    metrics.PHASES.set(namespace, name, p.status_patch.get("phase"))
    if p.downtime is not None:  # after the patch that ends the move: observed once
        metrics.observe_downtime(*p.downtime)
    for event in p.events:
        post(sandbox, event)
    for ckpt, patch in p.adopt_checkpoints:
        kube.patch_checkpoint(namespace, ckpt, patch)
    for ckpt, ckpt_status in p.fail_checkpoints:
        kube.patch_checkpoint_status(namespace, ckpt, ckpt_status)
    for ckpt in p.delete_checkpoints:
        # Kubernetes objects only: the node-agent collects the S3 side (the manifest, and
        # chunks no manifest references) after the sandbox's next routine checkpoint
        # (hermit_node.control.collect; docs/storage.md#garbage-collection).
        kube.delete_checkpoint(namespace, ckpt)
        metrics.CHECKPOINTS_DELETED.inc()
