"""What should change for one AgentSandbox, given its current pod: a pure function.

``plan()`` reads the sandbox, its current pod (None when there is none) and the
Checkpoints of its namespace, and returns a ``Plan``: a pod to create, a pod to
delete, Checkpoints to create, adopt or delete, the sandbox's PodDisruptionBudget, the
status to patch, the Events to emit and when to look again. The caller (driver.py)
applies it; nothing here talks to the API. The decisions do not write conditions: each
plan ends in a situation (situations.py: what it saw and decided), and ``_finish``
computes every condition from that once, one function per condition type.

The checkpoint/restore protocol (docs/protocol.md), seen from the operator:
- the newest Completed Checkpoint becomes status.lastCheckpoint; Dumping/Uploading
  ones make Checkpointing=True, a Failed one CheckpointFailed plus a Warning;
- a Completed Preemption/Eviction (or Suspend) Checkpoint taken from the current pod
  ends it: the pod is deleted and incarnation N+1 restores that checkpoint
  (Migrating=True, Restoring=True); with spec.suspend the pod is only released;
- a pod lost without such a checkpoint is replaced from status.lastCheckpoint (a
  Warning says how much work was lost) or, with none, from scratch; status.restoredFrom
  says what the current incarnation restored and how stale it was;
- spec.suspend on a live pod first requests a Suspend Checkpoint, then releases it;
- spec.checkpoint.intervalSeconds requests an Interval Checkpoint of a ready pod once
  the newest checkpoint is that old;
- the restore pod's hermit.dev/restore-phase annotation ends Restoring: Restored
  counts one restore (only while Restoring is True, so once per incarnation); Failed
  retries the same checkpoint with a backoff when hermit.dev/restore-retryable is not
  "false", else (or after MAX_RESTORE_ATTEMPTS) falls back to the previous checkpoint,
  or to a fresh start when there is none;
- spec.restoreFrom (a fork) waits for its Checkpoint to exist and complete, and restores
  it only once the operator has verified where it came from (hermit.dev/node-verified).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Final

from hermit_common import api, display, protocol
from hermit_common.protocol import KubeObject
from hermit_common.settings import OperatorSettings
from hermit_operator import checkpoints as ck
from hermit_operator import overlap, placement, podspec
from hermit_operator import situations as sit
from hermit_operator.conditions import (
    FALSE,
    TRUE,
    Condition,
    derive_phase,
    get_condition,
    is_true,
)

NORMAL = "Normal"
WARNING = "Warning"

# A Failed pod with one of these reasons (or a DisruptionTarget condition) was taken
# away from a live sandbox; it is replaced, not reported as the sandbox failing.
LOST_POD_REASONS = frozenset({"Evicted", "Preempting", "NodeShutdown", "Terminated", "NodeLost",
                              "Shutdown", "UnexpectedAdmissionError"})
# The kubelet's admission refused a pod the scheduler had bound (phase Failed, its message
# "Pod was rejected: ..."): the two saw the node differently for a moment (a label just
# changed, another pod took the resources). Nothing ran, so a new pod is the remedy, as a
# ReplicaSet would make one; a sandbox must not end Failed because of it.
REJECTED_POD_REASONS = frozenset({"NodeAffinity", "NodeName", "NodePorts", "InvalidNodeInfo",
                                  "TopologyAffinityError"})
REJECTED_POD_MESSAGE = "Pod was rejected"
_RETRY_FIELDS: Final = ("restoreAttempts", "nextRestoreAt")
# A fork whose checkpoint is missing or in flight is looked at again this often.
FORK_RECHECK_SECONDS: Final = 5.0


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    create_pod: KubeObject | None = None
    delete_pod: str | None = None
    # A move's replacement pod (overlap.py) that is no longer wanted: deleted as well.
    delete_replacement: str | None = None
    status_patch: KubeObject = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    invalid_spec: str | None = None  # set: the spec cannot be run (a permanent error)
    create_checkpoint: KubeObject | None = None
    adopt_checkpoints: tuple[tuple[str, KubeObject], ...] = ()  # (name, metadata merge patch)
    delete_checkpoints: tuple[str, ...] = ()
    fail_checkpoints: tuple[tuple[str, KubeObject], ...] = ()  # (name, status): refused ones
    pdb: KubeObject | None = None  # the sandbox's PodDisruptionBudget (created when missing)
    delete_pdb: str | None = None  # a PodDisruptionBudget the sandbox must not have
    # Seconds until a decision that depends on the time changes (an interval checkpoint,
    # a restore retry, the on-demand fallback, a wait for a stopping checkpoint, a fork
    # waiting for its checkpoint): reconcile again then (wakeups.py).
    requeue_after: float | None = None
    # (reason, seconds) of a move that ended in this plan: observed by the driver once the
    # status patch (Restoring=False) is written, so a retried plan does not count it again.
    downtime: tuple[str, float] | None = None
    # Seconds of work a restore of an older checkpoint drops (its WorkLost Event): observed
    # by the driver once the pod that restores it is created.
    work_lost: float | None = None
    # delete_pod is being deleted already (evicted) and its stopping checkpoint is durable:
    # its object is removed at once (grace 0), ending the termination hold's sleep for
    # everyone waiting on it (docs/protocol.md "Evictions").
    release_pod: bool = False


@dataclass
class _State:
    """What one plan reads and builds. The conditions are not written here: the plan ends
    in a situation (situations.py), and _finish computes every condition from it once."""

    before: list[Condition]  # the conditions as read
    generation: int | None
    now: datetime
    sandbox: KubeObject = field(default_factory=dict)
    settings: OperatorSettings = field(default_factory=OperatorSettings)
    events: list[Event] = field(default_factory=list)
    ckpts: list[KubeObject] = field(default_factory=list)  # the sandbox's, oldest first
    namespace_ckpts: Sequence[KubeObject] = ()  # every Checkpoint of the namespace
    retain: int = ck.DEFAULT_RETAIN
    protect: set[str] = field(default_factory=set)  # checkpoints retention must keep
    adopt: tuple[tuple[str, KubeObject], ...] = ()
    fail: tuple[tuple[str, KubeObject], ...] = ()
    # Mislabelled checkpoints already failed (oldest first): ignored; retention keeps the
    # newest ``retain`` of them as evidence and deletes the rest, so a node cannot pile them up.
    refused: list[str] = field(default_factory=list)
    create_checkpoint: KubeObject | None = None
    pdb: KubeObject | None = None
    delete_pdb: str | None = None
    requeue_after: float | None = None
    downtime: tuple[str, float] | None = None
    work_lost: float | None = None
    replacement: KubeObject | None = None  # pod N+1, created while its checkpoint is taken
    keep_replacement: bool = False  # this plan waits for it or adopts it (else: deleted)
    early_pod: KubeObject | None = None  # the replacement this plan creates (overlap)
    release_pod: bool = False  # Plan.release_pod

    @property
    def status(self) -> KubeObject:
        """The sandbox's status as read (before this plan)."""
        return self.sandbox.get("status") or {}

    @property
    def name(self) -> str:
        return str((self.sandbox.get("metadata") or {}).get("name"))


