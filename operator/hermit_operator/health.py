"""Liveness and readiness of the operator, with or without leader election.

An operator process is in one of three roles:

- ``starting``: settings read, the API checked, neither the Lease loop nor kopf runs yet;
- ``standby``: it waits for the leadership Lease (leader.LeaseElector.acquire): kopf has
  not started, and kopf's own liveness endpoint is not served;
- ``leading``: it holds the Lease (or runs without leader election) and runs kopf.

Liveness (``/healthz``) says the process need not be restarted. It never depends on the
API server being reachable, only on this process's own loops turning:

- the Lease loop (acquire on a standby, renew on the leader) has turned within
  ``LEASE_LOOP_STALE_SECONDS``, whatever the API server answered;
- on the leader, kopf's liveness endpoint (served on loopback only, see
  ``KOPF_LIVENESS_ENDPOINT``) answers; until it has answered once, kopf is starting
  and gets ``KOPF_START_GRACE_SECONDS``.

Readiness (``/readyz``) says the replica does its job: leading with kopf answering, or
standing by with a Lease loop that the API server answered within
``LEASE_ANSWER_FRESH_SECONDS``, so it can take over. A standby counts as ready on
purpose: with one replica a rolling update starts the new pod as a standby and removes
the old one only once the new one is ready; if ready meant leading, the update would
wait forever for a Lease the old pod never gives up.

``liveness`` and ``readiness`` are pure; ``OperatorHealth`` records the moments they
judge and asks kopf.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from hermit_common.health import Verdict, age

STARTING: Final = "starting"
STANDBY: Final = "standby"
LEADING: Final = "leading"

# kopf's own liveness endpoint: loopback only, asked by /healthz on the leader.
KOPF_LIVENESS_ENDPOINT: Final = "http://127.0.0.1:8080/healthz"
KOPF_PROBE_TIMEOUT_SECONDS: Final = 3.0
# A Lease loop turn is at most two API requests of 10 s (urllib3 retries a failed one up
# to 3 times) and a 5 s sleep: one that has not turned for this long is stuck.
LEASE_LOOP_STALE_SECONDS: Final = 120.0
# Ready needs an answer of the API server to the Lease loop (every 5 s) this recent.
LEASE_ANSWER_FRESH_SECONDS: Final = 30.0
# How long the leader may take to start kopf and serve its liveness endpoint.
KOPF_START_GRACE_SECONDS: Final = 120.0


@dataclass(frozen=True)
class OperatorState:
    """What the health functions judge; moments are ``time.monotonic()`` seconds."""

    role: str  # STARTING | STANDBY | LEADING
    election: bool  # a Lease loop runs (HERMIT_LEADER_ELECTION)
    role_since: float  # when the current role began
    lease_turn: float | None = None  # the Lease loop's last turn, answered or not
    lease_answer: float | None = None  # the API server's last answer to the Lease loop
    kopf_answered: bool = False  # kopf's liveness endpoint has answered at least once


def liveness(state: OperatorState, now: float, kopf_ok: bool | None) -> Verdict:
    """``kopf_ok``: whether kopf's liveness endpoint answers (None: not asked)."""
    if state.role == STARTING:
        return Verdict(True, "starting")
    if state.election:
        turned = age(state.lease_turn if state.lease_turn is not None else state.role_since,
                     now) or 0.0
        if turned > LEASE_LOOP_STALE_SECONDS:
            return Verdict(False, f"{state.role}: the Lease loop has not turned for "
                                  f"{turned:.0f} s (limit {LEASE_LOOP_STALE_SECONDS:.0f} s)")
    if state.role == STANDBY:
        return Verdict(True, "standing by: the Lease loop turns")
    if kopf_ok:
        return Verdict(True, "leading: kopf answers")
    waited = now - state.role_since
    if not state.kopf_answered and waited < KOPF_START_GRACE_SECONDS:
        return Verdict(True, f"leading: kopf is starting ({waited:.0f} s)")
    return Verdict(False, f"leading, but kopf's liveness endpoint {KOPF_LIVENESS_ENDPOINT} "
                          "does not answer")


def readiness(state: OperatorState, now: float, kopf_ok: bool | None) -> Verdict:
    """Ready: leading with kopf answering, or standing by with a working Lease loop."""
    if state.role == STARTING:
        return Verdict(False, "starting")
    if state.election:
        answered = age(state.lease_answer, now)
        if answered is None or answered > LEASE_ANSWER_FRESH_SECONDS:
            since = "yet" if answered is None else f"for {answered:.0f} s"
            return Verdict(False, f"{state.role}: the API server has not answered the "
                                  f"Lease loop {since}")
    if state.role == STANDBY:
        return Verdict(True, "standing by: the Lease loop works, ready to take over")
    if kopf_ok:
        return Verdict(True, "leading: kopf runs")
    return Verdict(False, "leading, but kopf does not answer (yet)")


def kopf_answers(url: str = KOPF_LIVENESS_ENDPOINT,
                 timeout: float = KOPF_PROBE_TIMEOUT_SECONDS) -> bool:
    """Whether kopf's liveness endpoint answers 200 (never through a proxy)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


class OperatorHealth:
    """Records the operator's role and its Lease loop's turns; answers the probes."""

    def __init__(self, election: bool, *, kopf_probe: Callable[[], bool] = kopf_answers,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._kopf_probe = kopf_probe
        self._lock = threading.Lock()
        self._state = OperatorState(STARTING, election, clock())

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._state = dataclasses.replace(self._state, **changes)

    def standing_by(self) -> None:
        self._update(role=STANDBY, role_since=self._clock())

    def leading(self) -> None:
        self._update(role=LEADING, role_since=self._clock())

    def lease_turn(self, answered: bool) -> None:
        """One turn of the Lease loop; ``answered``: the API server answered it."""
        now = self._clock()
        if answered:
            self._update(lease_turn=now, lease_answer=now)
        else:
            self._update(lease_turn=now)

    def state(self) -> OperatorState:
        with self._lock:
            return self._state

    def _kopf(self, state: OperatorState) -> bool | None:
        if state.role != LEADING:
            return None
        ok = self._kopf_probe()
        if ok and not state.kopf_answered:
            self._update(kopf_answered=True)
        return ok

    def liveness(self) -> Verdict:
        state = self.state()
        return liveness(state, self._clock(), self._kopf(state))

    def readiness(self) -> Verdict:
        state = self.state()
        return readiness(state, self._clock(), self._kopf(state))
