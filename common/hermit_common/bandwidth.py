"""The node's upload bandwidth, shared by every checkpoint upload of the node-agent.

One ``UploadLimiter`` is built at start-up (HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND)
and every checkpoint upload of the process opens a ticket on it (``upload``), of one of
two classes: ``URGENT`` (a checkpoint of a notice or a drain, protocol.MIGRATING_REASONS:
the node is going away and a deadline runs; not a Suspend, though the node-agent's job
queue serves it at ``PRIORITY_STOPPING``) or ``ROUTINE`` (everything else). Each chunk PUT asks the
ticket for its bytes first (``Ticket.acquire``). The rules (docs/storage.md#upload-bandwidth):

- While any urgent upload is open, routine chunk PUTs wait (whatever the limit, 0
  included: on a real NIC they would compete with the notice's upload); chunks already
  being PUT finish. Routine uploads go on once the last urgent one ends.
- With a limit, the node sends at most ``bytes_per_second`` on average: a granted chunk
  books the next ``size / rate`` seconds, and the next chunk is granted when they have
  passed (virtual scheduling, no burst after an idle spell: never above the limit).
- Among uploads of the class that may send, turns go round: each waiting upload gets
  one chunk in turn, however many threads it has waiting, so two uploads share the
  bandwidth evenly and none starves.
- 0 means unlimited (the default: a node has the NIC to itself and S3 takes what it
  gets); only the urgent gate applies then.
- A routine upload of a sandbox that gets a stopping request while it runs is promoted
  to urgent (``promote``): the sandbox's stopping checkpoint waits for it (one job per
  sandbox), so holding it back would make that sandbox the last of the notice.

``Schedule`` is the pure part (a fake clock drives it in the unit tests);
``UploadLimiter`` puts it behind a lock for the upload threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Final

URGENT: Final = "urgent"  # the migrating reasons only (planner.upload_is_urgent)
ROUTINE: Final = "routine"
CLASSES: Final = (URGENT, ROUTINE)
# A waiting thread looks at its stop event at least this often (seconds).
POLL_SECONDS: Final = 0.1


@dataclass
class _Upload:
    klass: str
    key: object = None  # what ``promote`` finds it by (the sandbox)
    waiting: deque[int] = field(default_factory=deque)  # request ids, first come first


class Schedule:
    """Which waiting chunk may be sent, and when: pure, driven by the caller's clock.

    ``open`` an upload, ``ask`` for a chunk's bytes, then ``grant(now)`` returns the
    requests that may go now and when to call it again (None: only after a change)."""

    def __init__(self, bytes_per_second: float) -> None:
        if bytes_per_second < 0:
            raise ValueError("bytes_per_second must be 0 (unlimited) or more")
        self._rate = float(bytes_per_second)
        self._uploads: dict[int, _Upload] = {}
        self._turns: dict[str, deque[int]] = {k: deque() for k in CLASSES}  # round robin
        self._requests: dict[int, tuple[int, int]] = {}  # id -> (upload, bytes)
        self._ids = itertools.count(1)
        self._next_free = float("-inf")  # when the next chunk may be sent (virtual time)

    def open(self, klass: str, key: object = None) -> int:
        if klass not in CLASSES:
            raise ValueError(f"unknown upload class {klass!r}")
        upload = next(self._ids)
        self._uploads[upload] = _Upload(klass, key)
        self._turns[klass].append(upload)
        return upload

    def promote(self, key: object) -> int:
        """The open routine uploads of ``key`` become urgent; how many did."""
        found = [u for u in self._turns[ROUTINE] if self._uploads[u].key == key]
        for upload in found:
            self._turns[ROUTINE].remove(upload)
            self._turns[URGENT].append(upload)
            self._uploads[upload].klass = URGENT
        return len(found)

    def class_of(self, upload: int) -> str | None:
        gone = self._uploads.get(upload)
        return None if gone is None else gone.klass

    def close(self, upload: int) -> None:
        """The upload ended: its waiting requests are dropped."""
        gone = self._uploads.pop(upload, None)
        if gone is None:
            return
        self._turns[gone.klass].remove(upload)
        for rid in gone.waiting:
            self._requests.pop(rid, None)

    def active(self, klass: str) -> int:
        """How many uploads of ``klass`` are open."""
        return len(self._turns[klass])

    def ask(self, upload: int, nbytes: int) -> int:
        if upload not in self._uploads:
            raise ValueError(f"upload {upload} is closed: its chunks cannot ask any more")
        rid = next(self._ids)
        self._requests[rid] = (upload, max(0, nbytes))
        self._uploads[upload].waiting.append(rid)
        return rid

    def cancel(self, rid: int) -> None:
        """A waiting request is given up (its upload stopped or ran out of time)."""
        found = self._requests.pop(rid, None)
        if found is not None and found[0] in self._uploads:
            self._uploads[found[0]].waiting.remove(rid)

    def _sendable(self) -> str | None:
        """The class whose requests may go: urgent first; routine only with no urgent
        upload open."""
        if any(self._uploads[u].waiting for u in self._turns[URGENT]):
            return URGENT
        if not self._turns[URGENT] and any(self._uploads[u].waiting
                                           for u in self._turns[ROUTINE]):
            return ROUTINE
        return None

    def _take(self, klass: str) -> int:
        """The next request of ``klass`` in turn; its upload goes to the back of the line."""
        turns = self._turns[klass]
        while not self._uploads[turns[0]].waiting:
            turns.rotate(-1)
        upload = turns.popleft()
        turns.append(upload)
        return self._uploads[upload].waiting.popleft()

    def grant(self, now: float) -> tuple[list[int], float | None]:
        """The requests that may be sent at ``now``, in order, and when the next one may
        (None: nothing waits that may go, until an upload opens, closes or asks)."""
        granted: list[int] = []
        while (klass := self._sendable()) is not None:
            if self._rate and self._next_free > now:
                return granted, self._next_free
            rid = self._take(klass)
            _, nbytes = self._requests.pop(rid)
            if self._rate:
                self._next_free = max(self._next_free, now) + nbytes / self._rate
            granted.append(rid)
        return granted, None


class Ticket:
    """One upload's claim on the limiter: ``acquire`` before each chunk PUT."""

    def __init__(self, limiter: UploadLimiter, upload: int, klass: str) -> None:
        self._limiter, self._upload, self.klass = limiter, upload, klass

    def acquire(self, nbytes: int, stop: threading.Event | None = None,
                deadline: float | None = None) -> bool:
        """Waits until ``nbytes`` may be sent; False (nothing granted) once ``stop`` is set
        or the ``deadline`` (the limiter's clock, ``time.monotonic()``) passed."""
        return self._limiter._acquire(self._upload, self.klass, nbytes, stop, deadline)


