"""A fault-injecting EC2 instance metadata service (IMDSv2) for the fault suite.

It answers what the node-agent's AWS watcher asks (the session token, the spot
instance-action, the rebalance recommendation, the scheduled events) in the mode it is
switched to at run time:

- ``ok``: no notice (the token, then 404 for every notice path), as AEMM held back;
- ``error500``: HTTP 500 for everything, the token too;
- ``garbage``: HTTP 200 with a body that is no JSON document, the token too;
- ``broken``: bytes that are no HTTP response at all;
- ``hang``: the connection is accepted and never answered (until the mode changes or
  the server stops: then it is closed without an answer);
- ``notice``: the spot instance-action ``{"action": "terminate", "time": ...}``;
- ``cancelled``: the notice withdrawn, 404 again (``ok`` under another name, so a
  schedule reads as what it means).

Requests without a token are answered as with one (IMDSv1 is accepted). ``served``
counts the answers given per mode, so a scenario knows the watcher met its fault.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final

OK: Final = "ok"
ERROR500: Final = "error500"
GARBAGE: Final = "garbage"
BROKEN: Final = "broken"
HANG: Final = "hang"
NOTICE: Final = "notice"
CANCELLED: Final = "cancelled"
MODES: Final = (OK, ERROR500, GARBAGE, BROKEN, HANG, NOTICE, CANCELLED)
FAULTS: Final = frozenset({ERROR500, GARBAGE, BROKEN, HANG})

TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
GARBAGE_BODY = b"\x00\xff<html>not json {{{"
BROKEN_BYTES = b"\x16\x03\x01 this is no HTTP\r\n\r\n"
HANG_LIMIT_SECONDS = 300.0  # a hung answer is given up after this, whatever the mode


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


@dataclass
class State:
    """The mode, the notice's time, and how many answers each mode gave."""

    mode: str = OK
    notice_time: datetime | None = None
    served: Counter[str] = field(default_factory=Counter)
    changed: threading.Condition = field(default_factory=threading.Condition)


def answer(mode: str, method: str, path: str, notice_time: datetime | None) -> Answer:
    """What ``mode`` answers to ``method path`` (``broken`` and ``hang`` never get here)."""
    if mode == ERROR500:
        return Answer(500, b"internal error")
    if mode == GARBAGE:
        return Answer(200, GARBAGE_BODY)
    if method == "PUT":
        return Answer(200, b"faulty-imds-token") if path == TOKEN_PATH else Answer(405, b"")
    if mode == NOTICE and path == INSTANCE_ACTION_PATH:
        if notice_time is None:
            raise ValueError("the notice mode needs a notice time")
        when = notice_time.strftime("%Y-%m-%dT%H:%M:%SZ")
        return Answer(200, f'{{"action": "terminate", "time": "{when}"}}'.encode())
    return Answer(404, b"Not Found")


class _QuietServer(ThreadingHTTPServer):
    """A client that gives up on a hanging or broken answer resets its connection; that
    is the fault at work, not an error worth a traceback."""

    def handle_error(self, request: object, client_address: object) -> None:
        pass


class FaultyImds:
    """The server, in threads of this process: ``start()``, ``set(mode)``, ``stop()``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = State()
        self._server = _QuietServer((host, port), _handler(self.state))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="faulty-imds", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    def start(self) -> FaultyImds:
        self._thread.start()
        return self

    def set(self, mode: str, notice_time: datetime | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (one of {', '.join(MODES)})")
        if mode == NOTICE and notice_time is None:
            raise ValueError("the notice mode needs a notice time")
        with self.state.changed:
            self.state.mode = mode
            if notice_time is not None:
                self.state.notice_time = notice_time
            self.state.changed.notify_all()

    def served(self, *modes: str) -> int:
        with self.state.changed:
            return sum(self.state.served[m] for m in modes)

    def stop(self) -> None:
        self.set(OK)  # hung answers end
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultyImds:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._serve("GET")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def _serve(self, method: str) -> None:
            with state.changed:
                mode, when = state.mode, state.notice_time
                state.served[mode] += 1
            if mode == HANG:
                self._hang()
                return
            if mode == BROKEN:
                self.wfile.write(BROKEN_BYTES)
                self.close_connection = True
                return
            out = answer(mode, method, self.path, when)
            self.send_response(out.status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(out.body)))
            self.end_headers()
            self.wfile.write(out.body)

        def _hang(self) -> None:
            with state.changed:
                state.changed.wait_for(lambda: state.mode != HANG, HANG_LIMIT_SECONDS)
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the watcher polls every second

    return Handler
