"""What should change for one AgentSandbox, given its current pod: a pure function.

``plan()`` reads the sandbox, its current pod (None when there is none) and the
Checkpoints of its namespace, and returns a ``Plan``: a pod to create, a pod to
delete, Checkpoints to create, adopt or delete, the status to patch and the Events to
emit. The caller (driver.py) applies it; nothing here talks to the API.

The checkpoint/restore protocol (docs/protocol.md), seen from the operator:
- the newest Completed Checkpoint becomes status.lastCheckpoint; Dumping/Uploading
  ones make Checkpointing=True, a Failed one CheckpointFailed plus a Warning;
- a Completed Preemption/Eviction (or Suspend) Checkpoint taken from the current pod
  ends it: the pod is deleted and incarnation N+1 restores that checkpoint
  (Migrating=True, Restoring=True); with spec.suspend the pod is only released;
- spec.suspend on a live pod first requests a Suspend Checkpoint, then releases it;
- the restore pod's hermit.dev/restore-phase annotation ends Restoring: Restored
  counts one restore (only while Restoring is True, so once per incarnation),
  Failed fails the sandbox.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from hermit_common import api
from hermit_common.settings import OperatorSettings
from hermit_operator import checkpoints as ck
from hermit_operator import podspec
from hermit_operator.conditions import (
    FALSE,
    TRUE,
    Condition,
    derive_phase,
    get_condition,
    is_true,
    set_condition,
)

Manifest = dict[str, Any]

NORMAL = "Normal"
WARNING = "Warning"

# Condition and Event reasons of the checkpoint/restore protocol (candidates for api.py).
REASON_CHECKPOINT_IN_PROGRESS: Final = "CheckpointInProgress"
REASON_CHECKPOINT_COMPLETED: Final = "CheckpointCompleted"
REASON_CHECKPOINT_FAILED: Final = "CheckpointFailed"
REASON_NO_CHECKPOINT_IN_PROGRESS: Final = "NoCheckpointInProgress"
REASON_RESTORE_FAILED: Final = "RestoreFailed"

# A Failed pod with one of these reasons (or a DisruptionTarget condition) was taken
# away from a live sandbox; it is replaced, not reported as the sandbox failing.
LOST_POD_REASONS = frozenset({"Evicted", "Preempting", "NodeShutdown", "Terminated", "NodeLost",
                              "Shutdown", "UnexpectedAdmissionError"})


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Plan:
    create_pod: Manifest | None = None
    delete_pod: str | None = None
    status_patch: Manifest = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    invalid_spec: str | None = None  # set: the spec cannot be run (a permanent error)
    create_checkpoint: Manifest | None = None
    adopt_checkpoints: tuple[tuple[str, Manifest], ...] = ()  # (name, metadata merge patch)
    delete_checkpoints: tuple[str, ...] = ()


@dataclass
class _State:
    """The status being built; conditions are replaced, never edited in place."""

    conditions: list[Condition]
    generation: int | None
    now: datetime
    events: list[Event] = field(default_factory=list)
    ckpts: list[Manifest] = field(default_factory=list)  # the sandbox's, oldest first
    retain: int = ck.DEFAULT_RETAIN
    protect: set[str] = field(default_factory=set)  # checkpoints retention must keep
    adopt: tuple[tuple[str, Manifest], ...] = ()
    create_checkpoint: Manifest | None = None

    def set(self, type_: str, status: str, reason: str, message: str) -> None:
        self.conditions = set_condition(self.conditions, type_, status, reason, message,
                                        self.generation, self.now)


def pod_is_ready(pod: Manifest) -> bool:
    """Running, with the Ready condition True (or, without conditions, every container ready)."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    ready = get_condition(status.get("conditions") or [], "Ready")
    if ready is not None:
        return bool(ready.get("status") == TRUE)
    statuses = status.get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)


def pod_is_lost(pod: Manifest) -> bool:
    """The pod failed because it was evicted, preempted or disrupted, not by its command."""
    status = pod.get("status") or {}
    if status.get("phase") != "Failed":
        return False
    if status.get("reason") in LOST_POD_REASONS:
        return True
    return is_true(status.get("conditions") or [], "DisruptionTarget")


def container_message(pod: Manifest) -> str:
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
    return _join(f"pod is {status.get('phase', 'Pending')}", status.get("reason"),
                 status.get("message"))


