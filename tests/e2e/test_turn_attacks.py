"""The attack suite on the cluster: a slowloris and a junk-token flood against a real
node-agent's turn endpoint (docs/turns.md#limits-of-the-endpoint), with the real API
server doing the TokenReviews.

The attacker is this test process on the host: one source address (hack/cluster's host
bridge, 10.213.0.1) posting to the node's IP and the endpoint's hostPort, as anyone on
the node network could. The legitimate caller is a harness inside the sandbox's own pod
(another address, on the cluster network) that ends a turn with a token of Hermit's
audience, with busybox ``nc`` and its time read from /proc/uptime in the pod. What the
flood cost the API server is read from the node-agent's own counter,
``hermit_node_turn_token_reviews_total`` (every TokenReview sent, none of the cache's
answers), through the API server's pod proxy.

Every request goes to a node of the local cluster only (10.213.0.0/24) and both attacks
are bounded: ``SLOW`` connections for at most ``SLOW_LIMIT_SECONDS``, ``FLOOD`` requests
within ``FLOOD_LIMIT_SECONDS``. (The API-server-audience token refused with 401 is
tests/e2e/test_turns.py's row.) The same attacks against the server on loopback, with
the TokenReview faked: tests/integration/test_turn_endpoint.py.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import re
import shlex
import socket
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hermit_common import metrics, protocol, turnlimits
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import LOCAL_CLUSTER_NODES, E2EConfig, Kube
from tests.support.attacks import CONTAINED, REFUSED, Attack

pytestmark = [pytest.mark.e2e, pytest.mark.attack, pytest.mark.timeout(900)]

LOCAL_NODES = ipaddress.ip_network(LOCAL_CLUSTER_NODES)  # hack/cluster's node network
CAP = turnlimits.MAX_CONNECTIONS_PER_SOURCE  # 16
SLOW = CAP + 8  # slow connections from the host: 8 over the per-source cap
SLOW_LIMIT_SECONDS = 30.0  # a slow connection the server never closes is dropped by us then
DEADLINE = turnlimits.HEAD_TIMEOUT_SECONDS  # 10 s: the whole request must have arrived
FLOOD = 1000
FLOOD_WORKERS = 4  # concurrent connections of the flood (under the per-source cap)
FLOOD_LIMIT_SECONDS = 120.0
PROMPT_SECONDS = 5.0  # a legitimate turn call, well under the deadline a slot would cost


@dataclass(frozen=True)
class Target:
    """A running onTurn sandbox and the turn endpoint of its node."""

    namespace: str
    name: str
    node: str
    pod: str
    ip: str
    port: int
    harness_token: str

    @property
    def path(self) -> str:
        return protocol.TURNS_PATH.format(namespace=self.namespace, name=self.name)


def _target(kube: Kube, cfg: E2EConfig, release_ns: str, ns: str) -> Target:
    sb.ensure_spot_nodes(kube, cfg, 1)
    name = f"turnatk-{uuid.uuid4().hex[:6]}"
    sb.create_sandbox(ns, name, sb.idle_turn_spec(cfg.sandbox_image))
    node, pod = sb.wait_turn_sandbox(ns, name)
    sb.wait_agent_ready(kube, release_ns, node)
    agent = sb.node_agent_pod(kube, release_ns, node)
    ip = str(agent.status.host_ip or "")
    ports = [p.host_port for c in agent.spec.containers for p in (c.ports or [])
             if p.name == "turns" and p.host_port]
    assert ports, f"the node-agent pod {agent.metadata.name} maps no turns hostPort"
    if not ip or ipaddress.ip_address(ip) not in LOCAL_NODES:
        pytest.fail(f"node {node} has IP {ip!r}, not one of the local cluster's "
                    f"({LOCAL_NODES}): these attacks are only sent to hack/cluster's nodes")
    return Target(ns, name, node, pod, ip, int(ports[0]), sb.turn_harness_token(ns))


def _legit_turn(t: Target, turn: int) -> tuple[int, dict[str, Any], float]:
    """A harness in the sandbox's pod ends ``turn``: (status, body, seconds it took,
    measured in the pod from before the connect to the end of the answer)."""
    body = json.dumps({"turn": turn})
    request = (f"POST {t.path} HTTP/1.0\r\nHost: {t.ip}:{t.port}\r\n"
               f"Authorization: Bearer {t.harness_token}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}")
    script = (f"a=$(cut -d' ' -f1 /proc/uptime); printf '%s' {shlex.quote(request)} | "
              f"timeout 30 nc -w 5 {t.ip} {t.port}; b=$(cut -d' ' -f1 /proc/uptime); "
              'echo; echo "UPTIME $a $b"')
    out = sb.exec_sh(t.namespace, t.pod, script)
    status = re.search(r"^HTTP/1\.[01] (\d{3})", out, re.MULTILINE)
    times = re.search(r"^UPTIME ([\d.]+) ([\d.]+)$", out, re.MULTILINE)
    assert status and times, f"no answer from {t.ip}:{t.port} in the pod: {out[-500:]}"
    payload = re.search(r"^\{.*\}\s*$", out, re.MULTILINE)  # the JSON answer's one line
    answer = json.loads(payload.group(0)) if payload else {}
    return int(status.group(1)), answer, float(times.group(2)) - float(times.group(1))


class Slow:
    """A slowloris connection from this host: a request line, then one header byte every
    ``gap`` s, for at most SLOW_LIMIT_SECONDS. ``closed_after``: how long the server took
    to close it (None: still open, or we gave up at the limit)."""

    def __init__(self, t: Target, gap: float = 1.0) -> None:
        self.sock = socket.create_connection((t.ip, t.port), timeout=10)
        self.opened = time.monotonic()
        self.closed_after: float | None = None
        self.sent = 0
        self._gap, self._path = gap, t.path
        self.thread = threading.Thread(target=self._drip, daemon=True)
        self.thread.start()

    def _drip(self) -> None:
        try:
            self.sock.sendall(f"POST {self._path} HTTP/1.1\r\nHost: x\r\n".encode())
            while time.monotonic() - self.opened < SLOW_LIMIT_SECONDS:
                self.sock.sendall(b"X")  # "X..." never ends its header
                self.sent += 1
                self.sock.settimeout(self._gap)
                try:
                    if self.sock.recv(1024) == b"":
                        break  # closed by the server
                except TimeoutError:
                    continue
            else:
                self.sock.close()
                return  # never closed by the server: closed_after stays None
        except OSError:
            pass  # reset by the server
        self.closed_after = time.monotonic() - self.opened
        self.sock.close()


def _agent_state(kube: Kube, release_ns: str, node: str) -> tuple[bool, int]:
    """(ready, restarts) of the node-agent on ``node``."""
    statuses = sb.node_agent_pod(kube, release_ns, node).status.container_statuses or []
    return (bool(statuses) and all(s.ready for s in statuses),
            sum(s.restart_count for s in statuses))


def _token_reviews(kube: Kube, release_ns: str, node: str) -> dict[str, float]:
    """hermit_node_turn_token_reviews_total of the node-agent on ``node``, by result."""
    text = sb.node_agent_metrics(kube, release_ns, node)
    found = {s.labels.get("result", ""): s.value
             for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == metrics.NODE_TURN_TOKEN_REVIEWS}
    if not found:
        pytest.fail(f"the node-agent on {node} exposes no {metrics.NODE_TURN_TOKEN_REVIEWS}: "
                    "its image predates the counter (hack/cluster load-images)")
    return {r: found.get(r, 0.0) for r in metrics.TOKEN_REVIEW_RESULTS}


def test_a_slowloris_from_one_address_holds_its_share_and_is_cut_off_by_the_deadline(
        kube: Kube, e2e_config: E2EConfig, hermit_release: str, namespace: str,
        attack: Attack) -> None:
    t = _target(kube, e2e_config, hermit_release, namespace)
    slow: list[Slow] = []
    try:
        slow = [Slow(t) for _ in range(SLOW)]
        # While they hold the source's slots, a harness on the cluster network ends a turn.
        status, answer, took = _legit_turn(t, 1)
        open_meanwhile = sum(1 for s in slow if s.closed_after is None)
        for s in slow:
            s.thread.join(SLOW_LIMIT_SECONDS + 5)
    finally:
        for s in slow:
            s.sock.close()
    assert (status, answer.get("decision")) == (201, protocol.TURN_FULL), (status, answer)
    assert took < PROMPT_SECONDS, f"the legitimate turn call took {took:.2f} s"
    assert open_meanwhile >= CAP, \
        f"only {open_meanwhile} slow connections were still open when the turn was served"
    lasted = sorted(s.closed_after if s.closed_after is not None else float("inf")
                    for s in slow)
    over, held = lasted[:SLOW - CAP], lasted[SLOW - CAP:]
    # One address gets CAP connections; the ones over it are closed at once.
    assert all(x < 2.0 for x in over), f"connections over the cap were kept: {lasted}"
    # The rest trickled a byte a second until the request deadline cut them off.
    assert all(DEADLINE - 1.0 <= x <= DEADLINE + 3.0 for x in held), \
        f"the held connections were not cut off at the {DEADLINE:g} s deadline: {lasted}"
    assert min(s.sent for s in slow if (s.closed_after or 0) >= DEADLINE - 1.0) >= 5
    ready, _ = _agent_state(kube, hermit_release, t.node)
    assert ready, f"the node-agent on {t.node} is not Ready after the slowloris"
    print(f"slowloris on {t.ip}:{t.port} ({t.node}): {SLOW} slow connections from this host; "
          f"{SLOW - CAP} closed after {max(over):.2f} s at most, {CAP} cut off after "
          f"{min(held):.1f}-{max(held):.1f} s; the pod's turn call answered {status} in "
          f"{took:.2f} s while {open_meanwhile} were open")
    attack.record(
        "turn endpoint: slowloris (cluster)",
        tried=f"{SLOW} connections from one host address to a node-agent's hostPort "
              f"({t.ip}:{t.port}), each sending a header byte a second",
        outcome=CONTAINED,
        evidence=f"{SLOW - CAP} over the {CAP}-per-source cap closed within "
                 f"{max(over):.2f} s; the {CAP} held cut off after {min(held):.1f}-"
                 f"{max(held):.1f} s (deadline {DEADLINE:g} s); meanwhile a harness in the "
                 f"sandbox's pod ended a turn: {status} in {took:.2f} s")


def test_a_junk_token_flood_is_rate_limited_and_costs_few_token_reviews(
        kube: Kube, e2e_config: E2EConfig, hermit_release: str, namespace: str,
        attack: Attack) -> None:
    t = _target(kube, e2e_config, hermit_release, namespace)
    _, restarts_before = _agent_state(kube, hermit_release, t.node)
    before = _token_reviews(kube, hermit_release, t.node)
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    started = time.monotonic()

    def flood(worker: int) -> None:
        for _ in range(worker, FLOOD, FLOOD_WORKERS):
            if time.monotonic() - started > FLOOD_LIMIT_SECONDS:
                return
            conn = http.client.HTTPConnection(t.ip, t.port, timeout=10)
            try:
                conn.request("POST", t.path, body=b'{"turn": 1}', headers={
                    "Authorization": f"Bearer junk-{uuid.uuid4().hex}",
                    "Content-Type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                with lock:
                    statuses[resp.status] += 1
            except (OSError, http.client.HTTPException) as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                conn.close()

    workers = [threading.Thread(target=flood, args=(w,)) for w in range(FLOOD_WORKERS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(FLOOD_LIMIT_SECONDS + 15)
    elapsed = time.monotonic() - started
    after = _token_reviews(kube, hermit_release, t.node)
    spent = {r: after[r] - before[r] for r in after}
    assert not errors, f"{len(errors)} flood requests failed: {errors[:5]}"
    assert sum(statuses.values()) == FLOOD, f"the flood did not finish: {dict(statuses)}"
    assert set(statuses) <= {401, 429}, dict(statuses)
    # The source's bucket: its burst, then its rate; everything else is 429 before any
    # TokenReview, and each token let through (all distinct) costs exactly one.
    allowed = turnlimits.SOURCE_BURST + turnlimits.SOURCE_RATE * elapsed + 1
    assert statuses[401] <= allowed, (dict(statuses), allowed)
    assert statuses[429] >= FLOOD - allowed, (dict(statuses), allowed)
    assert statuses[429] > FLOOD // 2, f"most of the flood should be 429: {dict(statuses)}"
    assert spent == {metrics.TOKEN_REVIEW_AUTHENTICATED: 0,
                     metrics.TOKEN_REVIEW_UNAUTHENTICATED: statuses[401],
                     metrics.TOKEN_REVIEW_ERROR: 0}, (spent, dict(statuses))
    ready, restarts = _agent_state(kube, hermit_release, t.node)
    assert ready and restarts == restarts_before, \
        f"the node-agent on {t.node}: ready={ready}, restarts {restarts_before} -> {restarts}"
    # The harness, from its own address, is served right after.
    status, answer, took = _legit_turn(t, 1)
    assert (status, answer.get("decision")) == (201, protocol.TURN_FULL), (status, answer)
    assert took < PROMPT_SECONDS, f"the legitimate turn call took {took:.2f} s"
    served = _token_reviews(kube, hermit_release, t.node)
    assert served[metrics.TOKEN_REVIEW_AUTHENTICATED] - after[
        metrics.TOKEN_REVIEW_AUTHENTICATED] == 1, (after, served)
    ready, restarts = _agent_state(kube, hermit_release, t.node)
    assert ready and restarts == restarts_before
    print(f"junk-token flood on {t.ip}:{t.port} ({t.node}): {FLOOD} requests with distinct "
          f"junk tokens from this host in {elapsed:.1f} s -> {dict(statuses)}; TokenReviews "
          f"sent {spent}; node-agent Ready, {restarts} restarts; the pod's turn call "
          f"answered {status} in {took:.2f} s")
    attack.record(
        "turn endpoint: junk-token flood (cluster)",
        tried=f"{FLOOD} requests with distinct junk bearer tokens from one host address to a "
              f"node-agent's hostPort ({t.ip}:{t.port}), {FLOOD_WORKERS} at a time",
        outcome=REFUSED,
        evidence=f"in {elapsed:.1f} s: {statuses[429]} got 429, {statuses[401]} got 401; "
                 f"{int(spent[metrics.TOKEN_REVIEW_UNAUTHENTICATED])} TokenReviews sent "
                 f"(hermit_node_turn_token_reviews_total); node-agent Ready, no restart; a "
                 f"harness in the sandbox's pod then ended a turn: {status} in {took:.2f} s")
