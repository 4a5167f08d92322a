"""The node-agent's liveness and readiness: pure functions of its heartbeats, the
recorder, and the watcher's session that beats after every metadata request."""

from __future__ import annotations

import socket
import threading

import pytest
import requests

from hermit_common.health import Heartbeats
from hermit_node.control.health import (
    API,
    API_FRESH_SECONDS,
    LOOP,
    LOOP_STALE_SECONDS,
    WATCHER,
    WATCHER_STALE_SECONDS,
    AgentHealth,
    AgentState,
    BeatingSession,
    liveness,
    readiness,
)

T0 = 1000.0
INTERVAL = 2.0


def running(now: float, **changes: object) -> AgentState:
    """An agent whose loops all beat a second before ``now``."""
    fields: dict[str, object] = dict(
        started=T0, reconcile_interval=INTERVAL, loop=now - 1, watcher_started=True,
        watcher_alive=True, watcher_polls=True, watcher=now - 1, api=now - 1)
    fields.update(changes)
    return AgentState(**fields)  # type: ignore[arg-type]


def test_a_running_agent_is_live_and_ready() -> None:
    now = T0 + 500
    assert liveness(running(now), now).ok
    assert readiness(running(now), now).ok


def test_a_fresh_agent_is_live_before_its_first_beats_but_not_ready() -> None:
    fresh = AgentState(started=T0, reconcile_interval=INTERVAL)
    assert liveness(fresh, T0 + 30).ok
    verdict = readiness(fresh, T0 + 30)
    assert not verdict.ok and "watcher" in verdict.reason
    watching = AgentState(started=T0, reconcile_interval=INTERVAL, watcher_started=True,
                          watcher_alive=True)
    verdict = readiness(watching, T0 + 30)
    assert not verdict.ok and "has not answered the main loop yet" in verdict.reason


def test_a_stuck_main_loop_is_not_live() -> None:
    now = T0 + 1000
    limit = LOOP_STALE_SECONDS + INTERVAL
    assert liveness(running(now, loop=now - limit + 1), now).ok
    verdict = liveness(running(now, loop=now - limit - 1), now)
    assert not verdict.ok and "main loop" in verdict.reason


def test_a_stuck_or_dead_watcher_is_not_live() -> None:
    now = T0 + 1000
    assert liveness(running(now, watcher=now - WATCHER_STALE_SECONDS + 1), now).ok
    verdict = liveness(running(now, watcher=now - WATCHER_STALE_SECONDS - 1), now)
    assert not verdict.ok and "watcher" in verdict.reason
    verdict = liveness(running(now, watcher_alive=False), now)
    assert not verdict.ok and "thread ended" in verdict.reason
    assert not readiness(running(now, watcher_alive=False), now).ok


def test_the_none_provider_makes_no_requests_and_is_judged_by_its_thread() -> None:
    now = T0 + 1000
    assert liveness(running(now, watcher_polls=False, watcher=None), now).ok


def test_an_unreachable_api_server_fails_readiness_but_never_liveness() -> None:
    now = T0 + 10_000
    state = running(now, api=now - API_FRESH_SECONDS - INTERVAL - 1)
    assert liveness(state, now).ok
    verdict = readiness(state, now)
    assert not verdict.ok and "Kubernetes API" in verdict.reason


def test_a_stopping_agent_stays_live_while_its_jobs_finish_and_is_not_ready() -> None:
    now = T0 + 10_000
    state = running(now, stopping=True, loop=T0, watcher=T0)
    assert liveness(state, now).ok
    assert not readiness(state, now).ok


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def test_the_recorder_reads_its_heartbeats_and_the_watcher_thread() -> None:
    clock = Clock()
    stop = threading.Event()
    rec = AgentHealth(INTERVAL, stopping=stop, beats=Heartbeats(clock))
    assert rec.liveness().ok and not rec.readiness().ok
    thread = threading.Thread(target=stop.wait)
    rec.watching(thread)
    thread.start()
    rec.watcher_started()
    clock.now += 10
    for name in (LOOP, WATCHER, API):
        rec.beats.beat(name)
    assert rec.liveness().ok and rec.readiness().ok
    stop.set()
    thread.join()
    state = rec.state()
    assert state.stopping and not state.watcher_alive
    assert rec.liveness().ok and not rec.readiness().ok


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_the_watcher_session_beats_after_every_request_even_a_failed_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # never used: trust_env is off
    clock = Clock()
    rec = AgentHealth(INTERVAL, beats=Heartbeats(clock))
    session = rec.metadata_session()
    assert isinstance(session, BeatingSession) and session.trust_env is False
    assert rec.beats.last(WATCHER) is None
    clock.now += 3
    with pytest.raises(requests.ConnectionError):
        session.get(f"http://127.0.0.1:{_closed_port()}/latest/api/token", timeout=2)
    assert rec.beats.last(WATCHER) == T0 + 3
