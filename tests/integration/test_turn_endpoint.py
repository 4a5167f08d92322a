"""Attacks on the turn endpoint, performed for real against the real server on loopback
(docs/turns.md#limits-of-the-endpoint): a slowloris, a junk-token flood, and TLS.

The TokenReview is the one thing faked: it sits behind the narrow ``TurnKube`` adapter,
and counting its calls is the point (the e2e tier reviews tokens with the real API).
Sources are distinct loopback addresses (127.0.0.0/8 is all local on Linux)."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from hermit_common import turnlimits
from hermit_common.turns import TurnClient
from hermit_node.turns import turnserver
from tests.support.attacks import CONTAINED, REFUSED, Attack
from tests.support.tls import self_signed
from tests.support.turns import PATH, FakeKube, service, snap
from tests.support.wait import wait_until

LEGIT = "127.0.0.1"
HEAD_TIMEOUT = 3.0  # the test server's request deadline (the default is 10 s)


class CountingKube(FakeKube):
    """The fake API, counting TokenReviews (thread-safe: the server is threaded)."""

    def __init__(self) -> None:
        super().__init__()
        self.token_reviews = 0
        self._count_lock = threading.Lock()

    def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
        with self._count_lock:
            self.token_reviews += 1
        time.sleep(0.002)  # an API round trip, so concurrent requests overlap
        return super().review_token(token, audiences)


@pytest.fixture
def endpoint() -> Iterator[tuple[turnserver.TurnHTTPServer, CountingKube]]:
    kube = CountingKube()
    svc = service(kube, [snap() for _ in range(50)])
    server = turnserver.serve(0, svc, host="127.0.0.1", head_timeout=HEAD_TIMEOUT)
    try:
        yield server, kube
    finally:
        server.shutdown()
        server.server_close()


def _post(port: int, token: str, turn: int = 1, source: str = LEGIT,
          timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0))
    try:
        conn.request("POST", PATH, body=json.dumps({"turn": turn}),
                     headers={"Authorization": f"Bearer {token}",
                              "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


class Slow:
    """A slowloris connection: a request line, then one header byte every ``gap`` s.
    ``closed_after`` is how long the server took to close it (None: still open)."""

    def __init__(self, port: int, source: str, gap: float = 1.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30,
                                             source_address=(source, 0))
        self.opened = time.monotonic()
        self.closed_after: float | None = None
        self.accepted_bytes = 0
        self._gap = gap
        self.thread = threading.Thread(target=self._drip, daemon=True)
        self.thread.start()

    def _drip(self) -> None:
        try:
            self.sock.sendall(f"POST {PATH} HTTP/1.1\r\nHost: x\r\n".encode())
            while True:
                self.sock.sendall(b"X")  # "X-..." never ends its header
                self.accepted_bytes += 1
                self.sock.settimeout(self._gap)
                try:
                    if self.sock.recv(1024) == b"":
                        break  # closed by the server
                except TimeoutError:
                    continue
        except OSError:
            pass  # reset by the server
        self.closed_after = time.monotonic() - self.opened
        self.sock.close()


@pytest.mark.attack
def test_a_slowloris_does_not_block_a_legitimate_caller_and_is_cut_off(
        endpoint: tuple[turnserver.TurnHTTPServer, CountingKube], attack: Attack) -> None:
    server, kube = endpoint
    port = server.server_address[1]
    # 60 slow connections from 60 addresses, and 40 more from one address (its own cap).
    slow = [Slow(port, f"127.0.1.{i + 1}") for i in range(60)]
    crowd = [Slow(port, "127.0.2.1") for _ in range(40)]
    wait_until("the slow connections opened", 10,
               lambda: server.slots.open >= 60 + turnlimits.MAX_CONNECTIONS_PER_SOURCE, 0.01)
    # While they hold their connections, the legitimate caller is served at once.
    started = time.monotonic()
    status, body = _post(port, "good")
    served_in = time.monotonic() - started
    assert (status, body.get("checkpoint")) == (201, "box-1-turn1"), body
    assert served_in < 2.0, f"the legitimate caller waited {served_in:.1f} s"
    # One address gets its share of connections, not the endpoint's.
    wait_until("the crowd's extra connections closed", 5, lambda: len(
        [s for s in crowd if s.closed_after is not None]) >= 40 -
        turnlimits.MAX_CONNECTIONS_PER_SOURCE, 0.01)
    over = [s for s in crowd if s.closed_after is not None]
    assert len(over) >= 40 - turnlimits.MAX_CONNECTIONS_PER_SOURCE
    assert server.refused_connections >= 40 - turnlimits.MAX_CONNECTIONS_PER_SOURCE
    # Every slow connection is closed by the deadline, however slowly it kept sending.
    for s in slow + crowd:
        s.thread.join(HEAD_TIMEOUT + 5)
    lasted = [s.closed_after for s in slow + crowd]
    assert all(t is not None and t < HEAD_TIMEOUT + 2.0 for t in lasted), lasted
    assert all(s.closed_after is not None and s.closed_after >= HEAD_TIMEOUT - 0.5
               for s in slow), "a connection was closed before its deadline"
    assert server.cut_off >= 60 + turnlimits.MAX_CONNECTIONS_PER_SOURCE - 1
    wait_until("every slot given back", 5, lambda: server.slots.open == 0, 0.01)
    print(f"slowloris: {len(slow) + len(crowd)} slow connections, legitimate caller served "
          f"in {served_in * 1000:.0f} ms, {server.refused_connections} refused over the "
          f"caps, {server.cut_off} cut off after at most {max(t or 0 for t in lasted):.1f} s; "
          f"{kube.token_reviews} TokenReview(s)")
    attack.record("turn endpoint: slowloris", tried=f"{len(slow)} slow connections from 60 "
                  f"addresses and {len(crowd)} from one, a byte at a time, against the real "
                  "turn server", outcome=CONTAINED,
                  evidence=f"a legitimate caller served in {served_in * 1000:.0f} ms meanwhile; "
                           f"{server.refused_connections} refused over the per-source cap; every "
                           f"slow one cut off within {max(t or 0 for t in lasted):.1f} s")


@pytest.mark.attack
def test_a_junk_token_flood_costs_a_bounded_number_of_token_reviews(
        endpoint: tuple[turnserver.TurnHTTPServer, CountingKube], attack: Attack) -> None:
    server, kube = endpoint
    port = server.server_address[1]
    started = time.monotonic()
    # 2000 requests with distinct junk tokens from one address, 4 at a time.
    statuses: dict[int, int] = {}
    lock = threading.Lock()

    def flood(worker: int) -> None:
        for i in range(500):
            status, _ = _post(port, f"junk-{worker}-{i}", source="127.0.3.1")
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

    workers = [threading.Thread(target=flood, args=(w,)) for w in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    elapsed = time.monotonic() - started
    assert sum(statuses.values()) == 2000, statuses
    allowed = turnlimits.SOURCE_BURST + turnlimits.SOURCE_RATE * elapsed + 1
    assert kube.token_reviews <= allowed, (kube.token_reviews, allowed, statuses)
    assert statuses.get(429, 0) >= 2000 - allowed, statuses
    assert set(statuses) <= {401, 429}, statuses
    distinct_reviews = kube.token_reviews

    # The same junk token from 50 addresses, 40 times each: one TokenReview for all.
    same: dict[int, int] = {}
    for i in range(2000):
        status, _ = _post(port, "junk-same", source=f"127.0.4.{i % 50 + 1}")
        same[status] = same.get(status, 0) + 1
    assert same.get(401, 0) + same.get(429, 0) == 2000, same
    same_reviews = kube.token_reviews - distinct_reviews
    assert same_reviews <= 1, kube.token_reviews

    # The legitimate caller, from its own address, is still served.
    status, body = _post(port, "good")
    assert status == 201, body
    print(f"junk-token flood: 2000 distinct tokens from one address in {elapsed:.1f} s -> "
          f"{statuses} and {distinct_reviews} TokenReviews; 2000 of one token from 50 "
          f"addresses -> {same} and {same_reviews} TokenReview")
    attack.record("turn endpoint: junk-token flood", tried="2000 distinct junk tokens from one "
                  "address, then one junk token 2000 times from 50 addresses (TokenReviews "
                  "counted at the Kubernetes adapter)", outcome=REFUSED,
                  evidence=f"{statuses} costing {distinct_reviews} TokenReviews; {same} "
                           f"costing {same_reviews}; the legitimate caller still served")


def test_oversized_heads_and_bodies_are_refused(
        endpoint: tuple[turnserver.TurnHTTPServer, CountingKube]) -> None:
    server, kube = endpoint
    port = server.server_address[1]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"POST {PATH} HTTP/1.1\r\n".encode())
        try:
            for _ in range(64):  # 64 KiB of headers: twice the budget
                sock.sendall(b"X-Pad: " + b"a" * 1016 + b"\r\n")
        except OSError:
            pass  # the server hung up first
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.0 431") or answer == b"", answer
    big = requests.post(f"http://127.0.0.1:{port}{PATH}", data=b"x" * 5000, timeout=10,
                        headers={"Authorization": "Bearer good"})
    assert big.status_code == 413
    assert kube.token_reviews == 0


class _FixedEndpoint(TurnClient):
    def __init__(self, url: str, **kw: Any) -> None:
        super().__init__(**kw)
        self._url = url

    def endpoint(self, namespace: str, sandbox: str) -> str:
        return self._url


def test_tls_serves_turns_and_a_slow_handshake_is_cut_off(tmp_path: Path) -> None:
    cert_file, key_file = self_signed(tmp_path, "turns.hermit.internal")
    kube = CountingKube()
    server = turnserver.serve(0, service(kube, [snap(), snap()]), host="127.0.0.1",
                              tls=turnserver.TlsFiles(str(cert_file), str(key_file)),
                              head_timeout=HEAD_TIMEOUT)
    port = server.server_address[1]
    try:
        url = f"https://127.0.0.1:{port}{PATH}"
        ok = requests.post(url, json={"turn": 1}, headers={"Authorization": "Bearer good"},
                           verify=str(cert_file), timeout=10)
        assert ok.status_code == 201, ok.text
        # TurnClient over TLS, verifying the certificate's name rather than the IP.
        client = _FixedEndpoint(url.replace("127.0.0.1", "localhost"), token="good",
                                tls=True, ca_file=str(cert_file),
                                server_name="turns.hermit.internal")
        assert client.turn_ended("agents", "box", 2).decision == "full"
        # Plain HTTP on the TLS port gets no answer; an unverified certificate fails.
        with pytest.raises(requests.ConnectionError):
            requests.post(url.replace("https", "http"), json={"turn": 3}, timeout=10,
                          headers={"Authorization": "Bearer good"})
        with pytest.raises(requests.exceptions.SSLError):
            requests.post(url, json={"turn": 3}, timeout=10)
        # A client that opens a connection and never completes the handshake is cut off.
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(b"\x16\x03")  # the start of a ClientHello, and nothing more
            try:
                gone = sock.recv(1024)
            except OSError:
                gone = b""
        assert gone == b"" and time.monotonic() - started < HEAD_TIMEOUT + 2.0
        assert kube.token_reviews == 1  # the second turn's token came from the cache
        with pytest.raises(ssl.SSLError):
            ctx = ssl.create_default_context(cafile=str(cert_file))
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                    ctx.wrap_socket(raw, server_hostname="someone.else") as tls:
                tls.sendall(b"GET / HTTP/1.0\r\n\r\n")
    finally:
        server.shutdown()
        server.server_close()
