"""A small HTTP(S) server built to be attacked: the turn endpoint's (hermit_node.turns.turnserver)
and the operator's key service's (hermit_operator.keyservice).

A threaded HTTP server that hands ``POST`` requests to a ``Handle`` and writes its
``Reply`` as JSON; anything but ``POST`` is 405:

- a cap on open connections, overall and per source address: one over it is closed at
  once, before a thread or a byte is spent on it;
- one deadline for the whole request (TLS handshake, request line, headers, body): a
  watchdog shuts the connection down when it passes, however slowly the bytes trickle
  (a slowloris), plus a timeout on every single read and write;
- at most ``turnlimits.MAX_HEAD_BYTES`` of request line and headers and ``max_body`` of
  body;
- TLS from a certificate and key file (re-read when the files change: a rotated Secret
  needs no restart).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

from hermit_common import turnlimits

log = logging.getLogger("hermit_common.hardhttp")


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict[str, Any]


# (path, Authorization header, body, source address) -> the reply
Handle = Callable[[str, str | None, bytes, str], Reply]
# (path, Authorization header, source address) -> a refusal, or None to read the body:
# called before the body is read, so that only admitted callers send large bodies.
Admit = Callable[[str, str | None, str], Reply | None]


class _Budget:
    """A connection's reader that gives at most ``limit`` bytes: past it, a header line
    is too long (431 from http.server) and the request line too."""

    def __init__(self, raw: BinaryIO, limit: int) -> None:
        self._raw, self.left = raw, limit

    def readline(self, size: int = -1) -> bytes:
        if self.left <= 0:
            raise http.client.LineTooLong("request head")
        size = self.left if size is None or size < 0 else min(size, self.left)
        line = self._raw.readline(size)
        self.left -= len(line)
        return line

    def read(self, size: int = -1) -> bytes:
        size = self.left if size is None or size < 0 else min(size, self.left)
        data = self._raw.read(size)
        self.left -= len(data)
        return data

    def close(self) -> None:
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class TlsFiles:
    """An SSLContext from a certificate and key file, made again when either changed."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self._stamp: tuple[float, float] | None = None
        self._context: ssl.SSLContext | None = None
        self._lock = threading.Lock()

    def context(self) -> ssl.SSLContext:
        stamp = (os.stat(self.cert_file).st_mtime, os.stat(self.key_file).st_mtime)
        with self._lock:
            if self._context is None or stamp != self._stamp:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                ctx.load_cert_chain(self.cert_file, self.key_file)
                self._context, self._stamp = ctx, stamp
            return self._context


class HardenedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 tls: TlsFiles | None = None,
                 head_timeout: float = turnlimits.HEAD_TIMEOUT_SECONDS,
                 slots: turnlimits.ConnectionSlots | None = None,
                 name: str = "endpoint") -> None:
        super().__init__(address, handler)
        self.tls, self.head_timeout, self.name = tls, head_timeout, name
        self.slots = slots if slots is not None else turnlimits.ConnectionSlots()
        self.deadlines = turnlimits.Deadlines()
        self.refused_connections = 0  # over the caps (a count for tests and logs)
        self.cut_off = 0  # closed by the watchdog
        self._local = threading.local()
        self._closing = threading.Event()
        threading.Thread(target=self._watch, name=f"hermit-{name}-watchdog",
                         daemon=True).start()

    def _watch(self) -> None:
        while not self._closing.is_set():
            for conn in self.deadlines.wait_expired(0.5):
                self.cut_off += 1
                with contextlib.suppress(OSError):  # closed meanwhile
                    conn[0].shutdown(socket.SHUT_RDWR)

    def process_request(self, request: Any, client_address: Any) -> None:
        source = str(client_address[0])
        if not self.slots.take(source):
            self.refused_connections += 1
            if self.refused_connections % 100 == 1:
                log.warning("%s: connection from %s refused: %d open (at most %d, "
                            "%d per source)", self.name, source, self.slots.open,
                            self.slots.total, self.slots.per_source)
            self.shutdown_request(request)
            return
        thread = threading.Thread(target=self._serve_one, args=(request, client_address),
                                  name=f"hermit-{self.name}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread left: as over the cap
            self.slots.give(source)
            self.shutdown_request(request)

    def _serve_one(self, request: socket.socket, client_address: Any) -> None:
        # The watchdog shuts down conn[0]: the TLS socket once there is one (wrapping
        # detaches the plain one).
        conn: list[socket.socket] = [request]
        ident = self.deadlines.arm(self.head_timeout, conn)
        self._local.deadline = ident
        try:
            request.settimeout(turnlimits.IO_TIMEOUT_SECONDS)
            if self.tls is not None:
                tls = self.tls.context().wrap_socket(request, server_side=True,
                                                     do_handshake_on_connect=False)
                conn[0] = tls
                tls.do_handshake()  # under the deadline: the watchdog can cut it off
            self.RequestHandlerClass(conn[0], client_address, self)  # type: ignore[arg-type]
        except (OSError, ValueError, http.client.HTTPException) as exc:
            log.debug("%s: connection from %s: %s", self.name, client_address[0], exc)
        finally:
            self.deadlines.disarm(ident)
            self.shutdown_request(conn[0])
            self.slots.give(str(client_address[0]))

    def request_read(self) -> bool:
        """Called by the handler once the request is read: its deadline no longer holds.
        False when it passed already (the watchdog is closing the connection)."""
        return self.deadlines.disarm(self._local.deadline)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("%s: error serving %s", self.name, client_address, exc_info=True)

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()


def handler(handle: Handle, max_body: int, usage: str,
            admit: Admit | None = None) -> type[BaseHTTPRequestHandler]:
    """The request handler: POST bodies of at most ``max_body`` bytes go to ``handle``
    (once ``admit``, when given, let the request in); a GET is answered 405 with
    ``usage``."""

    class Handler(BaseHTTPRequestHandler):
        server: HardenedHTTPServer
        timeout = turnlimits.IO_TIMEOUT_SECONDS

        def setup(self) -> None:
            super().setup()
            self.rfile = _Budget(  # type: ignore[assignment]
                self.rfile, turnlimits.MAX_HEAD_BYTES + max_body)  # type: ignore[arg-type]

        def _send(self, reply: Reply) -> None:
            body = json.dumps(reply.body, sort_keys=True).encode() + b"\n"
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if reply.status == 429:
                self.send_header("Retry-After", str(reply.body.get("retryAfterSeconds", 1)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 <= length <= max_body:
                self.server.request_read()
                self._send(Reply(413, {"error": f"the body must be at most {max_body} bytes"}))
                return
            if admit is not None:
                refused = admit(self.path, self.headers.get("Authorization"),
                                self.client_address[0])
                if refused is not None:
                    self.server.request_read()
                    self.close_connection = True  # its body is not read
                    self._send(refused)
                    return
            body = self.rfile.read(length)
            if not self.server.request_read() or len(body) != length:
                self.close_connection = True
                return  # cut off, or it hung up: nobody to answer
            self._send(handle(self.path, self.headers.get("Authorization"), body,
                              self.client_address[0]))

        def do_GET(self) -> None:
            self.server.request_read()
            self._send(Reply(405, {"error": usage}))

        def log_message(self, format: str, *args: object) -> None:
            pass  # the service logs what it decides; never a token

    return Handler


def serve(port: int, handle: Handle, *, max_body: int, usage: str, name: str,
          admit: Admit | None = None, host: str = "0.0.0.0", tls: TlsFiles | None = None,
          head_timeout: float = turnlimits.HEAD_TIMEOUT_SECONDS,
          slots: turnlimits.ConnectionSlots | None = None) -> HardenedHTTPServer:
    """Serves POST requests on ``port`` from a daemon thread; OSError when it cannot bind."""
    server = HardenedHTTPServer((host, port), handler(handle, max_body, usage, admit), tls=tls,
                                head_timeout=head_timeout, slots=slots, name=name)
    threading.Thread(target=server.serve_forever, name=f"hermit-{name}", daemon=True).start()
    return server