@dataclass(frozen=True)
class _Restore:
    """What a new incarnation restores, how status.restoredFrom records it and the Event."""

    name: str
    record: KubeObject
    event: Event
    reason: str = api.REASON_RESTORE_STARTED  # of the Restoring condition
    message: str | None = None  # of the Restoring condition; a default names the pod


@dataclass(frozen=True)
class _Failure:
    """A restore that did not work: the node-agent said Failed, or the pod ended first."""

    pod: str
    source: str
    detail: str
    retryable: bool
def pod_is_ready(pod: KubeObject) -> bool:
    """Running, with the Ready condition True (or, without conditions, every container ready)."""
    status = pod.get("status") or {}
    if status.get("phase") != api.POD_RUNNING:
        return False
    ready = get_condition(status.get("conditions") or [], "Ready")
    if ready is not None:
        return bool(ready.get("status") == TRUE)
    statuses = status.get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)


def pod_is_lost(pod: KubeObject) -> bool:
    """The pod failed because it was evicted, preempted or disrupted, not by its command."""
    status = pod.get("status") or {}
    if status.get("phase") != api.POD_FAILED:
        return False
    if status.get("reason") in LOST_POD_REASONS or pod_was_rejected(pod):
        return True
    return is_true(status.get("conditions") or [], "DisruptionTarget")


def pod_was_rejected(pod: KubeObject) -> bool:
    """The kubelet refused the bound pod at admission (a stale view of its node), before
    any container ran."""
    status = pod.get("status") or {}
    reason = str(status.get("reason") or "")
    return (status.get("phase") == api.POD_FAILED
            and (reason in REJECTED_POD_REASONS or reason.startswith("OutOf"))
            and str(status.get("message") or "").startswith(REJECTED_POD_MESSAGE)
            and not any((cs.get("state") or {}).get("running") or
                        (cs.get("state") or {}).get("terminated") or cs.get("lastState")
                        for cs in status.get("containerStatuses") or []))


def container_message(pod: KubeObject) -> str:
    """One line about the first container that is waiting or terminated, or the pod's message."""
    status = pod.get("status") or {}
    for cs in [*(status.get("initContainerStatuses") or []),
               *(status.get("containerStatuses") or [])]:
        state = cs.get("state") or {}
        name = cs.get("name", "?")
        term = state.get("terminated")
        if term and (term.get("exitCode") or 0) != 0:
            return _join(f"container {name} exited with code {term.get('exitCode')}",
                         term.get("reason"), term.get("message"))
        waiting = state.get("waiting")
        if waiting and waiting.get("reason") not in (None, "PodInitializing", "ContainerCreating"):
            return _join(f"container {name} is waiting", waiting.get("reason"),
                         waiting.get("message"))
    return _join(f"pod is {status.get('phase', api.POD_PENDING)}", status.get("reason"),
                 status.get("message"))


def _join(head: str, reason: str | None, message: str | None) -> str:
    parts = [head + (f" ({reason})" if reason else "")]
    if message:
        parts.append(protocol.one_line(str(message), 512, mark=""))
    return ": ".join(parts)



def plan(sandbox: KubeObject, pod: KubeObject | None, now: datetime, *,
         settings: OperatorSettings, checkpoints: Sequence[KubeObject] = (),
         replacement: KubeObject | None = None) -> Plan:
    """Decide what to do for ``sandbox`` whose current pod is ``pod`` (None: none exists).

    ``checkpoints`` are the Checkpoint objects of the sandbox's namespace (a fork's source
    may be another sandbox's; only the sandbox's own are tracked and retained).
    ``replacement``: the pod of the next incarnation when it exists (overlap.py).
    """
    meta = sandbox.get("metadata") or {}
    spec = sandbox.get("spec") or {}
    status = sandbox.get("status") or {}
    st = _State(list(status.get("conditions") or []), meta.get("generation"), now,
                sandbox=sandbox, settings=settings, namespace_ckpts=checkpoints,
                replacement=overlap.replacement_of(sandbox, replacement))
    incarnation = int(status.get("incarnation") or 0)
    out: KubeObject = {"observedGeneration": st.generation, "incarnation": incarnation,
                     "restores": int(status.get("restores") or 0)}

    try:
        podspec.validate(sandbox, settings.pod_policy)
    except podspec.InvalidSpec as exc:
        if not _was(status, api.COND_ACCEPTED, FALSE):
            st.events.append(Event(WARNING, api.REASON_INVALID_SPEC, str(exc)))
        return _finish(st, out, pod, sit.SpecInvalid(str(exc)), invalid_spec=str(exc))
    _accept(st, out, pod)
    if spec.get("suspend"):
        return _suspend(st, out, pod, incarnation)
    return _run(st, out, pod, incarnation)


def _accept(st: _State, out: KubeObject, pod: KubeObject | None) -> None:
    """A valid spec: its disruption budget, its checkpoints tracked."""
    sandbox = st.sandbox
    st.pdb = (podspec.disruption_budget(sandbox)
              if podspec.wants_disruption_budget(sandbox, st.settings, pod) else None)
    st.delete_pdb = None if st.pdb is not None else podspec.pdb_name(st.name)
    where = _where(st, pod)
    st.ckpts = _trusted(st, ck.of_sandbox(sandbox, st.namespace_ckpts), where)
    st.retain = ck.retain_count(sandbox)
    st.adopt = tuple(ck.adoption_patches(sandbox, st.ckpts, where))
    _protect_restore_sources(st, pod)
    _track_checkpoints(st, out, sandbox.get("status") or {})


