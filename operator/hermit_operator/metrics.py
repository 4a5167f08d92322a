"""The operator's Prometheus metrics: hermit_operator_<noun>_<unit>, labels from small sets."""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Histogram

RECONCILES: Final = Counter(
    "hermit_operator_reconciles_total",
    "AgentSandbox reconciliations, by result (ok, invalid, transient).",
    ["result"],
)
RECONCILE_SECONDS: Final = Histogram(
    "hermit_operator_reconcile_duration_seconds",
    "Time to reconcile one AgentSandbox (API calls included).",
)
PODS_CREATED: Final = Counter(
    "hermit_operator_pods_created_total",
    "Sandbox pods created, by mode (fresh, restore).",
    ["mode"],
)
CHECKPOINTS_DELETED: Final = Counter(
    "hermit_operator_checkpoints_deleted_total",
    "Checkpoint objects deleted by retention.",
)
