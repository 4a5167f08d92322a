"""Metric names, in one place so dashboards, docs and code agree (docs/metrics.md).

``hermit_<component>_<noun>_<unit>``; labels come from small fixed sets, never a pod or
sandbox name. The components define their collectors with these names
(hermit_operator/metrics.py, hermit_node/control/metrics.py); the chart's Grafana dashboard
(charts/hermit/dashboards/hermit.json) may only query names listed in ``ALL``.
"""

from typing import Final

from hermit_common import protocol

# -- node-agent ---------------------------------------------------------------------------
NODE_NOTICES: Final = "hermit_node_interruption_notices_total"  # labels: provider, kind
NODE_CHECKPOINT_SECONDS: Final = "hermit_node_checkpoint_duration_seconds"  # labels: phase, result
NODE_CHECKPOINT_BYTES: Final = "hermit_node_checkpoint_bytes_total"  # labels: kind
NODE_RESTORE_SECONDS: Final = "hermit_node_restore_duration_seconds"  # labels: result
# Failed checkpoints; labels: reason (CHECKPOINT_REASONS), cause (FAILURE_CAUSES).
NODE_CHECKPOINT_FAILURES: Final = "hermit_node_checkpoint_failures_total"
# Seconds left before a notice's deadline when its stopping checkpoint became durable
# (negative: after it); labels: provider.
NODE_NOTICE_MARGIN: Final = "hermit_node_notice_margin_seconds"
# The checkpoint reasons a label may take (spec.reason, lower case; others: "other").
CHECKPOINT_REASONS: Final = (*(r.lower() for r in protocol.REASONS), "other")


