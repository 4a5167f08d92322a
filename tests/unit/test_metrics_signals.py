"""The service-level metrics: bounded labels, the phase gauge, failure causes."""

from __future__ import annotations

from prometheus_client import REGISTRY

from hermit_common import api, metrics
from hermit_common.errors import (
    CheckpointFailed,
    CheckpointRefused,
    HermitError,
    StoreUnavailable,
)
from hermit_node.control import metrics as node_metrics
from hermit_operator import metrics as operator_metrics


def _sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_checkpoint_reasons_are_bounded() -> None:
    assert metrics.checkpoint_reason("Preemption") == "preemption"
    assert metrics.checkpoint_reason("Turn") == "turn"
    assert metrics.checkpoint_reason("a-tenant's-invention") == "other"
    assert metrics.checkpoint_reason(None) == "other"


def test_failure_causes_follow_the_errors_meaning() -> None:
    assert node_metrics.failure_cause(CheckpointRefused("no")) == "refused"
    assert node_metrics.failure_cause(StoreUnavailable("s3")) == "store"
    assert node_metrics.failure_cause(CheckpointFailed("dump")) == "capture"
    assert node_metrics.failure_cause(HermitError("?")) == "other"
    assert node_metrics.failure_cause(RuntimeError("?")) == "other"
    assert {node_metrics.failure_cause(e) for e in (
        CheckpointRefused(""), StoreUnavailable(""), CheckpointFailed(""), KeyError())} \
        == set(metrics.FAILURE_CAUSES)


def test_a_failed_checkpoint_counts_by_reason_and_cause() -> None:
    before = _sample(metrics.NODE_CHECKPOINT_FAILURES, reason="interval",
                     cause="store")
    node_metrics.record_checkpoint_failure(1.5, reason="Interval",
                                           exc=StoreUnavailable("S3 is down"))
    assert _sample(metrics.NODE_CHECKPOINT_FAILURES, reason="interval",
                   cause="store") == before + 1


def test_the_phase_gauge_counts_each_sandbox_once() -> None:
    phases = operator_metrics._Phases()

    def count(phase: str) -> float:
        return _sample(metrics.OPERATOR_SANDBOXES, phase=phase)

    running, restoring = count(api.PHASE_RUNNING), count(api.PHASE_RESTORING)
    phases.set("ns", "a", api.PHASE_RUNNING)
    phases.set("ns", "a", api.PHASE_RUNNING)
    phases.set("ns", "b", api.PHASE_RUNNING)
    assert count(api.PHASE_RUNNING) == running + 2
    phases.set("ns", "a", api.PHASE_RESTORING)
    phases.set("ns", "a", None)  # a plan that leaves the phase as it is
    assert (count(api.PHASE_RUNNING), count(api.PHASE_RESTORING)) == (running + 1,
                                                                      restoring + 1)
    phases.forget("ns", "a")
    phases.forget("ns", "b")
    phases.forget("ns", "never-seen")
    assert (count(api.PHASE_RUNNING), count(api.PHASE_RESTORING)) == (running, restoring)


def test_every_metric_name_is_listed() -> None:
    exposed = {m.name for m in REGISTRY.collect()}
    for name in (metrics.OPERATOR_WORK_LOST, metrics.OPERATOR_SANDBOXES,
                 metrics.NODE_NOTICE_MARGIN, metrics.NODE_CHECKPOINT_FAILURES):
        assert name in metrics.ALL
    assert f"{metrics.NODE_BUILD}_info" in metrics.ALL
    assert metrics.NODE_BUILD in exposed and metrics.OPERATOR_BUILD in exposed
