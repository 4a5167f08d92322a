"""The operator's liveness and readiness: pure functions of its role, its Lease loop's
heartbeats and kopf's answer; the recorder; and the Lease loop's turns."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from hermit_operator import health
from hermit_operator.health import (
    KOPF_START_GRACE_SECONDS,
    LEADING,
    LEASE_ANSWER_FRESH_SECONDS,
    LEASE_LOOP_STALE_SECONDS,
    STANDBY,
    STARTING,
    OperatorHealth,
    OperatorState,
    kopf_answers,
    liveness,
    readiness,
)
from hermit_operator.leader import LeaseElector

T0 = 1000.0


def standby(now_age: float = 1.0, answered_age: float | None = 1.0) -> OperatorState:
    return OperatorState(STANDBY, True, T0, lease_turn=T0 + 100 - now_age,
                         lease_answer=None if answered_age is None else T0 + 100 - answered_age)


# -- liveness ---------------------------------------------------------------------------

def test_a_starting_operator_is_live_but_not_ready() -> None:
    state = OperatorState(STARTING, True, T0)
    assert liveness(state, T0 + 5, None).ok
    assert not readiness(state, T0 + 5, None).ok


def test_a_standby_is_live_while_its_lease_loop_turns_whatever_the_api_says() -> None:
    # The API server has not answered for minutes: still live (not ready, below).
    state = standby(now_age=2, answered_age=600)
    verdict = liveness(state, T0 + 100, None)
    assert verdict.ok and "standing by" in verdict.reason
    stuck = standby(now_age=LEASE_LOOP_STALE_SECONDS + 1)
    verdict = liveness(stuck, T0 + 100, None)
    assert not verdict.ok and "has not turned" in verdict.reason


def test_a_standby_that_never_turned_counts_from_when_it_began_standing_by() -> None:
    state = OperatorState(STANDBY, True, T0)
    assert liveness(state, T0 + LEASE_LOOP_STALE_SECONDS - 1, None).ok
    assert not liveness(state, T0 + LEASE_LOOP_STALE_SECONDS + 1, None).ok


def test_the_leader_is_live_per_kopf() -> None:
    state = OperatorState(LEADING, True, T0, lease_turn=T0 + 99, lease_answer=T0 + 99,
                          kopf_answered=True)
    assert liveness(state, T0 + 100, True).ok
    verdict = liveness(state, T0 + 100, False)
    assert not verdict.ok and "kopf" in verdict.reason


def test_kopf_gets_a_grace_to_start_but_only_before_it_first_answered() -> None:
    starting = OperatorState(LEADING, False, T0)
    assert liveness(starting, T0 + KOPF_START_GRACE_SECONDS - 1, False).ok
    assert not liveness(starting, T0 + KOPF_START_GRACE_SECONDS + 1, False).ok
    answered_before = OperatorState(LEADING, False, T0, kopf_answered=True)
    assert not liveness(answered_before, T0 + 5, False).ok


def test_a_leader_whose_renewal_loop_is_stuck_is_not_live() -> None:
    state = OperatorState(LEADING, True, T0, lease_turn=T0, lease_answer=T0,
                          kopf_answered=True)
    assert not liveness(state, T0 + LEASE_LOOP_STALE_SECONDS + 1, True).ok
    # Without leader election there is no Lease loop to judge.
    alone = OperatorState(LEADING, False, T0, kopf_answered=True)
    assert liveness(alone, T0 + 10_000, True).ok


# -- readiness --------------------------------------------------------------------------

def test_a_standby_is_ready_while_the_api_server_answers_its_lease_loop() -> None:
    verdict = readiness(standby(answered_age=3), T0 + 100, None)
    assert verdict.ok and "take over" in verdict.reason
    verdict = readiness(standby(answered_age=LEASE_ANSWER_FRESH_SECONDS + 1), T0 + 100, None)
    assert not verdict.ok and "has not answered" in verdict.reason
    verdict = readiness(standby(answered_age=None), T0 + 100, None)
    assert not verdict.ok and "yet" in verdict.reason


def test_the_leader_is_ready_when_kopf_runs() -> None:
    state = OperatorState(LEADING, True, T0, lease_turn=T0 + 99, lease_answer=T0 + 99)
    assert readiness(state, T0 + 100, True).ok
    assert not readiness(state, T0 + 100, False).ok
    alone = OperatorState(LEADING, False, T0)
    assert readiness(alone, T0 + 100, True).ok


# -- the recorder -----------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def test_the_recorder_follows_the_roles_and_asks_kopf_only_when_leading() -> None:
    clock = Clock()
    asked: list[bool] = []

    def kopf() -> bool:
        asked.append(True)
        return True

    rec = OperatorHealth(True, kopf_probe=kopf, clock=clock)
    assert rec.liveness().ok and not rec.readiness().ok  # starting
    rec.standing_by()
    clock.now += 5
    rec.lease_turn(answered=False)  # the API is away: live, not ready
    assert rec.liveness().ok and not rec.readiness().ok
    rec.lease_turn(answered=True)
    assert rec.readiness().ok and asked == []
    rec.leading()
    assert rec.liveness().ok and rec.readiness().ok
    assert len(asked) == 2 and rec.state().kopf_answered


def test_kopf_answers_asks_an_http_endpoint_without_a_proxy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # would fail if it were used

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert kopf_answers(f"http://127.0.0.1:{port}/healthz")
    finally:
        server.shutdown()
        server.server_close()
    assert not kopf_answers(f"http://127.0.0.1:{port}/healthz", timeout=1)  # closed now
    assert health.KOPF_LIVENESS_ENDPOINT.startswith("http://127.0.0.1:")  # loopback only


# -- the Lease loop's turns -------------------------------------------------------------

class UnreachableApi:
    """A CoordinationV1Api whose server never answers (as urllib3 reports it)."""

    def read_namespaced_lease(self, *args: Any, **kwargs: Any) -> Any:
        raise urllib3.exceptions.MaxRetryError(None, "/apis", "connection refused")  # type: ignore[arg-type]


class LeaseApi:
    """A CoordinationV1Api that holds one Lease in memory."""

    def __init__(self, holder: str | None) -> None:
        self.holder = holder

    def read_namespaced_lease(self, *args: Any, **kwargs: Any) -> Any:
        if self.holder is None:
            raise ApiException(status=404)
        return {"metadata": {"name": "l", "resourceVersion": "1"},
                "spec": {"holderIdentity": self.holder, "leaseDurationSeconds": 15,
                         "renewTime": "2999-01-01T00:00:00.000000Z"}}

    def create_namespaced_lease(self, namespace: str, body: Any, **kwargs: Any) -> None:
        self.holder = body["spec"]["holderIdentity"]

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any,
                                 **kwargs: Any) -> None:
        self.holder = body["spec"]["holderIdentity"]


def test_a_standby_turns_and_reports_whether_the_api_answered() -> None:
    turns: list[bool] = []
    stop = threading.Event()
    elector = LeaseElector(UnreachableApi(), "ns", "l", "me",  # type: ignore[arg-type]
                           renew_seconds=0.01, on_turn=lambda ok: (
                               turns.append(ok), len(turns) >= 3 and stop.set()))
    elector.acquire(stop)
    assert turns[:3] == [False, False, False]
    turns.clear()
    held = LeaseElector(LeaseApi(None), "ns", "l", "me",  # type: ignore[arg-type]
                        renew_seconds=0.01, on_turn=turns.append)
    held.acquire()
    assert turns == [True]


def test_a_leader_that_cannot_reach_the_api_gives_the_lease_up_instead_of_dying() -> None:
    # urllib3's MaxRetryError is no OSError: the renewal thread once died of it silently
    # and the replica went on reconciling without the Lease.
    api = LeaseApi(None)
    turns: list[bool] = []
    lost = threading.Event()
    elector = LeaseElector(api, "ns", "l", "me", renew_seconds=0.01,  # type: ignore[arg-type]
                           lease_seconds=1, on_turn=turns.append)
    elector.acquire()
    api.read_namespaced_lease = UnreachableApi().read_namespaced_lease  # type: ignore[method-assign]
    thread = elector.keep(on_lost=lost.set)
    assert lost.wait(5), "the Lease was never given up"
    thread.join(5)
    assert not thread.is_alive()
    assert turns[0] is True and turns[-1] is False