def _join(head: str, reason: str | None, message: str | None) -> str:
    parts = [head + (f" ({reason})" if reason else "")]
    if message:
        parts.append(" ".join(str(message).split())[:512])
    return ": ".join(parts)


def plan(sandbox: Manifest, pod: Manifest | None, now: datetime, *,
         settings: OperatorSettings, checkpoints: Sequence[Manifest] = ()) -> Plan:
    """Decide what to do for ``sandbox`` whose current pod is ``pod`` (None: none exists).

    ``checkpoints`` are the Checkpoint objects of the sandbox's namespace (others are ignored).
    """
    meta = sandbox.get("metadata") or {}
    spec = sandbox.get("spec") or {}
    status = sandbox.get("status") or {}
    st = _State(list(status.get("conditions") or []), meta.get("generation"), now)
    incarnation = int(status.get("incarnation") or 0)
    restores = int(status.get("restores") or 0)
    out: Manifest = {"observedGeneration": st.generation, "incarnation": incarnation,
                     "restores": restores}

    try:
        podspec.validate(sandbox)
    except podspec.InvalidSpec as exc:
        if not _was(status, api.COND_ACCEPTED, FALSE):
            st.events.append(Event(WARNING, api.REASON_INVALID_SPEC, str(exc)))
        st.set(api.COND_ACCEPTED, FALSE, api.REASON_INVALID_SPEC, str(exc))
        return _finish(st, out, pod, invalid_spec=str(exc))
    st.set(api.COND_ACCEPTED, TRUE, api.REASON_SPEC_VALID, "the spec can be run")

    st.ckpts = ck.of_sandbox(sandbox, checkpoints)
    st.retain = ck.retain_count(sandbox)
    st.adopt = tuple(ck.adoption_patches(sandbox, st.ckpts))
    source = _restore_source(pod)
    if source and is_true(st.conditions, api.COND_RESTORING):
        st.protect.add(source)
    _track_checkpoints(st, out, status)

    pod_name = (pod.get("metadata") or {}).get("name") if pod else None
    delete: str | None = None

    if spec.get("suspend"):
        return _suspend(sandbox, st, out, pod, incarnation)

    resuming = _was(status, api.COND_SUSPENDED, TRUE)
    if resuming:
        st.set(api.COND_SUSPENDED, FALSE, api.REASON_RESUMED, "spec.suspend is false")
    elif get_condition(st.conditions, api.COND_SUSPENDED) is None:
        st.set(api.COND_SUSPENDED, FALSE, api.REASON_NOT_SUSPENDED, "spec.suspend is false")

    terminal = is_true(st.conditions, api.COND_SUCCEEDED) or is_true(st.conditions,
                                                                       api.COND_FAILED)
    if pod is not None and (pod.get("metadata") or {}).get("deletionTimestamp"):
        st.set(api.COND_READY, FALSE, api.REASON_POD_TERMINATING, f"pod {pod_name} is terminating")
        return _finish(st, out, pod)

    if pod is not None and not terminal:
        stop = ck.stopping_completed(st.ckpts, pod)
        if stop is not None:
            return _migrate(sandbox, st, out, settings, incarnation, pod, stop)
        flight = ck.stopping_in_flight(st.ckpts, pod, now)
        if flight is not None and (pod.get("status") or {}).get("phase") in ("Failed",
                                                                             "Succeeded"):
            # The node-agent ended the tree under its checkpoint: not the sandbox's outcome.
            return _wait_for(st, out, flight, f"pod {pod_name} has stopped")

    lost = pod is not None and pod_is_lost(pod) and not terminal
    if pod is None and terminal:
        return _finish(st, out, None)
    if pod is None:
        flight = ck.stopping_in_flight(st.ckpts, None, now)
        if flight is not None and status.get("podName"):
            return _wait_for(st, out, flight, f"pod {status['podName']} is gone")
    if pod is None or lost:
        if lost and pod is not None:
            delete = pod_name
            st.events.append(Event(WARNING, api.REASON_POD_LOST,
                                   f"pod {pod_name} was lost: {container_message(pod)}"))
        elif status.get("podName") and not resuming:
            st.events.append(Event(WARNING, api.REASON_POD_LOST,
                                   f"pod {status['podName']} is gone"))
        return _create(sandbox, st, out, settings, incarnation, resuming, delete)

    return _observe(st, out, pod, status)


