"""GCP: preemption and host maintenance from the metadata server, by ETag long-poll."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime

import requests

from hermit_common.settings import WatcherSettings
from hermit_node.control.watchers.base import Clock, Watcher, utc_now
from hermit_node.control.watchers.errors import MetadataUnavailable, NoticeParseError
from hermit_node.control.watchers.notice import SCHEDULED_MAINTENANCE, Notice
from hermit_node.control.watchers.parse import parse_gcp_maintenance_event, parse_gcp_preempted

FLAVOR_HEADER = "Metadata-Flavor"
FLAVOR = "Google"
INSTANCE_PATH = "/computeMetadata/v1/instance/"

Parser = Callable[[str, datetime, str | None], Notice | None]
_ENDPOINTS: tuple[tuple[str, Parser], ...] = (
    ("preempted", parse_gcp_preempted),
    ("maintenance-event", parse_gcp_maintenance_event),
)


class GcpMetadataWatcher(Watcher):
    """``watch()`` long-polls each endpoint (``wait_for_change`` with ``last_etag``) in
    its own thread, so a change is seen as soon as the server reports it; after an
    error it falls back to plain reads every ``poll_interval_seconds``."""

    provider = "gcp"

    def __init__(self, settings: WatcherSettings, session: requests.Session | None = None,
                 clock: Clock = utc_now, logger: logging.Logger | None = None,
                 long_poll_seconds: int = 30) -> None:
        super().__init__(settings, session, clock, logger)
        if long_poll_seconds < 1:
            raise ValueError("long_poll_seconds must be at least 1")
        self.base_url = settings.gcp_metadata_url.rstrip("/")
        self.long_poll_seconds = long_poll_seconds

    def read(self, name: str, last_etag: str | None = None) -> tuple[str, str | None] | None:
        """(value, ETag) of ``instance/<name>``; with ``last_etag``, waits for a change.

        None when the read failed (logged, rate-limited)."""
        url = self.base_url + INSTANCE_PATH + name
        params: dict[str, str] | None = None
        timeout: float | tuple[float, float] = self.settings.request_timeout_seconds
        if last_etag is not None:
            params = {"wait_for_change": "true", "timeout_sec": str(self.long_poll_seconds),
                      "last_etag": last_etag}
            timeout = (self.settings.request_timeout_seconds,
                       self.long_poll_seconds + self.settings.request_timeout_seconds)
        try:
            response = self.request("GET", url, headers={FLAVOR_HEADER: FLAVOR},
                                    params=params, timeout=timeout)
        except MetadataUnavailable as exc:
            self.warnings.failed(name, f"GCP metadata: {exc}")
            return None
        if response.status_code != 200:
            self.warnings.failed(name, f"GCP metadata {name}: HTTP {response.status_code}")
            return None
        if response.headers.get(FLAVOR_HEADER) != FLAVOR:
            self.warnings.failed(name, f"GCP metadata {name}: response without "
                                       f"{FLAVOR_HEADER}: {FLAVOR}, ignored")
            return None
        self.warnings.recovered(name)
        return response.text, response.headers.get("ETag")

    def _parse(self, name: str, parse: Parser, value: str, etag: str | None) -> Notice | None:
        try:
            notice = parse(value, self.clock(), etag)
        except NoticeParseError as exc:
            self.warnings.failed(f"{name} document", str(exc))
            return None
        if notice is None and name == "maintenance-event":
            self.forget(SCHEDULED_MAINTENANCE)  # over: the next maintenance is a new notice
        return notice

    def poll_once(self) -> list[Notice]:
        notices = []
        for name, parse in _ENDPOINTS:
            got = self.read(name)
            if got is not None and (notice := self._parse(name, parse, *got)) is not None:
                notices.append(notice)
        return notices

    def _follow(self, name: str, parse: Parser, done: threading.Event,
                out: queue.Queue[Notice]) -> None:
        etag: str | None = None
        interval = self.settings.poll_interval_seconds
        while not done.is_set():
            started = time.monotonic()
            got = self.read(name, etag)
            if got is None:
                etag = None  # plain reads until the server answers again
                done.wait(interval)
                continue
            value, new_etag = got
            notice = self._parse(name, parse, value, new_etag)
            if notice is not None:
                out.put(notice)
            unchanged = new_etag is None or new_etag == etag
            etag = new_etag
            if unchanged and time.monotonic() - started < interval / 2:
                done.wait(interval)  # no ETag, or a server that does not wait: poll

    def watch(self, stop: threading.Event) -> Iterator[Notice]:
        done = threading.Event()
        out: queue.Queue[Notice] = queue.Queue()
        for name, parse in _ENDPOINTS:
            threading.Thread(target=self._follow, args=(name, parse, done, out),
                             name=f"hermit-gcp-{name}", daemon=True).start()
        try:
            while not stop.is_set():
                try:
                    notice = out.get(timeout=min(0.2, self.settings.poll_interval_seconds))
                except queue.Empty:
                    continue
                yield from self.fresh([notice])
        finally:
            done.set()
