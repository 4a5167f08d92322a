"""A small real HTTP server that speaks Azure IMDS Scheduled Events.

``GET /metadata/scheduledevents?api-version=...`` on 127.0.0.1 requires the
``Metadata: true`` header and an ``api-version`` (400 with Azure's error
document otherwise; 400 too for ``X-Forwarded-For``), and returns
``{"DocumentIncarnation": n, "Events": [...]}``; every change increments the
incarnation. ``POST`` with ``{"StartRequests": [{"EventId": ...}]}`` records
the acknowledgment and starts the event (status Started, empty NotBefore).
``/metadata/instance/compute/name?format=text`` serves ``vm_name``.
Faults: ``fail_next()``, ``delay_next()``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

EVENTS_PATH = "/metadata/scheduledevents"
NAME_PATH = "/metadata/instance/compute/name"


def http_date(when: datetime) -> str:
    return format_datetime(when.astimezone(UTC), usegmt=True)


class AzureEventsServer:
    def __init__(self, vm_name: str | None = "hermit-vm-0") -> None:
        self.vm_name = vm_name
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        self.acks: list[str] = []
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self._fail: list[int] = []
        self._delays: list[float] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="fake-azure-events")

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> AzureEventsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> AzureEventsServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- control --------------------------------------------------------------

    def add_event(self, event_type: str = "Preempt", *, not_before: datetime | None = None,
                  resources: list[str] | None = None, event_id: str | None = None,
                  status: str = "Scheduled") -> str:
        """Schedules an event (Preempt: NotBefore 30 s from now unless given)."""
        event_id = event_id or str(uuid.uuid4()).upper()
        when = not_before or datetime.now(UTC) + timedelta(seconds=30)
        with self._lock:
            self.events.append({
                "EventId": event_id,
                "EventStatus": status,
                "EventType": event_type,
                "ResourceType": "VirtualMachine",
                "Resources": resources if resources is not None else [self.vm_name or "vm"],
                "NotBefore": http_date(when),
                "Description": "",
                "EventSource": "Platform",
                "DurationInSeconds": -1 if event_type == "Preempt" else 10,
            })
            self.incarnation += 1
        return event_id

    def clear(self) -> None:
        with self._lock:
            self.events.clear()
            self.incarnation += 1

    def fail_next(self, count: int = 1, status: int = 503) -> None:
        with self._lock:
            self._fail.extend([status] * count)

    def delay_next(self, seconds: float, count: int = 1) -> None:
        with self._lock:
            self._delays.extend([seconds] * count)

    def document(self) -> dict[str, Any]:
        with self._lock:
            return {"DocumentIncarnation": self.incarnation,
                    "Events": [dict(e) for e in self.events]}

    # -- serving --------------------------------------------------------------

    def _check(self, path: str, query: dict[str, str],
               headers: dict[str, str]) -> tuple[int, Any] | None:
        with self._lock:
            delay = self._delays.pop(0) if self._delays else 0.0
        if delay:
            time.sleep(delay)
        if headers.get("metadata") != "true":
            return 400, {"error": "Bad request. Required metadata header not specified"}
        if "x-forwarded-for" in headers:
            return 400, {"error": "Bad request. Request contains X-Forwarded-For header"}
        if "api-version" not in query:
            return 400, {"error": "Bad request. api-version was not specified in the request"}
        with self._lock:
            if self._fail:
                return self._fail.pop(0), {"error": "injected failure"}
        if path not in (EVENTS_PATH, NAME_PATH):
            return 404, {"error": "Not found"}
        return None

    def _get(self, path: str) -> tuple[int, Any]:
        if path == NAME_PATH:
            return (200, self.vm_name) if self.vm_name else (404, {"error": "Not found"})
        return 200, self.document()

    def _post(self, body: bytes) -> tuple[int, Any]:
        try:
            doc = json.loads(body or b"{}")
            ids = [str(item["EventId"]) for item in doc["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            return 400, {"error": "Bad request. StartRequests is malformed"}
        with self._lock:
            known = {e["EventId"]: e for e in self.events}
            if any(i not in known for i in ids):
                return 400, {"error": "Bad request. Unknown EventId"}
            for i in ids:
                self.acks.append(i)
                known[i]["EventStatus"] = "Started"
                known[i]["NotBefore"] = ""
            self.incarnation += 1
        return 200, None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                headers = {k.lower(): v for k, v in self.headers.items()}
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                answer = server._check(parts.path, query, headers)
                if answer is None:
                    if method == "GET":
                        answer = server._get(parts.path)
                    elif parts.path == EVENTS_PATH:
                        answer = server._post(body)
                    else:
                        answer = (405, {"error": "Method not allowed"})
                status, payload = answer
                with server._lock:
                    server.requests.append((method, parts.path, status))
                if isinstance(payload, str) and query.get("format") == "text":
                    data, ctype = payload.encode(), "text/plain; charset=utf-8"
                else:
                    data = b"" if payload is None else json.dumps(payload).encode()
                    ctype = "application/json; charset=utf-8"
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
