"""The operator's Prometheus metrics: names from hermit_common.metrics, small label sets."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Histogram

from hermit_common import metrics

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
    "Key service requests, by op (current, wrap, unwrap, sign, verify) and result (ok, "
    "refused, denied, invalid, limited, error). denied: a caller that is not a node-agent, "
    "or a node asking for a sandbox it neither runs nor restores.",
    ["op", "result"],
)


def record_key_request(op: str, result: str) -> None:
    KEY_REQUESTS.labels(op=op, result=result).inc()


def observe_downtime(reason: str, seconds: float) -> None:
    """One finished move (reason from hermit_common.metrics.DOWNTIME_REASONS)."""
    if reason in metrics.DOWNTIME_REASONS:
        DOWNTIME.labels(reason=reason).observe(max(0.0, seconds))
