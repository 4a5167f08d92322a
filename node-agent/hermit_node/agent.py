"""The node-agent's main loop: watch for interruption notices and report them.

Tainting the node and checkpointing its sandboxes on a notice is wired in by the
Kubernetes integration; this loop owns settings, metrics and the watcher.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Mapping

from prometheus_client import Counter, start_http_server

from hermit_common import metrics
from hermit_common.settings import NodeSettings, redacted

log = logging.getLogger("hermit_node")

NOTICES = Counter(metrics.NODE_NOTICES, "Interruption notices seen", ["provider", "kind"])


def run_agent(environ: Mapping[str, str]) -> int:
    settings = NodeSettings.from_env(environ)
    logging.getLogger().setLevel(settings.log_level)
    log.info("starting with settings %s", redacted(settings))
    start_http_server(settings.metrics_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if settings.watcher.provider == "none":
        stop.wait()
        return 0
    from hermit_node.watchers import build_watcher

    watcher = build_watcher(settings.watcher)
    for notice in watcher.watch(stop):
        NOTICES.labels(notice.provider, notice.kind).inc()
        log.warning("interruption notice on %s: %s", settings.node_name, notice)
    return 0