def _where(st: _State, pod: KubeObject | None) -> ck.Where:
    """The current incarnation and its node (status.nodeName, or the current pod's)."""
    incarnation = int(st.status.get("incarnation") or 0)
    node = st.status.get("nodeName")
    if not node and pod is not None and protocol.incarnation_of(pod) == incarnation:
        node = (pod.get("spec") or {}).get("nodeName")
    return ck.Where(incarnation, str(node) if node else None)


def _trusted(st: _State, ckpts: list[KubeObject], where: ck.Where) -> list[KubeObject]:
    """The sandbox's checkpoints the operator takes into account (ck.counts), without the
    Completed ones it must never restore (ck.trusted); a mislabelled one is failed, with a
    Warning (once: a Failed one is only ignored)."""
    keep = []
    for ckpt in ckpts:
        if ck.mislabelled(ckpt, where):
            if ck.phase_of(ckpt) != ck.FAILED:
                status = ck.untrusted_status(ckpt, where, st.now)
                st.fail = (*st.fail, (ck.name_of(ckpt), status))
                st.events.append(Event(WARNING, api.REASON_CHECKPOINT_UNTRUSTED,
                                       f"checkpoint {ck.name_of(ckpt)} {status['message']}"))
            else:
                st.refused.append(ck.name_of(ckpt))
            continue
        if not ck.counts(ckpt, where):
            continue
        if ck.phase_of(ckpt) != ck.COMPLETED or ck.trusted(ckpt, where):
            keep.append(ckpt)
    return keep


def _run(st: _State, out: KubeObject, pod: KubeObject | None, incarnation: int) -> Plan:
    """Not suspended: start, watch, move or replace the sandbox's pod."""
    resuming = _was(st.status, api.COND_SUSPENDED, TRUE)
    terminal = is_true(st.before, api.COND_SUCCEEDED) or is_true(st.before, api.COND_FAILED)
    if pod is None:
        return _without_pod(st, out, incarnation, resuming, terminal)
    pod_name = pod["metadata"]["name"]
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        stop = None if terminal else ck.stopping_completed(st.ckpts, pod)
        if stop is not None:
            # Evicted (a drain, an autoscaler): its preStop hook held it while this
            # checkpoint was taken. A move like any other, whoever deleted the pod; its
            # frozen tree was ended once the checkpoint was durable, so its object goes.
            st.release_pod = True
            return _migrate(st, out, incarnation, pod, stop)
        flight = ck.stopping_in_flight(st.ckpts, pod, st.now)
        if flight is not None:
            _overlap(st, incarnation, flight)
        return _finish(st, out, pod, sit.PodTerminating(pod_name))
    if terminal:
        return _observe(st, out, pod)
    stopped = _stopping(st, out, incarnation, pod)
    if stopped is not None:
        return stopped
    if pod_was_rejected(pod):
        return _rejected(st, out, incarnation, pod)
    if pod_is_lost(pod):
        st.events.append(Event(WARNING, api.REASON_POD_LOST,
                               f"pod {pod_name} was lost: {container_message(pod)}"))
        return _replace(st, out, incarnation, lost=pod_name, delete=pod_name)
    failure = _restore_failure(st, out, pod)
    if failure is not None:
        return _restore_failed(st, out, incarnation, failure)
    waiting = placement.unplaced(st.sandbox, pod)
    if waiting is not None and waiting.due(st.now):
        return _to_on_demand(st, out, incarnation, pod, waiting)
    return _observe(st, out, pod, waiting)


def _wake_at(st: _State, at: datetime | None) -> None:
    """Look again at ``at``, when a decision that depends on the time changes (the earliest
    such moment of the plan wins); a moment not after ``now`` was decided by this plan."""
    if at is None or at <= st.now:
        return
    seconds = (at - st.now).total_seconds()
    st.requeue_after = seconds if st.requeue_after is None else min(st.requeue_after, seconds)


def _protect_restore_sources(st: _State, pod: KubeObject | None) -> None:
    """While a restore is under way (or waits for a retry) retention keeps its checkpoint."""
    if not is_true(st.before, api.COND_RESTORING):
        return
    for name in (_restore_source(pod), (st.status.get("restoredFrom") or {}).get("name")):
        if name:
            st.protect.add(str(name))


def _stopping(st: _State, out: KubeObject, incarnation: int, pod: KubeObject) -> Plan | None:
    """A stopping checkpoint of the live pod: move when it is durable; when the pod has
    stopped under one still in flight, wait for it. None: no stopping checkpoint matters."""
    stop = ck.stopping_completed(st.ckpts, pod)
    if stop is not None:
        return _migrate(st, out, incarnation, pod, stop)
    flight = ck.stopping_in_flight(st.ckpts, pod, st.now)
    if flight is not None:
        _overlap(st, incarnation, flight)
    if flight is not None and (pod.get("status") or {}).get("phase") in api.POD_ENDED:
        # The node-agent ended the tree under its checkpoint: not the sandbox's outcome.
        return _wait_for(st, out, flight, f"pod {pod['metadata']['name']} has stopped")
    return None


def _without_pod(st: _State, out: KubeObject, incarnation: int, resuming: bool,
                 terminal: bool) -> Plan:
    """No current pod: wait for a stopping checkpoint or a restore retry, else replace it."""
    if terminal:
        return _finish(st, out, None, sit.Finished())
    gone = st.status.get("podName")
    flight = ck.stopping_in_flight(st.ckpts, None, st.now)
    if flight is not None and gone:
        _overlap(st, incarnation, flight)
        return _wait_for(st, out, flight, f"pod {gone} is gone")
    if st.status.get("nextRestoreAt") and not resuming:
        return _retry_restore(st, out, incarnation)
    if gone and not resuming:
        st.events.append(Event(WARNING, api.REASON_POD_LOST, f"pod {gone} is gone"))
    return _replace(st, out, incarnation, lost=None if resuming else gone, delete=None,
                    resuming=resuming)


