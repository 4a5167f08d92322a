"""What every watcher shares: HTTP with timeouts, quiet warnings, the watch loop."""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import requests

from hermit_common.settings import WatcherSettings
from hermit_node.control.watchers.errors import MetadataUnavailable
from hermit_node.control.watchers.notice import Notice

Clock = Callable[[], datetime]

# A failing endpoint is reported at WARNING at most this often (DEBUG otherwise).
WARNING_INTERVAL_SECONDS = 30.0


def utc_now() -> datetime:
    return datetime.now(UTC)


def metadata_session() -> requests.Session:
    """A session that never sends metadata traffic through an environment proxy."""
    session = requests.Session()
    session.trust_env = False
    return session


class WarningLimiter:
    """Logs a failing key at WARNING once per interval, and INFO when it recovers."""

    def __init__(self, logger: logging.Logger, interval: float = WARNING_INTERVAL_SECONDS,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval = interval
        self._monotonic = monotonic
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def failed(self, key: str, message: str) -> None:
        now = self._monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is None or now - last >= self._interval:
                suppressed = self._suppressed.pop(key, 0)
                self._last[key] = now
                more = f" ({suppressed} more since the last warning)" if suppressed else ""
                self._logger.warning("%s%s", message, more)
            else:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                self._logger.debug("%s", message)

    def recovered(self, key: str) -> None:
        with self._lock:
            if self._last.pop(key, None) is not None:
                self._suppressed.pop(key, None)
                self._logger.info("%s: working again", key)


class Watcher(ABC):
    """Polls one cloud's metadata service for interruption notices.

    ``poll_once()`` reads the current notices (never raises on network or HTTP
    errors: those are logged, rate-limited, and polling goes on).
    ``watch(stop)`` yields each distinct notice once until ``stop`` is set.
    """

    provider: str = ""

    def __init__(self, settings: WatcherSettings, session: requests.Session | None = None,
                 clock: Clock = utc_now, logger: logging.Logger | None = None) -> None:
        self.settings = settings
        self.session = session if session is not None else metadata_session()
        self.clock = clock
        self.log = logger or logging.getLogger(f"hermit.watchers.{self.provider or 'none'}")
        self.warnings = WarningLimiter(self.log)
        self._seen: set[tuple[str, str, str]] = set()
        self._seen_lock = threading.Lock()

    @abstractmethod
    def poll_once(self) -> list[Notice]:
        """The notices the metadata service announces right now."""

    def watch(self, stop: threading.Event) -> Iterator[Notice]:
        interval = self.settings.poll_interval_seconds
        while not stop.is_set():
            started = time.monotonic()
            yield from self.fresh(self.poll_once())
            stop.wait(max(0.0, interval - (time.monotonic() - started)))

    def fresh(self, notices: Iterable[Notice]) -> list[Notice]:
        """The notices not yielded before (by ``Notice.key``), remembering them."""
        out = []
        with self._seen_lock:
            for notice in notices:
                if notice.key not in self._seen:
                    self._seen.add(notice.key)
                    out.append(notice)
        for notice in out:
            self.log.info("interruption notice: %s %s action=%s deadline=%s id=%s",
                          notice.provider, notice.kind, notice.action,
                          notice.deadline.isoformat() if notice.deadline else "none",
                          notice.event_id)
        return out

    def forget(self, kind: str) -> None:
        """Forget the notices of ``kind`` yielded so far: the next one is new again
        (for repeatable events such as GCP host maintenance, once it is over)."""
        with self._seen_lock:
            self._seen = {key for key in self._seen if key[1] != kind}

    def request(self, method: str, url: str, *, headers: Mapping[str, str],
                params: Mapping[str, str] | None = None, json: Any = None,
                timeout: float | tuple[float, float] | None = None) -> requests.Response:
        """One HTTP request with a timeout; transport failures become MetadataUnavailable."""
        try:
            return self.session.request(
                method, url, headers=dict(headers), params=params, json=json,
                timeout=timeout if timeout is not None else self.settings.request_timeout_seconds,
                allow_redirects=False,
            )
        except requests.Timeout:
            raise MetadataUnavailable(f"{method} {url} timed out") from None
        except requests.ConnectionError as exc:
            raise MetadataUnavailable(f"{method} {url}: cannot connect ({_reason(exc)})") from None
        except requests.RequestException as exc:
            raise MetadataUnavailable(f"{method} {url} failed: {_reason(exc)}") from None


class NullWatcher(Watcher):
    """provider=none: no metadata service; ``watch()`` only waits for ``stop``."""

    provider = "none"

    def poll_once(self) -> list[Notice]:
        return []

    def watch(self, stop: threading.Event) -> Iterator[Notice]:
        stop.wait()
        yield from ()


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


def _reason(exc: BaseException) -> str:
    """A short reason ("Connection refused") instead of urllib3's nested repr."""
    text = str(exc)
    found = _ERRNO.search(text)
    if found:
        return found.group(1).strip()
    lines = text.strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:120]}" if lines else type(exc).__name__
