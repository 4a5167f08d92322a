"""Liveness and readiness of the node-agent.

Three heartbeats (``hermit_common.health.Heartbeats``, monotonic seconds):

- ``loop``: the main loop finished a reconcile (whatever the API server answered);
- ``watcher``: the interruption watcher made a metadata request (answered or not:
  ``BeatingSession`` beats after every request);
- ``api``: the main loop turned with every watch of its node's objects listed and open,
  none failing (the API server answers; ``informer.WatchedNode.healthy``).

Liveness (``/healthz``) never depends on the API server or the metadata service being
reachable: the main loop and the watcher must have beaten within their limits. The
limits are long on purpose (``LOOP_STALE_SECONDS``): a reconcile against an API server
that accepts connections but never answers waits out its request timeouts (up to
about 140 s per call with urllib3's retries), and a checkpoint never blocks either loop
(jobs run in their own threads). A stopping agent (SIGTERM) is live: it waits for its
running checkpoints and restores, up to its terminationGracePeriodSeconds.

Readiness (``/readyz``) means the agent can do its job: the watcher runs and the API
server answered the main loop within ``API_FRESH_SECONDS``. ``liveness`` and
``readiness`` are pure.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import requests

from hermit_common.health import Heartbeats, Verdict, age

LOOP: Final = "loop"
WATCHER: Final = "watcher"
API: Final = "api"

# The main loop or the watcher is stuck when it has not beaten for this long (plus the
# reconcile interval for the loop).
LOOP_STALE_SECONDS: Final = 300.0
WATCHER_STALE_SECONDS: Final = 300.0
# Ready needs an API answer to the main loop this recent (plus the reconcile interval).
API_FRESH_SECONDS: Final = 60.0


@dataclass(frozen=True)
class AgentState:
    """What the health functions judge; moments are ``time.monotonic()`` seconds."""

    started: float  # when the agent started (the limits count from here before a beat)
    reconcile_interval: float  # HERMIT_RECONCILE_INTERVAL_SECONDS
    loop: float | None = None
    watcher_started: bool = False  # the watcher was built and its thread runs
    watcher_alive: bool = False  # its thread is alive now
    watcher_polls: bool = True  # it makes requests (the `none` provider makes none)
    watcher: float | None = None
    api: float | None = None
    stopping: bool = False


def liveness(state: AgentState, now: float) -> Verdict:
    if state.stopping:
        return Verdict(True, "stopping: finishing running jobs")
    loop_limit = LOOP_STALE_SECONDS + state.reconcile_interval
    loop_age = age(state.loop if state.loop is not None else state.started, now) or 0.0
    if loop_age > loop_limit:
        return Verdict(False, f"the main loop has not turned for {loop_age:.0f} s "
                              f"(limit {loop_limit:.0f} s)")
    if state.watcher_started and not state.watcher_alive:
        return Verdict(False, "the interruption watcher thread ended")
    if state.watcher_polls:
        watcher_age = age(state.watcher if state.watcher is not None else state.started,
                          now) or 0.0
        if watcher_age > WATCHER_STALE_SECONDS:
            return Verdict(False, f"the interruption watcher has made no request for "
                                  f"{watcher_age:.0f} s (limit {WATCHER_STALE_SECONDS:.0f} s)")
    return Verdict(True, "the main loop and the interruption watcher turn")


def readiness(state: AgentState, now: float) -> Verdict:
    if state.stopping:
        return Verdict(False, "stopping")
    if not (state.watcher_started and state.watcher_alive):
        return Verdict(False, "the interruption watcher is not running")
    limit = API_FRESH_SECONDS + state.reconcile_interval
    api_age = age(state.api, now)
    if api_age is None or api_age > limit:
        since = "yet" if api_age is None else f"for {api_age:.0f} s"
        return Verdict(False, f"the Kubernetes API has not answered the main loop {since}")
    return Verdict(True, "watching for interruptions; the Kubernetes API answers")


class AgentHealth:
    """The node-agent's heartbeats and flags; answers the probes."""

    def __init__(self, reconcile_interval: float, *, watcher_polls: bool = True,
                 stopping: threading.Event | None = None,
                 beats: Heartbeats | None = None) -> None:
        self.beats = beats or Heartbeats()
        self._started = self.beats.now()
        self._interval = reconcile_interval
        self._polls = watcher_polls
        self._watcher: threading.Thread | None = None
        self._watcher_started = threading.Event()
        self.stopping = stopping or threading.Event()  # the agent's stop event (SIGTERM)

    def watching(self, thread: threading.Thread) -> None:
        """The watcher thread (its liveness is checked from now on)."""
        self._watcher = thread

    def watcher_started(self) -> None:
        """The watcher was built: notices can be seen from now on."""
        self._watcher_started.set()

    def state(self) -> AgentState:
        thread = self._watcher
        return AgentState(
            started=self._started, reconcile_interval=self._interval,
            loop=self.beats.last(LOOP), watcher_started=self._watcher_started.is_set(),
            watcher_alive=thread is not None and thread.is_alive(),
            watcher_polls=self._polls, watcher=self.beats.last(WATCHER),
            api=self.beats.last(API), stopping=self.stopping.is_set())

    def liveness(self) -> Verdict:
        return liveness(self.state(), self.beats.now())

    def readiness(self) -> Verdict:
        return readiness(self.state(), self.beats.now())

    def metadata_session(self) -> BeatingSession:
        return BeatingSession(lambda: self.beats.beat(WATCHER))


class BeatingSession(requests.Session):
    """The watcher's HTTP session: as ``watchers.base.metadata_session`` (never through
    an environment proxy), and ``on_request()`` after every request, answered or not."""

    def __init__(self, on_request: Callable[[], None]) -> None:
        super().__init__()
        self.trust_env = False
        self._on_request = on_request

    def request(self, *args: Any, **kwargs: Any) -> requests.Response:
        try:
            return super().request(*args, **kwargs)
        finally:
            self._on_request()
