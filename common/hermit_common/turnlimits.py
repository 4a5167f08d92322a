"""What keeps the turn endpoint (docs/turns.md#limits-of-the-endpoint) cheap to attack.

Pure pieces with an injectable clock, used by ``turnserver`` (connections, deadlines) and
``turns.TurnService`` (rates, the TokenReview cache):

- ``RateLimiter``: a token bucket per caller (the source address before authentication,
  the authenticated user after it), with a bounded number of callers remembered;
- ``ReviewCache``: TokenReview results kept briefly, keyed by a hash of the token (never
  the token), negative ones too, with one review in flight per token, so a flood of junk
  tokens costs at most one TokenReview per distinct token per period;
- ``ConnectionSlots``: a cap on open connections, overall and per source address;
- ``Deadlines``: which connections' request-read deadline passed (the server closes
  them: a slowloris sending a byte every few seconds is cut off however slow each read).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

Clock = Callable[[], float]

# Defaults, documented in docs/turns.md: a harness ends a turn every few seconds at most.
HEAD_TIMEOUT_SECONDS: Final = 10.0  # the whole request (line, headers, body) must arrive
IO_TIMEOUT_SECONDS: Final = 10.0  # any one read or write of the connection
MAX_HEAD_BYTES: Final = 32 * 1024  # request line and headers (a projected token is ~1 KiB)
MAX_CONNECTIONS: Final = 128
MAX_CONNECTIONS_PER_SOURCE: Final = 16
SOURCE_RATE: Final = 10.0  # requests per second per source address, before authentication
SOURCE_BURST: Final = 40
USER_RATE: Final = 5.0  # requests per second per authenticated user
USER_BURST: Final = 20
REVIEW_TTL_SECONDS: Final = 20.0  # a TokenReview's answer is reused this long
REVIEW_NEGATIVE_TTL_SECONDS: Final = 10.0  # an invalid token's answer
MAX_REVIEWS_CACHED: Final = 4096
MAX_CALLERS_TRACKED: Final = 4096


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """Token buckets per key: ``allow(key)`` takes one token (``rate`` per second refill,
    at most ``burst``). At most ``max_keys`` keys are remembered: the least recently seen
    goes first (a forgotten caller starts with a full bucket, so the bound only matters
    to an attacker with more addresses than that)."""

    def __init__(self, rate: float, burst: int, *, max_keys: int = MAX_CALLERS_TRACKED,
                 clock: Clock = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate, self.burst, self._max, self._clock = rate, burst, max_keys, clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, key: str) -> bool:
        now = self._clock()
        with self._lock:
            bucket = self._buckets.pop(key, None) or _Bucket(float(self.burst), now)
            bucket.tokens = min(float(self.burst),
                                bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
            self._buckets[key] = bucket
            while len(self._buckets) > self._max:
                self._buckets.popitem(last=False)
            if bucket.tokens < 1.0:
                return False
            bucket.tokens -= 1.0
            return True

    def retry_after(self, key: str) -> float:
        """Seconds until ``key`` has a token again (0 when it has one)."""
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                return 0.0
            tokens = bucket.tokens + (self._clock() - bucket.at) * self.rate
            return max(0.0, (1.0 - tokens) / self.rate)


def token_key(token: str, audiences: tuple[str, ...]) -> str:
    """The cache key of a token: a hash, so no token is kept in memory longer than its
    request (and a memory dump of the agent holds none)."""
    h = hashlib.sha256()
    for part in (*audiences, token):
        h.update(part.encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()


_V = TypeVar("_V")


@dataclass
class _Flight(Generic[_V]):
    done: threading.Event
    value: _V | None = None
    error: BaseException | None = None


class ReviewCache(Generic[_V]):
    """Answers kept per key for ``ttl`` (``negative_ttl`` for those ``is_positive`` says
    are not), at most ``max_entries`` (the oldest go first). ``get_or_compute`` runs the
    review once per key at a time: concurrent callers with the same key wait for it.
    An error is not cached (the API server did not answer)."""

    def __init__(self, is_positive: Callable[[_V], bool], *,
                 ttl: float = REVIEW_TTL_SECONDS,
                 negative_ttl: float = REVIEW_NEGATIVE_TTL_SECONDS,
                 max_entries: int = MAX_REVIEWS_CACHED, clock: Clock = time.monotonic) -> None:
        self._positive, self._ttl, self._negative_ttl = is_positive, ttl, negative_ttl
        self._max, self._clock = max_entries, clock
        self._entries: OrderedDict[str, tuple[float, _V]] = OrderedDict()
        self._flights: dict[str, _Flight[_V]] = {}
        self._lock = threading.Lock()
        self.computed = 0  # how many times compute ran (a count for tests and logs)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: str) -> _V | None:
        with self._lock:
            return self._get_locked(key)

    def _get_locked(self, key: str) -> _V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            del self._entries[key]
            return None
        return entry[1]

    def put(self, key: str, value: _V) -> None:
        ttl = self._ttl if self._positive(value) else self._negative_ttl
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = (self._clock() + ttl, value)
            while len(self._entries) > self._max:
                self._entries.popitem(last=False)

    def get_or_compute(self, key: str, compute: Callable[[], _V]) -> _V:
        with self._lock:
            cached = self._get_locked(key)
            if cached is not None:
                return cached
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                flight = self._flights[key] = _Flight(threading.Event())
        if not leader:
            flight.done.wait()
            if flight.error is not None:
                raise flight.error
            assert flight.value is not None
            return flight.value
        try:
            with self._lock:
                self.computed += 1
            value = compute()
            self.put(key, value)
            flight.value = value
            return value
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                del self._flights[key]
            flight.done.set()


class ConnectionSlots:
    """Open connections, at most ``total`` and ``per_source`` from one address."""

    def __init__(self, total: int = MAX_CONNECTIONS,
                 per_source: int = MAX_CONNECTIONS_PER_SOURCE) -> None:
        self.total, self.per_source = total, per_source
        self._open: dict[str, int] = {}
        self._count = 0
        self._lock = threading.Lock()

    def take(self, source: str) -> bool:
        with self._lock:
            if self._count >= self.total or self._open.get(source, 0) >= self.per_source:
                return False
            self._count += 1
            self._open[source] = self._open.get(source, 0) + 1
            return True

    def give(self, source: str) -> None:
        with self._lock:
            left = self._open.get(source, 0) - 1
            if left <= 0:
                self._open.pop(source, None)
            else:
                self._open[source] = left
            self._count = max(0, self._count - 1)

    @property
    def open(self) -> int:
        with self._lock:
            return self._count


class Deadlines:
    """Deadlines by id: ``arm`` one, ``disarm`` it once the work is done in time,
    ``expired(now)`` pops those that passed (in order). The server's watchdog thread
    closes the connection of each."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, Any] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)

    def arm(self, seconds: float, what: Any) -> int:
        with self._lock:
            ident = next(self._ids)
            self._armed[ident] = what
            heapq.heappush(self._heap, (self._clock() + seconds, ident))
            self.changed.notify()
            return ident

    def disarm(self, ident: int) -> bool:
        """False when it had expired already (its connection was or is being closed)."""
        with self._lock:
            return self._armed.pop(ident, None) is not None

    def expired(self) -> list[Any]:
        with self._lock:
            return self._expired_locked()

    def _expired_locked(self) -> list[Any]:
        now, out = self._clock(), []
        while self._heap and self._heap[0][0] <= now:
            _, ident = heapq.heappop(self._heap)
            what = self._armed.pop(ident, None)
            if what is not None:
                out.append(what)
        return out

    def wait_expired(self, timeout: float) -> list[Any]:
        """Blocks until something expires (or ``timeout``); returns what expired."""
        with self._lock:
            while self._heap and self._heap[0][1] not in self._armed:
                heapq.heappop(self._heap)  # disarmed ones
            wait = timeout if not self._heap else \
                min(timeout, max(0.0, self._heap[0][0] - self._clock()))
            if wait > 0:
                self.changed.wait(wait)
            return self._expired_locked()