def _track_checkpoints(st: _State, out: KubeObject, status: KubeObject) -> None:
    """status.lastCheckpoint from the sandbox's checkpoints; Events for the newly completed
    one and for a failure (the Checkpointing condition follows from them: situations.py)."""
    last = ck.last_completed(st.ckpts)
    if last is not None:
        record = ck.last_checkpoint_status(last)
        if (status.get("lastCheckpoint") or {}).get("name") != record["name"]:
            st.events.append(Event(NORMAL, api.REASON_CHECKPOINT_COMPLETED,
                                   f"checkpoint {record['name']} ({record.get('reason')}) "
                                   "is complete"))
        out["lastCheckpoint"] = record
    if ck.active(st.ckpts) is not None:
        return
    done = ck.newest_finished(st.ckpts)
    if done is not None and ck.phase_of(done) != ck.COMPLETED:
        message = ck.failure_message(done)
        before = get_condition(status.get("conditions") or [], api.COND_CHECKPOINTING) or {}
        if before.get("message") != message:
            st.events.append(Event(WARNING, api.REASON_CHECKPOINT_FAILED, message))




def _suspend(st: _State, out: KubeObject, pod: KubeObject | None, incarnation: int) -> Plan:
    """spec.suspend: checkpoint a live pod first (a Suspend Checkpoint), then release it."""
    _drop(out, st.status, *_RETRY_FIELDS)  # resuming starts the restores afresh
    name = (pod.get("metadata") or {}).get("name") if pod else None
    live = (pod is not None and not (pod.get("metadata") or {}).get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase") == api.POD_RUNNING
            and not is_true(st.before, api.COND_RESTORING))
    suspended = ck.stopping_completed(st.ckpts, pod, (protocol.SUSPEND,)) if pod else None
    if pod is not None and live and suspended is None:
        wanted = ck.suspend_checkpoint_name(st.name, incarnation)
        request = next((c for c in st.ckpts if ck.name_of(c) == wanted), None)
        if request is None or ck.phase_of(request) in ck.IN_FLIGHT:
            if request is None:
                st.create_checkpoint = ck.suspend_checkpoint(
                    st.sandbox, incarnation, (pod.get("spec") or {}).get("nodeName"))
                st.events.append(Event(NORMAL, api.REASON_SUSPEND_REQUESTED,
                                       f"checkpointing pod {name} before it is released"))
            out.update(podName=name, nodeName=(pod.get("spec") or {}).get("nodeName"))
            return _finish(st, out, pod, sit.Suspending(wanted, name))
        if ck.phase_of(request) == ck.FAILED:
            last = (out.get("lastCheckpoint") or {}).get("name")
            st.events.append(Event(WARNING, api.REASON_CHECKPOINT_FAILED,
                                   f"{ck.failure_message(request)}; releasing pod {name} "
                                   f"anyway: resuming restores {last or 'nothing'}"))
    if pod is not None:
        st.events.append(Event(NORMAL, api.REASON_SUSPEND_REQUESTED,
                               f"deleting pod {name}: the sandbox is suspended"))
    out.update(podName=None, nodeName=None)
    _drop(out, st.status, "capacity")
    return _finish(st, out, None, sit.Suspended(), delete=name)


def _overlap(st: _State, incarnation: int, flight: KubeObject) -> None:
    """A migrating checkpoint of the current incarnation is in flight: keep the replacement
    pod that waits for it, or (overlap_moves) create one now (overlap.py). A replacement
    that waits for something else, or has ended, is deleted by _finish; a new one is
    created once it is gone."""
    source = ck.name_of(flight)
    if (ck.reason_of(flight) not in protocol.MIGRATING_REASONS
            or ck.incarnation_of(flight) != incarnation):
        return
    if st.replacement is not None:
        st.keep_replacement = overlap.waiting_for(st.replacement, source)
        return
    if not st.settings.overlap_moves or ck.phase_of(flight) not in ck.ACTIVE:
        # Pending: no node-agent has said yet which format it writes the checkpoint in
        # (status.formatLevel comes with Dumping), so the node the pod needs is not known.
        return
    st.early_pod = podspec.build_sandbox_pod(st.sandbox, st.settings, incarnation + 1, source,
                                             overlap=True,
                                             format_level=protocol.format_level_of(flight))
    st.events.append(Event(NORMAL, api.REASON_REPLACEMENT_CREATED, (
        f"creating pod {st.early_pod['metadata']['name']} while checkpoint {source} "
        f"({ck.reason_of(flight)}) is taken: it restores it once it is durable")))


def _replacement_unwanted(st: _State) -> str | None:
    """The replacement pod to delete: it exists, is not being deleted, and this plan
    neither waits for it nor adopts it. A Normal Event says why."""
    pod = st.replacement
    if pod is None or st.keep_replacement or overlap.terminating(pod):
        return None
    name, source = pod["metadata"]["name"], overlap.source_of(pod)
    ckpt = ck.find(st.namespace_ckpts, source)
    if ckpt is None:
        why = f"checkpoint {source} no longer exists"
    elif ck.phase_of(ckpt) == ck.FAILED:
        why = f"checkpoint {source} failed"
    else:
        why = f"it no longer waits for checkpoint {source} ({ck.phase_of(ckpt)})"
    current = st.status.get("podName")
    goes_on = f"; the sandbox goes on in pod {current}" if current else ""
    st.events.append(Event(NORMAL, api.REASON_REPLACEMENT_DELETED,
                           f"deleting pod {name}: {why}{goes_on}"))
    return str(name)


def _wait_for(st: _State, out: KubeObject, flight: KubeObject, why: str) -> Plan:
    """A stopping checkpoint is in flight: the replacement waits for it to finish (its end
    is an event), or until it is STOPPING_WAIT old."""
    created = ck.created_at(flight)
    _wake_at(st, created + ck.STOPPING_WAIT if created is not None else None)
    return _finish(st, out, None, sit.WaitingForCheckpoint(
        f"{why}; waiting for checkpoint {ck.name_of(flight)} to finish"))


def _next_pod(st: _State, incarnation: int) -> str:
    return podspec.pod_name(st.name, incarnation + 1)


def _migrate(st: _State, out: KubeObject, incarnation: int, pod: KubeObject, stop: KubeObject
             ) -> Plan:
    """A stopping checkpoint of the current pod is durable: replace the pod, restoring it."""
    name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName")
    source = ck.name_of(stop)
    st.events.append(Event(NORMAL, api.REASON_CHECKPOINT_COMPLETED,
                           f"deleting pod {name} on node {node}: checkpoint {source} "
                           f"({ck.reason_of(stop)}) is durable"))
    event = Event(NORMAL, api.REASON_RESTORE_STARTED,
                  f"creating pod {_next_pod(st, incarnation)} to restore checkpoint {source}")
    _drop(out, st.status, *_RETRY_FIELDS)
    return _create(st, out, incarnation, name,
                   _Restore(source, ck.restore_record(stop, st.now, clean=True), event),
                   migration=f"checkpoint {source} ({ck.reason_of(stop)}) of pod {name} is "
                             "complete: moving the sandbox to a new pod")


