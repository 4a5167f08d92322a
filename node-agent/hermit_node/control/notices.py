"""The cloud notice this node-agent acts on: the interruption notice (its deadline bounds
every upload) and an advisory one whose early checkpoints are not all requested yet."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime

from hermit_node.control import metrics
from hermit_node.control.watchers import Notice


class Notices:
    def __init__(self, clock: Callable[[], datetime], stopping: threading.Event) -> None:
        self._clock = clock
        self._stopping = stopping
        self._lock = threading.Lock()
        self._notice: Notice | None = None
        # An advisory notice (rebalance recommendation) whose early checkpoints are not all
        # requested yet: set once per notice the watcher yields, cleared once they are.
        self._advised: Notice | None = None

    def interrupted(self, notice: Notice) -> None:
        """The first interruption notice is the one acted on."""
        with self._lock:
            if self._notice is None:
                self._notice = notice

    def advise(self, notice: Notice) -> bool:
        """An advisory notice asking for early checkpoints; True when it is moot (an
        interruption notice came first)."""
        with self._lock:
            moot = self._notice is not None
            self._advised = None if moot else notice
        return moot

    def now(self) -> tuple[Notice | None, Notice | None]:
        """The advisory notice still to act on, and the interruption notice."""
        with self._lock:
            return self._advised, self._notice

    def interruption(self) -> Notice | None:
        with self._lock:
            return self._notice

    def advised_done(self, advised: Notice) -> None:
        """Every early checkpoint ``advised`` asked for is requested."""
        with self._lock:
            if self._advised is advised:
                self._advised = None

    def halted(self) -> bool:
        """A notice came or the agent stops: background work gives way."""
        with self._lock:
            return self._notice is not None or self._stopping.is_set()

    def deadline(self) -> float | None:
        """The notice's deadline as a ``time.monotonic()`` value: uploads must end by then."""
        notice = self.interruption()
        if notice is None or notice.deadline is None:
            return None
        return time.monotonic() + notice.seconds_left(self._clock())

    def record_margin(self) -> None:
        """A stopping checkpoint is durable: how long before the notice's deadline."""
        notice = self.interruption()
        if notice is not None and notice.deadline is not None:
            metrics.record_notice_margin(str(notice.provider),
                                         notice.seconds_left(self._clock()))

    def time_left(self) -> str:
        notice = self.interruption()
        if notice is None or notice.deadline is None:
            return ""
        return f"; {notice.seconds_left(self._clock()):.0f} s left before the node goes"
