"""What should change for one AgentSandbox, given its current pod: a pure function.

``plan()`` reads the sandbox and its current pod (None when there is none) and
returns a ``Plan``: a pod to create, a pod to delete, the status to patch and the
Events to emit. The caller (driver.py) applies it; nothing here talks to the API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hermit_common import api
from hermit_common.settings import OperatorSettings
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


@dataclass
class _State:
    """The status being built; conditions are replaced, never edited in place."""

    conditions: list[Condition]
    generation: int | None
    now: datetime
    events: list[Event] = field(default_factory=list)

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
         settings: OperatorSettings) -> Plan:
    """Decide what to do for ``sandbox`` whose current pod is ``pod`` (None: none exists)."""
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

    pod_name = (pod.get("metadata") or {}).get("name") if pod else None
    delete: str | None = None

    if spec.get("suspend"):
        st.set(api.COND_SUSPENDED, TRUE, api.REASON_SUSPEND_REQUESTED,
               "spec.suspend is true: the sandbox's pod is released")
        st.set(api.COND_READY, FALSE, api.REASON_SUSPEND_REQUESTED, "the sandbox is suspended")
        if pod is not None:
            st.events.append(Event(NORMAL, api.REASON_SUSPEND_REQUESTED,
                                   f"deleting pod {pod_name}: the sandbox is suspended"))
        out.update(podName=None, nodeName=None)
        return _finish(st, out, None, delete=pod_name)

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

    lost = pod is not None and pod_is_lost(pod) and not terminal
    if pod is None and terminal:
        return _finish(st, out, None)
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


def _create(sandbox: Manifest, st: _State, out: Manifest, settings: OperatorSettings,
            incarnation: int, resuming: bool, delete: str | None) -> Plan:
    spec = sandbox.get("spec") or {}
    status = sandbox.get("status") or {}
    last = (status.get("lastCheckpoint") or {}).get("name")
    restore_from: str | None = spec.get("restoreFrom") if incarnation == 0 else last
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


def _observe(st: _State, out: Manifest, pod: Manifest, status: Manifest) -> Plan:
    """The current pod exists: mirror its state into the conditions."""
    name = pod["metadata"]["name"]
    node = (pod.get("spec") or {}).get("nodeName")
    phase = (pod.get("status") or {}).get("phase")
    out.update(podName=name, nodeName=node)
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
        if is_true(st.conditions, api.COND_RESTORING):
            st.set(api.COND_RESTORING, FALSE, api.REASON_RESTORE_COMPLETED,
                   f"pod {name} runs the restored sandbox")
            out["restores"] = int(out["restores"]) + 1
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


def _finish(st: _State, out: Manifest, pod: Manifest | None, *, create: Manifest | None = None,
            delete: str | None = None, invalid_spec: str | None = None) -> Plan:
    pod_phase = (pod.get("status") or {}).get("phase") if pod else None
    out["conditions"] = st.conditions
    out["phase"] = derive_phase(st.conditions, pod_phase)
    return Plan(create_pod=create, delete_pod=delete, status_patch=out,
                events=tuple(st.events), invalid_spec=invalid_spec)