def _track_checkpoints(st: _State, out: Manifest, status: Manifest) -> None:
    """status.lastCheckpoint and the Checkpointing condition from the sandbox's checkpoints."""
    last = ck.last_completed(st.ckpts)
    if last is not None:
        record = ck.last_checkpoint_status(last)
        if (status.get("lastCheckpoint") or {}).get("name") != record["name"]:
            st.events.append(Event(NORMAL, REASON_CHECKPOINT_COMPLETED,
                                   f"checkpoint {record['name']} ({record.get('reason')}) "
                                   "is complete"))
        out["lastCheckpoint"] = record
    busy = ck.active(st.ckpts)
    if busy is not None:
        st.set(api.COND_CHECKPOINTING, TRUE, REASON_CHECKPOINT_IN_PROGRESS,
               f"checkpoint {ck.name_of(busy)} ({ck.reason_of(busy)}) is {ck.phase_of(busy)}")
        return
    done = ck.newest_finished(st.ckpts)
    if done is not None and ck.phase_of(done) == ck.COMPLETED:
        st.set(api.COND_CHECKPOINTING, FALSE, REASON_CHECKPOINT_COMPLETED,
               f"checkpoint {ck.name_of(done)} ({ck.reason_of(done)}) completed")
    elif done is not None:
        message = ck.failure_message(done)
        before = get_condition(status.get("conditions") or [], api.COND_CHECKPOINTING) or {}
        if before.get("message") != message:
            st.events.append(Event(WARNING, REASON_CHECKPOINT_FAILED, message))
        st.set(api.COND_CHECKPOINTING, FALSE, REASON_CHECKPOINT_FAILED, message)
    elif is_true(st.conditions, api.COND_CHECKPOINTING):
        st.set(api.COND_CHECKPOINTING, FALSE, REASON_NO_CHECKPOINT_IN_PROGRESS,
               "no checkpoint is being taken")


def _suspend(sandbox: Manifest, st: _State, out: Manifest, pod: Manifest | None,
             incarnation: int) -> Plan:
    """spec.suspend: checkpoint a live pod first (a Suspend Checkpoint), then release it."""
    name = (pod.get("metadata") or {}).get("name") if pod else None
    live = (pod is not None and not (pod.get("metadata") or {}).get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase") == "Running"
            and not is_true(st.conditions, api.COND_RESTORING))
    if pod is not None and live and ck.stopping_completed(st.ckpts, pod, ("Suspend",)) is None:
        wanted = ck.suspend_checkpoint_name(str(sandbox["metadata"]["name"]), incarnation)
        request = next((c for c in st.ckpts if ck.name_of(c) == wanted), None)
        if request is None or ck.phase_of(request) in ck.IN_FLIGHT:
            if request is None:
                st.create_checkpoint = ck.suspend_checkpoint(sandbox, incarnation)
                st.events.append(Event(NORMAL, api.REASON_SUSPEND_REQUESTED,
                                       f"checkpointing pod {name} before it is released"))
            st.set(api.COND_SUSPENDED, FALSE, api.REASON_SUSPEND_REQUESTED,
                   f"checkpoint {wanted} is taken before pod {name} is released")
            out.update(podName=name, nodeName=(pod.get("spec") or {}).get("nodeName"))
            return _finish(st, out, pod)
        if ck.phase_of(request) == ck.FAILED:
            last = (out.get("lastCheckpoint") or {}).get("name")
            st.events.append(Event(WARNING, REASON_CHECKPOINT_FAILED,
                                   f"{ck.failure_message(request)}; releasing pod {name} "
                                   f"anyway: resuming restores {last or 'nothing'}"))
    st.set(api.COND_SUSPENDED, TRUE, api.REASON_SUSPEND_REQUESTED,
           "spec.suspend is true: the sandbox's pod is released")
    st.set(api.COND_READY, FALSE, api.REASON_SUSPEND_REQUESTED, "the sandbox is suspended")
    if pod is not None:
        st.events.append(Event(NORMAL, api.REASON_SUSPEND_REQUESTED,
                               f"deleting pod {name}: the sandbox is suspended"))
    out.update(podName=None, nodeName=None)
    return _finish(st, out, None, delete=name)


def _wait_for(st: _State, out: Manifest, flight: Manifest, why: str) -> Plan:
    """A stopping checkpoint is in flight: the replacement waits for it to finish."""
    st.set(api.COND_READY, FALSE, REASON_CHECKPOINT_IN_PROGRESS,
           f"{why}; waiting for checkpoint {ck.name_of(flight)} to finish")
    return _finish(st, out, None)


