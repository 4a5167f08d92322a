"""How kopf is tuned for Hermit: one function applied at start-up."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from hermit_common import api
from hermit_common.settings import OperatorSettings

WATCH_SERVER_TIMEOUT = 300  # seconds the API server keeps a watch open
WATCH_CLIENT_TIMEOUT = 330
WATCH_CONNECT_TIMEOUT = 10
RETRY_DELAY_SECONDS = 10
# An API refusal (forbidden, invalid, conflict) is retried too, but less often.
REFUSED_RETRY_DELAY_SECONDS = 60
# Threads for the (synchronous) handlers: a reconcile mostly waits on the API server, so
# more than kopf's default (CPUs + 4) keep up with bursts (thousands of pods starting).
HANDLER_THREADS = 16


def configure(kopf_settings: Any, settings: OperatorSettings) -> None:
    """Apply Hermit's choices to kopf.OperatorSettings (mutated in place)."""
    # Kopf would post every INFO log line as an Event; Hermit posts its own Events.
    kopf_settings.posting.level = logging.WARNING
    kopf_settings.peering.standalone = settings.peering_name is None
    if settings.peering_name is not None:
        kopf_settings.peering.name = settings.peering_name
        kopf_settings.peering.mandatory = True
        kopf_settings.peering.clusterwide = settings.clusterwide
    kopf_settings.persistence.finalizer = f"{api.GROUP}/finalizer"
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration")
    kopf_settings.watching.server_timeout = WATCH_SERVER_TIMEOUT
    kopf_settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT
    kopf_settings.watching.connect_timeout = WATCH_CONNECT_TIMEOUT
    kopf_settings.queueing.error_delays = (1, 2, 5, 10, 30, 60)
    kopf_settings.execution.max_workers = HANDLER_THREADS
