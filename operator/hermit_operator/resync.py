"""Whether the periodic resync must reconcile a sandbox: only when its inputs changed.

The operator reconciles a sandbox on every event of the sandbox, its pods and its
Checkpoints. The resync (every ``HERMIT_RESYNC_SECONDS``) is a safety net for the rare
event whose reconcile failed or was missed. It must cost nothing for a sandbox whose
inputs did not change, so it compares fingerprints, with no API call:

- ``Inputs`` remembers the resourceVersion of every sandbox pod and Checkpoint the
  operator's watches delivered (kopf's pod, Checkpoint and sandbox event handlers feed
  it);
- after every successful reconcile, the driver records the fingerprint of what it read
  (``record``);
- the resync computes the fingerprint from ``Inputs`` (which also keeps, per sandbox, the
  four fields a fingerprint needs, from kopf's sandbox events: no body is kept), and
  reconciles only when it differs, or when the last reconcile is ``FULL_EVERY`` resync
  periods old (what no watch shows, a PodDisruptionBudget deleted by hand, comes back
  then).

A fingerprint is the sandbox's uid and generation (the spec; its status is the
operator's own output), the resourceVersion of its current pod (status.podName) and
the names and resourceVersions of the Checkpoints of the sandbox (spec.sandboxRef) plus
the one a fork restores (spec.restoreFrom). Timers (interval checkpoints, restore
retries, the on-demand fallback, a fork waiting for its checkpoint) do not depend on
the resync: the plan says when to look again (``wakeups``).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from hermit_common import protocol
from hermit_common.protocol import KubeObject

FULL_EVERY: Final = 6  # at least one full reconcile every this many resync periods


def fingerprint(sandbox: Mapping[str, Any], pod_version: str | None,
                checkpoints: Iterable[tuple[str, str]]) -> str:
    """A digest of what a reconcile of ``sandbox`` reads: its uid and generation, its
    current pod's resourceVersion (None: none), (name, resourceVersion) of its Checkpoints."""
    meta = protocol.meta(sandbox)
    parts = [str(meta.get("uid") or ""), str(meta.get("generation") or ""),
             str(pod_version or "-"), *sorted(f"{n}={v}" for n, v in checkpoints)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Seen:
    """The few fields of a sandbox a fingerprint needs (all the resync keeps of it)."""

    uid: str
    generation: str
    pod: str | None  # status.podName
    restore_from: str | None  # spec.restoreFrom

    @classmethod
    def of(cls, sandbox: Mapping[str, Any]) -> Seen:
        meta = protocol.meta(sandbox)
        pod = (sandbox.get("status") or {}).get("podName")
        source = (sandbox.get("spec") or {}).get("restoreFrom")
        return cls(str(meta.get("uid") or ""), str(meta.get("generation") or ""),
                   str(pod) if pod else None, str(source) if source else None)

    def as_sandbox(self) -> KubeObject:
        return {"metadata": {"uid": self.uid, "generation": self.generation}}


def relevant(sandbox: Mapping[str, Any], ckpt: Mapping[str, Any]) -> bool:
    """Whether a Checkpoint is an input of the sandbox's reconcile: one of its own, or the
    one its spec.restoreFrom names (same namespace)."""
    meta = protocol.meta(sandbox)
    if protocol.meta(ckpt).get("namespace") != meta.get("namespace"):
        return False
    source = (sandbox.get("spec") or {}).get("restoreFrom")
    return (protocol.sandbox_of(ckpt) == meta.get("name")
            or (bool(source) and protocol.name_of(ckpt) == source))


def fingerprint_of(sandbox: Mapping[str, Any], pod: Mapping[str, Any] | None,
                   checkpoints: Iterable[Mapping[str, Any]]) -> str:
    """The fingerprint of the objects a reconcile read (the driver's side)."""
    pod_version = protocol.meta(pod).get("resourceVersion") if pod is not None else None
    return fingerprint(sandbox, str(pod_version) if pod_version else None,
                       [(protocol.name_of(c), str(protocol.meta(c).get("resourceVersion")))
                        for c in checkpoints if relevant(sandbox, c)])


@dataclass(frozen=True)
class Reconciled:
    """The fingerprint of a sandbox's last successful reconcile and when (monotonic)."""

    fingerprint: str
    at: float


def resync_needed(last: Reconciled | None, current: str, now: float, period: float) -> bool:
    """Whether the resync must reconcile: never reconciled by this process, inputs changed,
    or the last reconcile is FULL_EVERY periods old."""
    return (last is None or last.fingerprint != current
            or now - last.at >= FULL_EVERY * period)


class Inputs:
    """What the watches delivered (the resourceVersions of sandbox pods and Checkpoints)
    and what each sandbox's last reconcile read. Thread-safe; entries go with deletes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], str] = {}  # (namespace, pod) -> resourceVersion
        # (namespace, name) -> (its sandbox, resourceVersion); and per (namespace, sandbox)
        # the names of its Checkpoints, so a fingerprint reads only the sandbox's own.
        self._ckpts: dict[tuple[str, str], tuple[str | None, str]] = {}
        self._of: dict[tuple[str, str], set[str]] = {}
        self._sandboxes: dict[tuple[str, str], Seen] = {}
        self._done: dict[tuple[str, str], Reconciled] = {}

    @staticmethod
    def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
        meta = protocol.meta(obj)
        return str(meta.get("namespace") or ""), str(meta.get("name") or "")

    def saw_pod(self, pod: Mapping[str, Any], deleted: bool) -> None:
        with self._lock:
            if deleted:
                self._pods.pop(self._key(pod), None)
            else:
                self._pods[self._key(pod)] = str(protocol.meta(pod).get("resourceVersion"))

    def saw_checkpoint(self, ckpt: Mapping[str, Any], deleted: bool) -> None:
        key = self._key(ckpt)
        with self._lock:
            before = self._ckpts.pop(key, None)
            if before is not None and before[0] is not None:
                names = self._of.get((key[0], before[0]), set())
                names.discard(key[1])
                if not names:
                    self._of.pop((key[0], before[0]), None)
            if deleted:
                return
            sandbox = protocol.sandbox_of(ckpt)
            self._ckpts[key] = (sandbox, str(protocol.meta(ckpt).get("resourceVersion")))
            if sandbox is not None:
                self._of.setdefault((key[0], sandbox), set()).add(key[1])

    def saw_sandbox(self, sandbox: Mapping[str, Any], deleted: bool) -> None:
        key = self._key(sandbox)
        with self._lock:
            if deleted:
                self._sandboxes.pop(key, None)
                self._done.pop(key, None)
            else:
                self._sandboxes[key] = Seen.of(sandbox)

    def sandboxes(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._sandboxes)

    def current(self, namespace: str, name: str) -> str | None:
        """The fingerprint of the sandbox as the watches show it now; None when unknown."""
        with self._lock:
            seen = self._sandboxes.get((namespace, name))
            if seen is None:
                return None
            pod_version = self._pods.get((namespace, seen.pod)) if seen.pod else None
            names = set(self._of.get((namespace, name), ()))
            if seen.restore_from and (namespace, seen.restore_from) in self._ckpts:
                names.add(seen.restore_from)
            ckpts = [(n, self._ckpts[(namespace, n)][1]) for n in names]
        return fingerprint(seen.as_sandbox(), pod_version, ckpts)

    def due(self, now: float, period: float) -> list[tuple[str, str]]:
        """The sandboxes the resync must reconcile now (``resync_needed``)."""
        out = []
        for key in self.sandboxes():
            current = self.current(*key)
            if current is not None and resync_needed(self.last(*key), current, now, period):
                out.append(key)
        return out

    def record(self, namespace: str, name: str, fingerprint_: str, now: float) -> None:
        with self._lock:
            self._done[(namespace, name)] = Reconciled(fingerprint_, now)

    def last(self, namespace: str, name: str) -> Reconciled | None:
        with self._lock:
            return self._done.get((namespace, name))

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._done.pop((namespace, name), None)
