"""The node-agent's Prometheus metrics (names from hermit_common.metrics; small label sets)."""

from __future__ import annotations

import functools
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram, Info

from hermit_common import bandwidth, metrics
from hermit_common.errors import CheckpointFailed, CheckpointRefused, StoreUnavailable

# Checkpoint phases a duration is recorded for, and results.
PHASES = ("frozen", "dump", "capture", "upload", "total")
RESULTS = ("success", "failure")
BYTE_KINDS = ("image", "uploaded", "stored")

_BUCKETS = metrics.DURATION_BUCKETS

NOTICES = Counter(metrics.NODE_NOTICES, "Interruption notices seen", ["provider", "kind"])
CHECKPOINT_SECONDS = Histogram(
    metrics.NODE_CHECKPOINT_SECONDS,
    "Time spent per checkpoint phase, by result and the Checkpoint's reason",
    ["phase", "result", "reason"], buckets=_BUCKETS)
CHECKPOINT_FAILURES = Counter(
    metrics.NODE_CHECKPOINT_FAILURES, "Checkpoints that failed, by reason and cause",
    ["reason", "cause"])
NOTICE_MARGIN = Histogram(
    metrics.NODE_NOTICE_MARGIN,
    "Seconds left before the notice's deadline when a stopping checkpoint became durable "
    "(negative: after the deadline)", ["provider"], buckets=metrics.MARGIN_BUCKETS)
BUILD = Info(metrics.NODE_BUILD, "The node-agent's version")
CHECKPOINT_BYTES = Counter(
    metrics.NODE_CHECKPOINT_BYTES, "Checkpoint bytes by kind", ["kind"])
RESTORE_SECONDS = Histogram(
    metrics.NODE_RESTORE_SECONDS, "Time to restore a checkpoint into a pod", ["result"],
    buckets=_BUCKETS)

LAZY_RESTORE = Gauge(
    metrics.NODE_LAZY_RESTORE, "1 when restores on this node are lazy (CRIU lazy-pages), else 0")
LAZY_FILL_SECONDS = Histogram(
    metrics.NODE_LAZY_FILL_SECONDS,
    "Time from the start of a lazy restore's CRIU run until every page of the tree is in",
    ["result"], buckets=_BUCKETS)

TURNS = Counter(metrics.NODE_TURNS, "Turns ended, by what the inspector decided", ["decision"])
TURN_TOKEN_REVIEWS = Counter(
    metrics.NODE_TURN_TOKEN_REVIEWS,
    "TokenReviews the turn endpoint sent (its cache missed), by result", ["result"])
for _result in metrics.TOKEN_REVIEW_RESULTS:
    TURN_TOKEN_REVIEWS.labels(_result)  # each result reads 0 before its first review

UPLOAD_WAIT_SECONDS = Counter(
    metrics.NODE_UPLOAD_WAIT_SECONDS,
    "Seconds chunk PUTs waited for the node's upload bandwidth, by upload class", ["class"])
UPLOADS_ACTIVE = Gauge(
    metrics.NODE_UPLOADS_ACTIVE, "Checkpoint uploads open on this node, by upload class",
    ["class"])
CHUNK_CACHE_HITS = Counter(
    metrics.NODE_CHUNK_CACHE_HITS, "Chunks a restore took from the node's chunk cache")
CHUNK_CACHE_MISSES = Counter(
    metrics.NODE_CHUNK_CACHE_MISSES, "Chunks a restore fetched from S3 (not in the cache)")
PREFETCH_BYTES = Counter(
    metrics.NODE_PREFETCH_BYTES, "Chunk object bytes a prefetch put into the chunk cache")


def record_checkpoint(*, reason: str, frozen_ms: int, dump_ms: int, capture_ms: int,
                      upload_ms: int, total_seconds: float, image_bytes: int,
                      uploaded_bytes: int, stored_bytes: int) -> None:
    label = metrics.checkpoint_reason(reason)
    for phase, ms in (("frozen", frozen_ms), ("dump", dump_ms), ("capture", capture_ms),
                      ("upload", upload_ms)):
        CHECKPOINT_SECONDS.labels(phase, "success", label).observe(ms / 1000)
    CHECKPOINT_SECONDS.labels("total", "success", label).observe(total_seconds)
    for kind, n in (("image", image_bytes), ("uploaded", uploaded_bytes),
                    ("stored", stored_bytes)):
        CHECKPOINT_BYTES.labels(kind).inc(n)


def failure_cause(exc: BaseException) -> str:
    """The bounded ``cause`` label of a checkpoint's error (metrics.FAILURE_CAUSES)."""
    if isinstance(exc, CheckpointRefused):
        return "refused"
    if isinstance(exc, StoreUnavailable):
        return "store"
    if isinstance(exc, CheckpointFailed):
        return "capture"
    return "other"


def record_checkpoint_failure(total_seconds: float, *, reason: str,
                              exc: BaseException) -> None:
    label = metrics.checkpoint_reason(reason)
    CHECKPOINT_SECONDS.labels("total", "failure", label).observe(total_seconds)
    CHECKPOINT_FAILURES.labels(label, failure_cause(exc)).inc()


def record_notice_margin(provider: str, seconds_left: float) -> None:
    NOTICE_MARGIN.labels(provider).observe(seconds_left)


def record_build(version: str) -> None:
    BUILD.info({"version": version})


def record_restore(seconds: float, *, ok: bool) -> None:
    RESTORE_SECONDS.labels("success" if ok else "failure").observe(seconds)


def record_chunks(*, cached: int, fetched: int) -> None:
    """A restore's chunks: ``fetched`` in all, ``cached`` of them from the cache."""
    CHUNK_CACHE_HITS.inc(cached)
    CHUNK_CACHE_MISSES.inc(max(0, fetched - cached))


def record_prefetch(stored_bytes: int) -> None:
    PREFETCH_BYTES.inc(stored_bytes)


def record_lazy_restore(enabled: bool) -> None:
    LAZY_RESTORE.set(1 if enabled else 0)


def record_lazy_fill(seconds: float, *, ok: bool) -> None:
    LAZY_FILL_SECONDS.labels("success" if ok else "failure").observe(seconds)


def record_notice(provider: str, kind: str) -> None:
    NOTICES.labels(provider, kind).inc()


def record_turn(decision: str) -> None:
    TURNS.labels(decision).inc()


def record_token_review(result: str) -> None:
    """One TokenReview sent; ``result`` one of metrics.TOKEN_REVIEW_RESULTS."""
    TURN_TOKEN_REVIEWS.labels(result).inc()


def record_upload_wait(klass: str, seconds: float) -> None:
    UPLOAD_WAIT_SECONDS.labels(klass).inc(seconds)


def watch_uploads(active: Callable[[str], int]) -> None:
    """The uploads-open gauge reads ``active(class)`` when scraped."""
    for klass in bandwidth.CLASSES:
        UPLOADS_ACTIVE.labels(klass).set_function(functools.partial(active, klass))
