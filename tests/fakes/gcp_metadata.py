"""A small real HTTP server that speaks the GCP metadata API the watcher uses.

``/computeMetadata/v1/instance/{preempted,maintenance-event}`` on 127.0.0.1:
requires ``Metadata-Flavor: Google`` (403 otherwise, and for requests carrying
``X-Forwarded-For``), answers with ``Metadata-Flavor: Google`` and an ``ETag``
(a hash of the value, as GCP does), and long-polls on
``?wait_for_change=true&last_etag=...&timeout_sec=N``: it answers at once when
``last_etag`` differs from the current ETag, else when the value changes or
after ``timeout_sec``. Tests change values with ``set()`` and inject faults
with ``fail_next()``, ``delay_next()`` and ``missing``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs, urlsplit

PREFIX = "/computeMetadata/v1/instance/"
MAX_TIMEOUT_SEC = 3600


def etag_of(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    status: int = 0  # 0 while a long-poll is still waiting


@dataclass
class _Faults:
    fail: list[tuple[str | None, int]] = field(default_factory=list)  # (name or any, status)
    delays: list[tuple[str | None, float]] = field(default_factory=list)


class GcpMetadataServer:
    def __init__(self) -> None:
        self.values: dict[str, str] = {"preempted": "FALSE", "maintenance-event": "NONE"}
        self.missing: set[str] = set()
        self.requests: list[Request] = []
        self._faults = _Faults()
        self._cond = threading.Condition()
        self._closing = False
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="fake-gcp-metadata")

    # -- control --------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> GcpMetadataServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> GcpMetadataServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def set(self, name: str, value: str) -> None:
        """Changes a value; long-polls waiting on it answer at once."""
        with self._cond:
            self.values[name] = value
            self._cond.notify_all()

    def fail_next(self, count: int = 1, status: int = 503, name: str | None = None) -> None:
        """The next ``count`` requests (for ``name``, or any) answer ``status``."""
        with self._cond:
            self._faults.fail.extend([(name, status)] * count)

    def delay_next(self, seconds: float, count: int = 1, name: str | None = None) -> None:
        """The next ``count`` requests stall ``seconds`` before answering (timeouts)."""
        with self._cond:
            self._faults.delays.extend([(name, seconds)] * count)

    def requests_for(self, name: str) -> list[Request]:
        with self._cond:
            return [r for r in self.requests if r.path == PREFIX + name]

    # -- serving --------------------------------------------------------------

    def _take(self, faults: list[tuple[str | None, int]] | list[tuple[str | None, float]],
              name: str) -> float | None:
        for i, (target, value) in enumerate(faults):
            if target is None or target == name:
                del faults[i]
                return value
        return None

    def _answer(self, req: Request) -> tuple[int, str, str | None]:
        name = req.path[len(PREFIX):] if req.path.startswith(PREFIX) else ""
        with self._cond:
            delay = self._take(self._faults.delays, name)
        if delay:
            time.sleep(delay)
        if req.headers.get("metadata-flavor") != "Google" or "x-forwarded-for" in req.headers:
            return 403, "Missing Metadata-Flavor:Google header.\n", None
        with self._cond:
            status = self._take(self._faults.fail, name)
            if status is not None:
                return int(status), "injected failure\n", None
            if name not in self.values or name in self.missing:
                return 404, "Not Found\n", None
            if req.query.get("wait_for_change", "").lower() != "true":
                value = self.values[name]
                return 200, value, etag_of(value)
            try:
                timeout = min(int(req.query.get("timeout_sec", MAX_TIMEOUT_SEC)),
                              MAX_TIMEOUT_SEC)
            except ValueError:
                return 400, "bad timeout_sec\n", None
            start_etag = req.query.get("last_etag") or etag_of(self.values[name])
            self._cond.wait_for(
                lambda: self._closing or etag_of(self.values[name]) != start_etag, timeout)
            value = self.values[name]
            return 200, value, etag_of(value)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                req = Request("GET", parts.path,
                              {k: v[-1] for k, v in parse_qs(parts.query).items()},
                              {k.lower(): v for k, v in self.headers.items()})
                with server._cond:
                    server.requests.append(req)  # recorded on arrival; status when answered
                status, body, etag = server._answer(req)
                req.status = status
                data = body.encode()
                try:
                    self.send_response(status)
                    self.send_header("Metadata-Flavor", "Google")
                    self.send_header("Content-Type", "application/text")
                    if etag is not None:
                        self.send_header("ETag", etag)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
