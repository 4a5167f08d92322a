"""When to look at a sandbox again: one timer thread for every sandbox, and the work
queue of pod events (due at once).

A plan that depends on the time (an interval checkpoint due, a restore retry's backoff,
the on-demand fallback, a stopping checkpoint waited for, a fork waiting for its
checkpoint) says how many seconds until its decision changes (``Plan.requeue_after``);
a reconcile that failed after an event is tried again after a delay. ``Wakeups`` keeps,
per sandbox, the earliest such moment and reconciles the sandbox then, on a small pool
of threads: nothing runs for a sandbox that waits for nothing. ``Schedule`` is the pure
part (a heap with the earliest moment per key; moments are ``time.monotonic()`` values).
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

log = logging.getLogger("hermit.operator")

Key = tuple[str, str]  # (namespace, name)

WORKERS: Final = 4


class Schedule:
    """The earliest due moment per key. Not thread-safe (``Wakeups`` holds a lock)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, Key]] = []
        self._due: dict[Key, float] = {}

    def __len__(self) -> int:
        return len(self._due)

    def add(self, key: Key, at: float) -> bool:
        """Due at ``at`` unless due earlier already; True when the key's moment moved."""
        current = self._due.get(key)
        if current is not None and current <= at:
            return False
        self._due[key] = at
        heapq.heappush(self._heap, (at, key))
        return True

    def cancel(self, key: Key) -> None:
        self._due.pop(key, None)  # its heap entry is skipped when it comes up

    def next_at(self) -> float | None:
        """The earliest due moment, or None when nothing is scheduled."""
        while self._heap and self._due.get(self._heap[0][1]) != self._heap[0][0]:
            heapq.heappop(self._heap)  # cancelled or moved earlier
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> list[Key]:
        """The keys due at ``now``, removed, earliest first."""
        out: list[Key] = []
        while (at := self.next_at()) is not None and at <= now:
            _, key = heapq.heappop(self._heap)
            del self._due[key]
            out.append(key)
        return out


class Wakeups:
    """Reconciles each sandbox at the moment its schedule says (``fire(namespace, name)``
    on a pool of WORKERS threads)."""

    def __init__(self, fire: Callable[[str, str], None], *, workers: int = WORKERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fire = fire
        self._clock = clock
        self._schedule = Schedule()
        self._cond = threading.Condition()
        self._stopped = False
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hermit-wake")
        self._thread = threading.Thread(target=self._run, name="hermit-wakeups", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def after(self, namespace: str, name: str, seconds: float) -> None:
        """Reconcile the sandbox in ``seconds`` (or earlier, when due earlier already)."""
        with self._cond:
            if self._schedule.add((namespace, name), self._clock() + max(0.0, seconds)):
                self._cond.notify()

    def cancel(self, namespace: str, name: str) -> None:
        with self._cond:
            self._schedule.cancel((namespace, name))

    def pending(self) -> int:
        with self._cond:
            return len(self._schedule)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                due = self._schedule.pop_due(self._clock())
                if not due:
                    at = self._schedule.next_at()
                    self._cond.wait(None if at is None else max(0.0, at - self._clock()))
                    continue
            for namespace, name in due:
                self._pool.submit(self._call, namespace, name)

    def _call(self, namespace: str, name: str) -> None:
        try:
            self._fire(namespace, name)
        except Exception:  # a bug must not end the timers of every other sandbox
            log.exception("timed reconcile of AgentSandbox %s/%s", namespace, name)