def build_version() -> str:
    """The installed Hermit's version, for ``*_build_info``."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("hermit")
    except PackageNotFoundError:
        return "unknown"


def checkpoint_reason(reason: object) -> str:
    """The ``reason`` label of a Checkpoint's spec.reason (bounded: unknown ones are
    "other")."""
    label = str(reason or "").lower()
    return label if label in CHECKPOINT_REASONS else "other"


# Why a checkpoint failed, by the error's meaning (errors.py): refused (a check of
# Hermit's said no), store (S3), capture (freezing, dumping or copying), other.
FAILURE_CAUSES: Final = ("refused", "store", "capture", "other")
# Seconds, dense between 5 s and 120 s, where the clouds' notice deadlines sit (Azure and
# GCP 30 s, AWS 120 s).
DURATION_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0,
                           30.0, 45.0, 60.0, 90.0, 120.0, 300.0)
MARGIN_BUCKETS: Final = (-30.0, -10.0, -5.0, 0.0, 2.5, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0,
                         60.0, 90.0, 120.0)
NODE_TURNS: Final = "hermit_node_turns_total"  # labels: decision (protocol.TURN_DECISIONS)
# TokenReviews the turn endpoint sent (cache misses only: what a junk-token flood costs the
# API server); labels: result (TOKEN_REVIEW_RESULTS).
NODE_TURN_TOKEN_REVIEWS: Final = "hermit_node_turn_token_reviews_total"
TOKEN_REVIEW_AUTHENTICATED: Final = "authenticated"
TOKEN_REVIEW_UNAUTHENTICATED: Final = "unauthenticated"
TOKEN_REVIEW_ERROR: Final = "error"  # the API server did not answer
TOKEN_REVIEW_RESULTS: Final = (TOKEN_REVIEW_AUTHENTICATED, TOKEN_REVIEW_UNAUTHENTICATED,
                               TOKEN_REVIEW_ERROR)
# 1: restores on this node are lazy (HERMIT_LAZY_RESTORE and userfaultfd works); 0: full.
NODE_LAZY_RESTORE: Final = "hermit_node_lazy_restore_enabled"
NODE_LAZY_FILL_SECONDS: Final = "hermit_node_lazy_restore_fill_seconds"  # labels: result
# The node's upload bandwidth (bandwidth.py): seconds chunk PUTs waited for it, and the
# uploads open; labels: class (bandwidth.CLASSES: urgent, routine).
NODE_UPLOAD_WAIT_SECONDS: Final = "hermit_node_upload_wait_seconds_total"
NODE_UPLOADS_ACTIVE: Final = "hermit_node_uploads_active"
# The node-local chunk cache (docs/storage.md, "Prefetch and the chunk cache"): chunks a
# restore found in it or fetched from S3, and bytes a prefetch put into it.
NODE_CHUNK_CACHE_HITS: Final = "hermit_node_chunk_cache_hits_total"
NODE_CHUNK_CACHE_MISSES: Final = "hermit_node_chunk_cache_misses_total"
NODE_PREFETCH_BYTES: Final = "hermit_node_prefetch_bytes_total"

# -- operator -------------------------------------------------------------------------------
OPERATOR_RECONCILES: Final = "hermit_operator_reconciles_total"  # labels: result
OPERATOR_RECONCILE_SECONDS: Final = "hermit_operator_reconcile_duration_seconds"
OPERATOR_PODS_CREATED: Final = "hermit_operator_pods_created_total"  # labels: mode
OPERATOR_CHECKPOINTS_DELETED: Final = "hermit_operator_checkpoints_deleted_total"
OPERATOR_DOWNTIME: Final = "hermit_operator_sandbox_downtime_seconds"  # labels: reason
OPERATOR_RESYNCS: Final = "hermit_operator_resyncs_total"  # labels: result
# Seconds of work a restore of an older checkpoint dropped (a pod lost without notice).
OPERATOR_WORK_LOST: Final = "hermit_operator_work_lost_seconds"
OPERATOR_SANDBOXES: Final = "hermit_operator_sandboxes"  # labels: phase (api.SANDBOX_PHASES)
# prometheus_client's Info: exposed as <name>_info{version} 1.
OPERATOR_BUILD: Final = "hermit_operator_build"
NODE_BUILD: Final = "hermit_node_build"
# Key service requests (hermit_operator.keyservice): labels op (current, wrap, unwrap,
# sign, verify, credentials, "" for an unknown path) and result (keyservice.RESULTS).
OPERATOR_KEY_REQUESTS: Final = "hermit_operator_key_requests_total"

# hermit_operator_sandbox_downtime_seconds{reason}: why the sandbox moved, from the
# stopping Checkpoint's spec.reason (Preemption, Eviction). A Suspend is not downtime
# (the user chose it) and a loss without notice has no durable start: neither is observed.
DOWNTIME_PREEMPTION: Final = "preemption"
DOWNTIME_EVICTION: Final = "eviction"
DOWNTIME_REASONS: Final = (DOWNTIME_PREEMPTION, DOWNTIME_EVICTION)
DOWNTIME_REASON_OF: Final = {protocol.PREEMPTION: DOWNTIME_PREEMPTION,
                             protocol.EVICTION: DOWNTIME_EVICTION}
# Seconds to minutes: a move is a notice, a dump, an upload, a new pod and a restore.
DOWNTIME_BUCKETS: Final = (1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0,
                           180.0, 300.0, 600.0)

# A second (an interval's tail) to two hours (a sandbox without interval checkpoints).
WORK_LOST_BUCKETS: Final = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                            3600.0, 7200.0)

ALL: Final = (NODE_NOTICES, NODE_CHECKPOINT_SECONDS, NODE_CHECKPOINT_BYTES,
              NODE_RESTORE_SECONDS, NODE_TURNS, NODE_TURN_TOKEN_REVIEWS, NODE_LAZY_RESTORE,
              NODE_LAZY_FILL_SECONDS,
              NODE_UPLOAD_WAIT_SECONDS, NODE_UPLOADS_ACTIVE,
              NODE_CHUNK_CACHE_HITS, NODE_CHUNK_CACHE_MISSES, NODE_PREFETCH_BYTES,
              OPERATOR_RECONCILES, OPERATOR_RECONCILE_SECONDS,
              OPERATOR_PODS_CREATED, OPERATOR_CHECKPOINTS_DELETED, OPERATOR_DOWNTIME,
              OPERATOR_RESYNCS, OPERATOR_WORK_LOST, OPERATOR_SANDBOXES,
              f"{OPERATOR_BUILD}_info", NODE_CHECKPOINT_FAILURES, NODE_NOTICE_MARGIN,
              f"{NODE_BUILD}_info", OPERATOR_KEY_REQUESTS)