def _migrate(sandbox: Manifest, st: _State, out: Manifest, settings: OperatorSettings,
             incarnation: int, pod: Manifest, stop: Manifest) -> Plan:
    """A stopping checkpoint of the current pod is durable: replace the pod, restoring it."""
    name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName")
    source = ck.name_of(stop)
    st.set(api.COND_MIGRATING, TRUE, REASON_CHECKPOINT_COMPLETED,
           f"checkpoint {source} ({ck.reason_of(stop)}) of pod {name} is complete: "
           "moving the sandbox to a new pod")
    st.events.append(Event(NORMAL, REASON_CHECKPOINT_COMPLETED,
                           f"deleting pod {name} on node {node}: checkpoint {source} "
                           f"({ck.reason_of(stop)}) is durable"))
    return _create(sandbox, st, out, settings, incarnation, False, name, restore_from=source)


def _create(sandbox: Manifest, st: _State, out: Manifest, settings: OperatorSettings,
            incarnation: int, resuming: bool, delete: str | None, *,
            restore_from: str | None = None) -> Plan:
    spec = sandbox.get("spec") or {}
    status = sandbox.get("status") or {}
    if restore_from is None:
        last = (out.get("lastCheckpoint") or status.get("lastCheckpoint") or {}).get("name")
        restore_from = spec.get("restoreFrom") if incarnation == 0 else last
    new_incarnation = incarnation + 1
    manifest = podspec.build_sandbox_pod(sandbox, settings, new_incarnation, restore_from)
    name = manifest["metadata"]["name"]
    st.set(api.COND_READY, FALSE, api.REASON_POD_CREATING, f"creating pod {name}")
    if restore_from is not None:
        st.set(api.COND_RESTORING, TRUE, api.REASON_RESTORE_STARTED,
               f"restoring checkpoint {restore_from} into pod {name}")
        st.events.append(Event(NORMAL, api.REASON_RESTORE_STARTED,
                               f"creating pod {name} to restore checkpoint {restore_from}"))
    else:
        if incarnation > 0 and not resuming:
            st.events.append(Event(WARNING, api.REASON_POD_CREATING,
                                   f"no checkpoint to restore: pod {name} starts from scratch"))
        else:
            st.events.append(Event(NORMAL, api.REASON_POD_CREATING, f"creating pod {name}"))
        if get_condition(st.conditions, api.COND_RESTORING) is not None:
            st.set(api.COND_RESTORING, FALSE, api.REASON_POD_CREATING, "nothing to restore")
    out.update(incarnation=new_incarnation, podName=name, nodeName=None)
    return _finish(st, out, None, create=manifest, delete=delete)


def pod_incarnation(pod: Manifest) -> int | None:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    try:
        return int(labels[api.LABEL_INCARNATION])
    except (KeyError, TypeError, ValueError):
        return None