def _replace(st: _State, out: KubeObject, incarnation: int, *, lost: str | None,
             delete: str | None, resuming: bool = False) -> Plan:
    """A new incarnation after a loss (or a resume): the fork's checkpoint first, then an
    unfinished restore's checkpoint again, then status.lastCheckpoint, else from scratch."""
    fork = (st.sandbox.get("spec") or {}).get("restoreFrom")
    if incarnation == 0 and fork:
        return _fork(st, out, str(fork), delete)
    new = _next_pod(st, incarnation)
    _drop(out, st.status, *_RETRY_FIELDS)
    again = _unfinished_restore(st)
    if again is not None:
        record = dict(st.status.get("restoredFrom") or {})
        event = Event(NORMAL, api.REASON_RESTORE_STARTED,
                      f"pod {lost or 'of the sandbox'} ended before its restore finished: "
                      f"restoring checkpoint {again} again into pod {new}")
        return _create(st, out, incarnation, delete, _Restore(again, record, event))
    last_record = out.get("lastCheckpoint") or st.status.get("lastCheckpoint") or {}
    last = last_record.get("name")
    if not last:
        fresh = (Event(WARNING, api.REASON_POD_CREATING,
                       f"no checkpoint to restore: pod {new} starts from scratch")
                 if incarnation > 0 and not resuming
                 else Event(NORMAL, api.REASON_POD_CREATING, f"creating pod {new}"))
        return _create(st, out, incarnation, delete, None, fresh=fresh)
    ckpt = ck.find(st.ckpts, last) or ck.as_checkpoint(last_record)
    record = ck.restore_record(ckpt, st.now, clean=ck.ended(ckpt, incarnation))
    return _create(st, out, incarnation, delete,
                   _Restore(last, record, _loss_event(record, new, lost, resuming)))


