"""The HTTP port both components serve: Prometheus metrics, liveness and readiness.

One small threaded HTTP server on HERMIT_METRICS_PORT answers

- ``/healthz`` (the liveness probe) and ``/readyz`` (the readiness probe): 200 and
  ``ok: <why>`` when the component's check passes, 503 and ``<why>`` when it does not;
- every other path with the Prometheus metrics (as ``prometheus_client``'s own server).

What "live" and "ready" mean is each component's own pure function
(``hermit_operator.health``, ``hermit_node.control.health``); this module only serves a
``Verdict`` and keeps the timestamps those functions judge (``Heartbeats``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Final

from prometheus_client.exposition import MetricsHandler

LIVENESS_PATH: Final = "/healthz"
READINESS_PATH: Final = "/readyz"

log = logging.getLogger("hermit.health")


@dataclass(frozen=True)
class Verdict:
    """The answer of a health check: ``ok``, and why (one line, for people)."""

    ok: bool
    reason: str


Check = Callable[[], Verdict]


class Heartbeats:
    """Named moments (``time.monotonic()`` seconds) that threads record and checks read."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def beat(self, name: str) -> None:
        now = self._clock()
        with self._lock:
            self._last[name] = now

    def last(self, name: str) -> float | None:
        """When ``name`` last beat, or None when it never did."""
        with self._lock:
            return self._last.get(name)

    def now(self) -> float:
        return self._clock()


def age(moment: float | None, now: float) -> float | None:
    """Seconds since ``moment`` (None stays None)."""
    return None if moment is None else max(0.0, now - moment)


def _handler(checks: dict[str, Check]) -> type[MetricsHandler]:
    class Handler(MetricsHandler):
        def do_GET(self) -> None:
            check = checks.get(self.path.split("?", 1)[0])
            if check is None:
                super().do_GET()  # metrics, as prometheus_client serves them
                return
            try:
                verdict = check()
            except Exception as exc:  # a bug in a check: say so, never hang the probe
                log.exception("health check %s failed", self.path)
                verdict = Verdict(False, f"the check raised {type(exc).__name__}: {exc}")
            body = (f"ok: {verdict.reason}" if verdict.ok else verdict.reason).encode() + b"\n"
            self.send_response(200 if verdict.ok else 503)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def serve(port: int, liveness: Check, readiness: Check, *,
          host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serves metrics, ``/healthz`` and ``/readyz`` on ``port`` from a daemon thread;
    OSError when the port cannot be bound. ``server.shutdown()`` stops it."""
    server = ThreadingHTTPServer(
        (host, port), _handler({LIVENESS_PATH: liveness, READINESS_PATH: readiness}))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="hermit-http", daemon=True).start()
    return server