def _restore_outcome(st: _State, out: Manifest, pod: Manifest, status: Manifest) -> bool:
    """Turn the restore pod's restore-phase annotation into conditions; True when it failed."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    source = annotations.get(api.ANNOTATION_RESTORE_FROM)
    if not source or pod_incarnation(pod) != int(out["incarnation"]):
        return False
    name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName")
    outcome = annotations.get(api.ANNOTATION_RESTORE_PHASE)
    if outcome == "Restored" and is_true(st.conditions, api.COND_RESTORING):
        # Restoring flips to False in the same status patch: a re-reconcile does not count again.
        st.set(api.COND_RESTORING, FALSE, api.REASON_RESTORE_COMPLETED,
               f"pod {name} restored checkpoint {source}")
        out["restores"] = int(out["restores"]) + 1
        st.events.append(Event(NORMAL, api.REASON_RESTORE_COMPLETED,
                               f"pod {name} on node {node} restored checkpoint {source}"))
        if is_true(st.conditions, api.COND_MIGRATING):
            st.set(api.COND_MIGRATING, FALSE, api.REASON_RESTORE_COMPLETED,
                   f"the sandbox moved to pod {name} on node {node}")
        return False
    if outcome != "Failed":
        return False
    detail = " ".join(str(annotations.get(api.ANNOTATION_RESTORE_MESSAGE) or "").split())[:512]
    message = f"pod {name} could not restore checkpoint {source}: {detail or 'no message'}"
    if not _was(status, api.COND_FAILED, TRUE):
        st.events.append(Event(WARNING, REASON_RESTORE_FAILED, message))
    st.set(api.COND_RESTORING, FALSE, REASON_RESTORE_FAILED, message)
    if get_condition(st.conditions, api.COND_MIGRATING) is not None:
        st.set(api.COND_MIGRATING, FALSE, REASON_RESTORE_FAILED, message)
    st.set(api.COND_FAILED, TRUE, REASON_RESTORE_FAILED, message)
    st.set(api.COND_READY, FALSE, REASON_RESTORE_FAILED, message)
    if get_condition(st.conditions, api.COND_SUCCEEDED) is None:
        st.set(api.COND_SUCCEEDED, FALSE, api.REASON_RUNNING, "the sandbox has not finished")
    return True


def _observe(st: _State, out: Manifest, pod: Manifest, status: Manifest) -> Plan:
    """The current pod exists: mirror its state into the conditions."""
    name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName")
    phase = (pod.get("status") or {}).get("phase")
    out.update(podName=name, nodeName=node)
    if _restore_outcome(st, out, pod, status):
        return _finish(st, out, None)
    if phase in ("Succeeded", "Failed") and is_true(st.conditions, api.COND_RESTORING):
        st.set(api.COND_RESTORING, FALSE, REASON_RESTORE_FAILED,
               f"pod {name} ended before its restore finished")
    if phase == "Succeeded":
        if not _was(status, api.COND_SUCCEEDED, TRUE):
            st.events.append(Event(NORMAL, api.REASON_POD_SUCCEEDED,
                                   f"the sandbox's command in pod {name} exited 0"))
        st.set(api.COND_SUCCEEDED, TRUE, api.REASON_POD_SUCCEEDED,
               f"the sandbox's command in pod {name} exited 0")
        st.set(api.COND_READY, FALSE, api.REASON_POD_SUCCEEDED, f"pod {name} has completed")
    elif phase == "Failed":
        message = f"pod {name} failed: {container_message(pod)}"
        if not _was(status, api.COND_FAILED, TRUE):
            st.events.append(Event(WARNING, api.REASON_POD_FAILED, message))
        st.set(api.COND_FAILED, TRUE, api.REASON_POD_FAILED, message)
        st.set(api.COND_READY, FALSE, api.REASON_POD_FAILED, message)
    elif pod_is_ready(pod):
        if not _was(status, api.COND_READY, TRUE):
            st.events.append(Event(NORMAL, api.REASON_POD_RUNNING,
                                   f"pod {name} is running on node {node}"))
        st.set(api.COND_READY, TRUE, api.REASON_POD_RUNNING,
               f"pod {name} is running on node {node}")
    else:
        reason = api.REASON_POD_PENDING if phase in (None, "Pending") else api.REASON_POD_NOT_READY
        st.set(api.COND_READY, FALSE, reason, f"pod {name}: {container_message(pod)}")
    for type_ in (api.COND_SUCCEEDED, api.COND_FAILED):
        if get_condition(st.conditions, type_) is None:
            st.set(type_, FALSE, api.REASON_RUNNING, "the sandbox has not finished")
    return _finish(st, out, pod)


def _was(status: Manifest, type_: str, value: str) -> bool:
    cond = get_condition(status.get("conditions") or [], type_)
    return cond is not None and cond.get("status") == value


def _restore_source(pod: Manifest | None) -> str | None:
    if pod is None:
        return None
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(api.ANNOTATION_RESTORE_FROM)


def _finish(st: _State, out: Manifest, pod: Manifest | None, *, create: Manifest | None = None,
            delete: str | None = None, invalid_spec: str | None = None) -> Plan:
    pod_phase = (pod.get("status") or {}).get("phase") if pod else None
    out["conditions"] = st.conditions
    out["phase"] = derive_phase(st.conditions, pod_phase)
    protect = {*st.protect, (out.get("lastCheckpoint") or {}).get("name"),
               _restore_source(create)}
    drop = tuple(ck.to_delete(st.ckpts, st.retain, protect))
    return Plan(create_pod=create, delete_pod=delete, status_patch=out,
                events=tuple(st.events), invalid_spec=invalid_spec,
                create_checkpoint=st.create_checkpoint, adopt_checkpoints=st.adopt,
                delete_checkpoints=drop)