def _rejected(st: _State, out: KubeObject, incarnation: int, pod: KubeObject) -> Plan:
    """The kubelet refused the pod before any container ran (its view of the node lagged
    the scheduler's): nothing was lost, so a Normal Event, and the new pod does what the
    refused one was to do (restore the same checkpoint, or start afresh)."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName") or "?"
    new = _next_pod(st, incarnation)
    st.events.append(Event(NORMAL, api.REASON_POD_REJECTED, protocol.one_line(
        f"the kubelet on node {node} refused pod {name} before it ran "
        f"({status.get('reason')}: {status.get('message') or ''}); replacing it with pod "
        f"{new}", 1024, mark="")))
    source = _restore_source(pod)
    record = dict(st.status.get("restoredFrom") or {})
    fork = (st.sandbox.get("spec") or {}).get("restoreFrom")
    if source and record.get("name") == source and not (incarnation == 0 and fork):
        _drop(out, st.status, *_RETRY_FIELDS)
        event = Event(NORMAL, api.REASON_RESTORE_STARTED,
                      f"restoring checkpoint {source} into pod {new} instead")
        return _create(st, out, incarnation, name, _Restore(source, record, event))
    if not source and not (incarnation == 0 and fork):
        _drop(out, st.status, *_RETRY_FIELDS)
        return _create(st, out, incarnation, name, None,
                       fresh=Event(NORMAL, api.REASON_POD_CREATING, f"creating pod {new}"))
    return _replace(st, out, incarnation, lost=name, delete=name)


def _loss_event(record: KubeObject, new: str, lost: str | None, resuming: bool) -> Event:
    """Normal when the restored checkpoint is the lost pod's final state (or on a resume);
    a Warning that says how much work is gone otherwise."""
    name, stale = record["name"], int(record.get("staleSeconds") or 0)
    if stale > 0 and not resuming:
        return Event(WARNING, api.REASON_WORK_LOST,
                     f"pod {lost or 'of the sandbox'} was lost without a checkpoint of its "
                     f"final state: restoring checkpoint {name} taken {stale}s ago into pod "
                     f"{new}; work since then is lost")
    taken = f", taken {stale}s ago," if stale > 0 else ""
    return Event(NORMAL, api.REASON_RESTORE_STARTED,
                 f"creating pod {new} to restore checkpoint {name}{taken}")


def _unfinished_restore(st: _State) -> str | None:
    """The checkpoint the last incarnation was still restoring (Restoring is True), when it
    still exists: a pod lost before its restore finished loses nothing more than that."""
    name = (st.status.get("restoredFrom") or {}).get("name")
    if not name or not is_true(st.before, api.COND_RESTORING):
        return None
    return str(name) if ck.find(st.namespace_ckpts, str(name)) is not None else None


def _fork(st: _State, out: KubeObject, source: str, delete: str | None) -> Plan:
    """The first incarnation of a fork restores spec.restoreFrom once it is Completed."""
    ckpt = ck.find(st.namespace_ckpts, source)
    namespace = (st.sandbox.get("metadata") or {}).get("namespace") or "default"
    if ckpt is None:
        return _fork_blocked(st, out, api.REASON_CHECKPOINT_NOT_FOUND, warn=True, message=(
            f"spec.restoreFrom names Checkpoint {source}, which does not exist in namespace "
            f"{namespace}; the sandbox starts once it exists"))
    phase = ck.phase_of(ckpt)
    if phase in ck.IN_FLIGHT:
        message = f"waiting for Checkpoint {source} ({phase}) to complete before restoring it"
        return _fork_blocked(st, out, api.REASON_CHECKPOINT_IN_PROGRESS, message, warn=False)
    if phase == ck.FAILED:
        message = f"spec.restoreFrom: {ck.failure_message(ckpt)}; no pod is created"
        return _fork_blocked(st, out, api.REASON_CHECKPOINT_FAILED, message, warn=True)
    if not ck.verified(ckpt):
        return _fork_blocked(st, out, api.REASON_CHECKPOINT_UNTRUSTED, warn=True,
                             message=ck.unverified_fork_message(ckpt))
    event = Event(NORMAL, api.REASON_RESTORE_STARTED,
                  f"creating pod {_next_pod(st, 0)} to restore checkpoint {source}")
    return _create(st, out, 0, delete,
                   _Restore(source, ck.restore_record(ckpt, st.now, clean=False), event))


def _fork_blocked(st: _State, out: KubeObject, reason: str, message: str, *, warn: bool) -> Plan:
    """The fork cannot start yet: Ready=False says why; a Warning once per reason. A missing
    or in-flight checkpoint is looked at again every FORK_RECHECK_SECONDS (its events
    reconcile the sandbox it is of, not the fork)."""
    if reason != api.REASON_CHECKPOINT_FAILED:
        _wake_at(st, st.now + timedelta(seconds=FORK_RECHECK_SECONDS))
    before = get_condition(st.status.get("conditions") or [], api.COND_READY) or {}
    if warn and (before.get("reason"), before.get("message")) != (reason, message):
        st.events.append(Event(WARNING, reason, message))
    return _finish(st, out, None, sit.ForkBlocked(reason, message))


def _create(st: _State, out: KubeObject, incarnation: int, delete: str | None,
            restore: _Restore | None, *, fresh: Event | None = None,
            migration: str | None = None, no_usable: str | None = None,
            on_demand: str | None = None) -> Plan:
    """Create incarnation N+1, restoring ``restore`` (or from scratch, announced by
    ``fresh``; ``no_usable`` says why when a restore was wanted). ``migration``: a
    stopping checkpoint of the old pod moves the sandbox. ``on_demand``: why the pod asks
    for an on-demand node; every other new pod asks for spot (when the sandbox wants it)."""
    new_incarnation = incarnation + 1
    source = restore.name if restore is not None else None
    level = (ck.restore_level(ck.find(st.namespace_ckpts, restore.name), restore.record)
             if restore is not None else None)
    if restore is not None and level is not None:  # kept for when the Checkpoint is gone
        restore = replace(restore, record={**restore.record, "formatLevel": level})
    manifest = podspec.build_sandbox_pod(st.sandbox, st.settings, new_incarnation, source,
                                         on_demand=on_demand is not None, format_level=level)
    name = manifest["metadata"]["name"]
    adopt = st.replacement
    if adopt is not None and (restore is None or not overlap.adoptable(adopt, manifest)):
        # Not the pod this plan wants: it goes first (_finish), the next plan creates this.
        return _finish(st, out, None, sit.PodTerminating(name))
    if adopt is not None and restore is not None:  # created while its checkpoint was taken
        st.keep_replacement = True
        manifest, restore = adopt, _adopted(restore, name)
    if restore is not None:
        situation = sit.PodCreating(name, source, restore.reason, restore.message, migration,
                                    on_demand=on_demand)
        st.events.append(restore.event)
        out["restoredFrom"] = restore.record
        if restore.event.reason == api.REASON_WORK_LOST:
            st.work_lost = float(restore.record.get("staleSeconds") or 0)
    else:
        situation = sit.PodCreating(name, migration=migration, no_usable=no_usable,
                                    on_demand=on_demand)
        st.events.append(fresh or Event(NORMAL, api.REASON_POD_CREATING, f"creating pod {name}"))
        _drop(out, st.status, "restoredFrom")
    out.update(incarnation=new_incarnation, podName=name,
               nodeName=(manifest.get("spec") or {}).get("nodeName"))
    _set_capacity(out, st.status, podspec.capacity_of(manifest))
    return _finish(st, out, None, situation, create=None if adopt else manifest,
                   delete=delete)


def _adopted(restore: _Restore, pod: str) -> _Restore:
    """The restore of a replacement created while its checkpoint was taken: its Event says
    that the pod exists already."""
    event = Event(restore.event.type, restore.event.reason,
                  f"pod {pod}, created while checkpoint {restore.name} was taken, restores it")
    return _Restore(restore.name, restore.record, event, restore.reason, restore.message)


def _set_capacity(out: KubeObject, status: KubeObject, capacity: str | None) -> None:
    """status.capacity: what the current pod asks for (dropped when it asks for nothing)."""
    if capacity is None:
        _drop(out, status, "capacity")
    else:
        out["capacity"] = capacity


def _to_on_demand(st: _State, out: KubeObject, incarnation: int, pod: KubeObject,
                  waiting: placement.Unplaced) -> Plan:
    """No spot node took the pod within spec.placement.fallbackToOnDemandAfterSeconds:
    replace it by one that asks for an on-demand node and restores the same checkpoint (a
    restore pod's hermit.dev/restore-from), or starts from scratch as the old one would
    have. The old pod never ran (no node took it): nothing of the sandbox is lost."""
    new = _next_pod(st, incarnation)
    why = (f"no spot node took pod {waiting.pod} within "
           f"{podspec.fallback_after_seconds(st.sandbox)}s ({waiting.message}): pod {new} "
           "asks for an on-demand node")
    source = _restore_source(pod)
    if source is None:
        return _create(st, out, incarnation, waiting.pod, None,
                       fresh=Event(WARNING, api.REASON_ON_DEMAND_FALLBACK, why), on_demand=why)
    record = st.status.get("restoredFrom") or {}
    if record.get("name") != source:  # created by an older operator: no record yet
        record = ck.restore_record(_checkpoint_or_record(st, source), st.now, clean=False)
    event = Event(WARNING, api.REASON_ON_DEMAND_FALLBACK,
                  f"{why}, where it restores checkpoint {source}")
    return _create(st, out, incarnation, waiting.pod,
                   _Restore(source, dict(record), event, api.REASON_RESTORE_STARTED,
                            f"restoring checkpoint {source} into pod {new} on an on-demand "
                            "node"),
                   on_demand=why)


def _restore_failure(st: _State, out: KubeObject, pod: KubeObject) -> _Failure | None:
    """The current restore pod's failed restore: restore-phase Failed, or the pod ended
    while Restoring (its init gave up waiting; the agent may have restarted)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    source = annotations.get(protocol.ANNOTATION_RESTORE_FROM)
    if not source or protocol.incarnation_of(pod) != int(out["incarnation"]):
        return None
    name = pod["metadata"]["name"]
    outcome = annotations.get(protocol.ANNOTATION_RESTORE_PHASE)
    if outcome == protocol.RESTORE_FAILED:
        retryable = str(annotations.get(protocol.ANNOTATION_RESTORE_RETRYABLE, "true"))
        message = str(annotations.get(protocol.ANNOTATION_RESTORE_MESSAGE) or "")
        return _Failure(name, str(source), protocol.one_line(message) or "no message",
                        retryable.strip().lower() != "false")
    ended = (pod.get("status") or {}).get("phase") in api.POD_ENDED
    if outcome != protocol.RESTORED and ended and is_true(st.before, api.COND_RESTORING):
        return _Failure(name, str(source),
                        f"the pod ended before its restore finished: {container_message(pod)}",
                        True)
    return None


def _restore_failed(st: _State, out: KubeObject, incarnation: int, failure: _Failure) -> Plan:
    """Retry the same checkpoint after a transient failure (with a backoff); after a refusal,
    or MAX_RESTORE_ATTEMPTS failures, fall back to the previous checkpoint."""
    attempts = int(st.status.get("restoreAttempts") or 0) + 1
    if failure.retryable and attempts < ck.MAX_RESTORE_ATTEMPTS:
        return _schedule_retry(st, out, failure, attempts)
    why = (f"{attempts} attempts failed, the last: {failure.detail}" if failure.retryable
           else f"refused: {failure.detail}")
    why = f"pod {failure.pod}: {why}"
    return _fall_back(st, out, incarnation, failure.pod, _checkpoint_or_record(st, failure.source),
                      why)


def _checkpoint_or_record(st: _State, name: str) -> KubeObject:
    """The Checkpoint ``name``, or a stand-in from status.restoredFrom when it is gone."""
    found = ck.find(st.namespace_ckpts, name)
    if found is not None:
        return found
    record = st.status.get("restoredFrom") or {}
    return ck.as_checkpoint(record if record.get("name") == name else {"name": name})


def _schedule_retry(st: _State, out: KubeObject, failure: _Failure, attempts: int) -> Plan:
    """Delete the failed pod; the same checkpoint is restored again at nextRestoreAt."""
    delay = ck.restore_backoff(attempts)
    at = protocol.rfc3339(st.now + timedelta(seconds=delay))
    message = (f"pod {failure.pod} could not restore checkpoint {failure.source} (attempt "
               f"{attempts} of {ck.MAX_RESTORE_ATTEMPTS}): {failure.detail}; attempt "
               f"{attempts + 1} at {at}")
    st.events.append(Event(WARNING, api.REASON_RESTORE_FAILED, message))
    record = st.status.get("restoredFrom") or {}
    if record.get("name") != failure.source:  # restored by an older operator: no record yet
        record = ck.restore_record(_checkpoint_or_record(st, failure.source), st.now,
                                   clean=False)
    out.update(podName=None, nodeName=None, restoreAttempts=attempts, nextRestoreAt=at,
               restoredFrom=record)
    _drop(out, st.status, "capacity")
    _wake_at(st, st.now + timedelta(seconds=delay))
    return _finish(st, out, None, sit.RestoreRetrying(message), delete=failure.pod)


def _retry_restore(st: _State, out: KubeObject, incarnation: int) -> Plan:
    """A restore retry is scheduled: wait until nextRestoreAt, then restore the same
    checkpoint into a new incarnation (or fall back when that checkpoint is gone)."""
    record = st.status.get("restoredFrom") or {}
    source = record.get("name")
    attempts = int(st.status.get("restoreAttempts") or 0)
    if not source:
        return _replace(st, out, incarnation, lost=None, delete=None)
    if ck.find(st.namespace_ckpts, source) is None:
        return _fall_back(st, out, incarnation, None, ck.as_checkpoint(record),
                          f"Checkpoint {source} no longer exists")
    due = ck.parse_time(st.status.get("nextRestoreAt"))
    if due is not None and due > st.now:
        _wake_at(st, max(due, st.now + timedelta(seconds=1)))
        return _finish(st, out, None, sit.RestoreWaiting())
    new = _next_pod(st, incarnation)
    message = (f"restoring checkpoint {source} into pod {new} (attempt {attempts + 1} of "
               f"{ck.MAX_RESTORE_ATTEMPTS})")
    event = Event(NORMAL, api.REASON_RESTORE_RETRYING, f"retrying: {message}")
    out["nextRestoreAt"] = None
    return _create(st, out, incarnation, None,
                   _Restore(str(source), dict(record), event, api.REASON_RESTORE_RETRYING,
                            message))


def _fall_back(st: _State, out: KubeObject, incarnation: int, delete: str | None,
               refused: KubeObject, why: str) -> Plan:
    """Restore the newest Completed checkpoint older than ``refused``; none: start fresh.
    Either way with a Warning, and conditions and status.restoredFrom that say so."""
    _drop(out, st.status, *_RETRY_FIELDS)
    new = _next_pod(st, incarnation)
    source = ck.name_of(refused)
    older = ck.fallback_for(st.ckpts, refused)
    if older is not None:
        record = ck.restore_record(older, st.now, clean=False, fallback=True)
        message = (f"checkpoint {source} could not be restored ({why}): restoring the older "
                   f"checkpoint {record['name']}, taken {record.get('staleSeconds', 0)}s ago, "
                   f"into pod {new} instead; work since then is lost")
        event = Event(WARNING, api.REASON_RESTORE_FALLBACK, message)
        return _create(st, out, incarnation, delete,
                       _Restore(record["name"], record, event, api.REASON_RESTORE_FALLBACK,
                                message))
    message = (f"checkpoint {source} could not be restored ({why}) and no older checkpoint "
               f"exists: pod {new} starts from scratch")
    return _create(st, out, incarnation, delete, None,
                   fresh=Event(WARNING, api.REASON_NO_USABLE_CHECKPOINT, message),
                   no_usable=message)


def _restore_completed(st: _State, out: KubeObject, pod: KubeObject) -> str | None:
    """The restore pod's restore-phase Restored ends Restoring and counts one restore:
    the checkpoint it restored, or None."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    source = annotations.get(protocol.ANNOTATION_RESTORE_FROM)
    if (not source or protocol.incarnation_of(pod) != int(out["incarnation"])
            or annotations.get(protocol.ANNOTATION_RESTORE_PHASE) != protocol.RESTORED
            or not is_true(st.before, api.COND_RESTORING)):
        return None
    name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName")
    # Restoring flips to False in the same status patch: a re-reconcile does not count again.
    out["restores"] = int(out["restores"]) + 1
    record = st.status.get("restoredFrom") or {}
    if record.get("name") == source:
        st.downtime = ck.move_downtime(record, st.ckpts, st.now)
        if st.downtime is not None:
            out["lastDowntime"] = display.duration(st.downtime[1])
    _drop(out, st.status, *_RETRY_FIELDS)
    st.events.append(Event(NORMAL, api.REASON_RESTORE_COMPLETED,
                           f"pod {name} on node {node} restored checkpoint {source}"))
    return str(source)


def _pod_state(pod: KubeObject) -> sit.PodState:
    phase = (pod.get("status") or {}).get("phase")
    if phase == api.POD_SUCCEEDED:
        return sit.PodState.SUCCEEDED
    if phase == api.POD_FAILED:
        return sit.PodState.FAILED
    if pod_is_ready(pod):
        return sit.PodState.RUNNING
    return sit.PodState.PENDING if phase in (None, api.POD_PENDING) else sit.PodState.NOT_READY


def _observe(st: _State, out: KubeObject, pod: KubeObject,
             waiting: placement.Unplaced | None = None) -> Plan:
    """The current pod exists: its state becomes the sandbox's (an Event on a change).
    ``waiting``: no node has taken it (the plan looks again when its fallback is due)."""
    name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName")
    out.update(podName=name, nodeName=node)
    _wake_at(st, waiting.fallback_at if waiting is not None else None)
    _set_capacity(out, st.status, podspec.capacity_of(pod))
    restored = _restore_completed(st, out, pod)
    state = _pod_state(pod)
    observed = sit.PodObserved(name, node, state, container_message(pod), restored, waiting)
    if state is sit.PodState.SUCCEEDED and not _was(st.status, api.COND_SUCCEEDED, TRUE):
        st.events.append(Event(NORMAL, api.REASON_POD_SUCCEEDED,
                               f"the sandbox's command in pod {name} exited 0"))
    elif state is sit.PodState.FAILED and not _was(st.status, api.COND_FAILED, TRUE):
        st.events.append(Event(WARNING, api.REASON_POD_FAILED,
                               f"pod {name} failed: {observed.detail}"))
    elif state is sit.PodState.RUNNING and not _was(st.status, api.COND_READY, TRUE):
        st.events.append(Event(NORMAL, api.REASON_POD_RUNNING,
                               f"pod {name} is running on node {node}"))
    _interval(st, out, pod, observed)
    return _finish(st, out, pod, observed)


def _interval(st: _State, out: KubeObject, pod: KubeObject, observed: sit.PodObserved) -> None:
    """spec.checkpoint.intervalSeconds: request an Interval Checkpoint of a running, ready
    pod (not restoring, not finished, as this plan leaves it) once one is due; the
    node-agent serves it."""
    interval = ck.interval_seconds(st.sandbox)
    if (interval is None or st.create_checkpoint is not None or not pod_is_ready(pod)
            or any(sit.true_after(_seen(st, observed), t)
                   for t in (api.COND_RESTORING, api.COND_SUCCEEDED, api.COND_FAILED))):
        return
    blocking = ck.blocking_in_flight(st.ckpts, pod, st.now)
    if blocking is not None:  # its end is an event; only its age is a timer
        created = ck.created_at(blocking)
        _wake_at(st, created + ck.IN_FLIGHT_LIMIT if created is not None else None)
        return
    due = ck.interval_due_at(st.ckpts, pod, interval)
    if due is not None and due <= st.now:
        st.create_checkpoint = ck.interval_checkpoint(
            st.sandbox, int(out["incarnation"]), st.now, (pod.get("spec") or {}).get("nodeName"))
    _wake_at(st, due)


def _was(status: KubeObject, type_: str, value: str) -> bool:
    cond = get_condition(status.get("conditions") or [], type_)
    return cond is not None and cond.get("status") == value


def _restore_source(pod: KubeObject | None) -> str | None:
    if pod is None:
        return None
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return annotations.get(protocol.ANNOTATION_RESTORE_FROM)


def _drop(out: KubeObject, status: KubeObject, *keys: str) -> None:
    """Remove these status fields (a merge patch null) when the status has them."""
    for key in keys:
        if status.get(key) is not None:
            out[key] = None


def rejected_status(sandbox: KubeObject, p: Plan, message: str, now: datetime) -> KubeObject:
    """The status patch when the API refused the plan's pod: the plan's, with the spec
    recorded invalid (Accepted=False) and the incarnation, pod and node the sandbox had."""
    seen = sit.Seen(sit.SpecInvalid(message), p.status_patch.get("conditions") or [])
    conditions = sit.conditions(seen, (sandbox.get("metadata") or {}).get("generation"), now)
    status = sandbox.get("status") or {}
    return {**p.status_patch, "conditions": conditions, "phase": derive_phase(conditions),
            "incarnation": status.get("incarnation") or 0, "podName": status.get("podName"),
            "nodeName": status.get("nodeName")}


def _seen(st: _State, situation: sit.Situation) -> sit.Seen:
    return sit.Seen(situation, st.before, st.ckpts)


def _finish(st: _State, out: KubeObject, pod: KubeObject | None, situation: sit.Situation, *,
            create: KubeObject | None = None, delete: str | None = None,
            invalid_spec: str | None = None) -> Plan:
    """The plan, with every condition computed from ``situation`` (the only place they are
    written) and the phase derived from them."""
    pod_phase = (pod.get("status") or {}).get("phase") if pod else None
    conditions = sit.conditions(_seen(st, situation), st.generation, st.now)
    out["conditions"] = conditions
    out["phase"] = derive_phase(conditions, pod_phase)
    protect = {*st.protect, (out.get("lastCheckpoint") or {}).get("name"),
               _restore_source(create)}
    drop = (*ck.to_delete(st.ckpts, st.retain, protect), *st.refused[:-st.retain])
    if create is None:
        create = st.early_pod
    return Plan(create_pod=create, delete_pod=delete, status_patch=out,
                delete_replacement=_replacement_unwanted(st),
                events=tuple(st.events), invalid_spec=invalid_spec,
                create_checkpoint=st.create_checkpoint, adopt_checkpoints=st.adopt,
                fail_checkpoints=st.fail,
                delete_checkpoints=drop, pdb=st.pdb, delete_pdb=st.delete_pdb,
                requeue_after=st.requeue_after, downtime=st.downtime,
                work_lost=st.work_lost if create is not None else None,
                release_pod=st.release_pod and delete is not None)