class UploadLimiter:
    """The node-wide limiter (see the module's doc); thread-safe. ``on_wait(klass,
    seconds)`` is told how long each chunk waited (metrics)."""

    def __init__(self, bytes_per_second: int, *, clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[[str, float], None] | None = None) -> None:
        self.bytes_per_second = bytes_per_second
        self._schedule = Schedule(bytes_per_second)
        self._clock = clock
        self._on_wait = on_wait
        self._cond = threading.Condition()
        self._granted: set[int] = set()
        self._wake_at: float | None = None

    def active(self, klass: str) -> int:
        with self._cond:
            return self._schedule.active(klass)

    @contextmanager
    def upload(self, klass: str, key: object = None) -> Iterator[Ticket]:
        """A ticket for one upload of ``klass`` (of sandbox ``key``), open while the
        ``with`` block runs."""
        with self._cond:
            upload = self._schedule.open(klass, key)
            self._dispatch()
        try:
            yield Ticket(self, upload, klass)
        finally:
            with self._cond:
                self._schedule.close(upload)
                self._dispatch()

    def promote(self, key: object) -> int:
        """Routine uploads of sandbox ``key`` open now become urgent (it got a stopping
        request while one ran); how many did."""
        with self._cond:
            promoted = self._schedule.promote(key)
            if promoted:
                self._dispatch()
            return promoted

    def _dispatch(self) -> None:
        """Grants what may go now and wakes the waiting threads (under the lock)."""
        granted, self._wake_at = self._schedule.grant(self._clock())
        if granted:
            self._granted.update(granted)
        self._cond.notify_all()

    def _acquire(self, upload: int, klass: str, nbytes: int, stop: threading.Event | None,
                 deadline: float | None) -> bool:
        started = self._clock()
        try:
            with self._cond:
                rid = self._schedule.ask(upload, nbytes)
                self._dispatch()
                while rid not in self._granted:
                    now = self._clock()
                    if (stop is not None and stop.is_set()) or \
                            (deadline is not None and now >= deadline):
                        self._schedule.cancel(rid)
                        self._dispatch()
                        return False
                    if self._wake_at is not None and now >= self._wake_at:
                        self._dispatch()
                        continue
                    self._cond.wait(self._timeout(now, deadline))
                self._granted.discard(rid)
                return True
        finally:
            if self._on_wait is not None:
                with self._cond:
                    now_class = self._schedule.class_of(upload) or klass
                self._on_wait(now_class, max(0.0, self._clock() - started))

    def _timeout(self, now: float, deadline: float | None) -> float:
        timeout = POLL_SECONDS
        for at in (self._wake_at, deadline):
            if at is not None:
                timeout = min(timeout, at - now)
        return max(0.0, timeout)
