"""The operator's Prometheus metrics: names from hermit_common.metrics, small label sets."""

from __future__ import annotations

import threading
from typing import Final

from prometheus_client import Counter, Gauge, Histogram, Info

from hermit_common import api, metrics

RECONCILES: Final = Counter(
    metrics.OPERATOR_RECONCILES,
    "AgentSandbox reconciliations, by result (ok, invalid, transient).",
    ["result"],
)
RECONCILE_SECONDS: Final = Histogram(
    metrics.OPERATOR_RECONCILE_SECONDS,
    "Time to reconcile one AgentSandbox (API calls included).",
)
PODS_CREATED: Final = Counter(
    metrics.OPERATOR_PODS_CREATED,
    "Sandbox pods created, by mode (fresh, restore).",
    ["mode"],
)
CHECKPOINTS_DELETED: Final = Counter(
    metrics.OPERATOR_CHECKPOINTS_DELETED,
    "Checkpoint objects deleted by retention.",
)
RESYNCS: Final = Counter(
    metrics.OPERATOR_RESYNCS,
    "Periodic looks at a sandbox (HERMIT_RESYNC_SECONDS), by result: skipped (its inputs "
    "are those of its last reconcile), reconciled.",
    ["result"],
)
DOWNTIME: Final = Histogram(
    metrics.OPERATOR_DOWNTIME,
    "Seconds a sandbox did not run during a move, by reason (preemption, eviction): from "
    "the stopping Checkpoint's creation to the operator seeing the restored pod's restore "
    "completed. Observed once per move.",
    ["reason"],
    buckets=metrics.DOWNTIME_BUCKETS,
)

KEY_REQUESTS: Final = Counter(
    metrics.OPERATOR_KEY_REQUESTS,
    "Key service requests, by op (current, wrap, unwrap, sign, verify, credentials) and "
    "result (ok, refused, denied, invalid, limited, error). denied: a caller that is not "
    "a node-agent, or a node asking for a sandbox it neither runs nor restores.",
    ["op", "result"],
)


def record_key_request(op: str, result: str) -> None:
    KEY_REQUESTS.labels(op=op, result=result).inc()


def observe_downtime(reason: str, seconds: float) -> None:
    """One finished move (reason from hermit_common.metrics.DOWNTIME_REASONS)."""
    if reason in metrics.DOWNTIME_REASONS:
        DOWNTIME.labels(reason=reason).observe(max(0.0, seconds))


WORK_LOST: Final = Histogram(
    metrics.OPERATOR_WORK_LOST,
    "Seconds of work a restore dropped: the age of the checkpoint it restores when the "
    "pod was lost without a checkpoint of its final state (the WorkLost Event). Observed "
    "once per pod created for such a restore.",
    buckets=metrics.WORK_LOST_BUCKETS,
)
SANDBOXES: Final = Gauge(
    metrics.OPERATOR_SANDBOXES,
    "AgentSandboxes by status.phase, as the active operator last reconciled them.",
    ["phase"],
)
BUILD: Final = Info(metrics.OPERATOR_BUILD, "The operator's version.")


class _Phases:
    """Each sandbox's last phase, behind the SANDBOXES gauge (phases outside
    api.SANDBOX_PHASES count as Pending: the label set stays fixed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[tuple[str, str], str] = {}
        for phase in api.SANDBOX_PHASES:
            SANDBOXES.labels(phase).set(0)

    def set(self, namespace: str, name: str, phase: object) -> None:
        if not isinstance(phase, str):
            return  # the plan leaves the phase as it is
        phase = phase if phase in api.SANDBOX_PHASES else api.PHASE_PENDING
        with self._lock:
            old = self._of.get((namespace, name))
            if old == phase:
                return
            self._of[(namespace, name)] = phase
            if old is not None:
                SANDBOXES.labels(old).dec()
            SANDBOXES.labels(phase).inc()

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            old = self._of.pop((namespace, name), None)
            if old is not None:
                SANDBOXES.labels(old).dec()


PHASES: Final = _Phases()


def record_build(version: str) -> None:
    BUILD.info({"version": version})
