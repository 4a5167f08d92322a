"""Azure: Scheduled Events (Preempt for spot VMs) with acknowledgment."""

from __future__ import annotations

import logging
from typing import Any

import requests

from hermit_common.settings import WatcherSettings
from hermit_node.control.watchers.base import Clock, Watcher, utc_now
from hermit_node.control.watchers.errors import MetadataUnavailable, NoticeParseError
from hermit_node.control.watchers.notice import Notice
from hermit_node.control.watchers.parse import parse_azure_events

EVENTS_PATH = "/metadata/scheduledevents"
EVENTS_API_VERSION = "2020-07-01"
NAME_PATH = "/metadata/instance/compute/name"
NAME_API_VERSION = "2021-02-01"
METADATA_HEADERS = {"Metadata": "true"}


class AzureScheduledEventsWatcher(Watcher):
    """Polls Scheduled Events; keeps only events naming this VM once its name is known
    (``resource_name``, or discovered from the instance metadata)."""

    provider = "azure"

    def __init__(self, settings: WatcherSettings, session: requests.Session | None = None,
                 clock: Clock = utc_now, logger: logging.Logger | None = None,
                 resource_name: str | None = None, discover_resource_name: bool = True) -> None:
        super().__init__(settings, session, clock, logger)
        self.base_url = settings.azure_metadata_url.rstrip("/")
        self.resource_name = resource_name
        self._discover = discover_resource_name and resource_name is None
        self.document_incarnation: int | None = None
        self._notices: list[Notice] = []

    def _discover_name(self) -> None:
        try:
            response = self.request(
                "GET", self.base_url + NAME_PATH, headers=METADATA_HEADERS,
                params={"api-version": NAME_API_VERSION, "format": "text"})
        except MetadataUnavailable as exc:
            self.log.debug("Azure VM name not known yet: %s", exc)
            return  # try again on the next poll
        self._discover = False
        if response.status_code == 200 and response.text.strip():
            self.resource_name = response.text.strip()
            self.log.info("Azure scheduled events: watching resource %s", self.resource_name)
        else:
            self.log.info("Azure VM name unavailable (HTTP %s): watching every event",
                          response.status_code)

    def poll_once(self) -> list[Notice]:
        if self._discover:
            self._discover_name()
        try:
            response = self.request("GET", self.base_url + EVENTS_PATH,
                                    headers=METADATA_HEADERS,
                                    params={"api-version": EVENTS_API_VERSION})
        except MetadataUnavailable as exc:
            self.warnings.failed("scheduledevents", f"Azure scheduled events: {exc}")
            return list(self._notices)
        if response.status_code != 200:
            self.warnings.failed("scheduledevents",
                                 f"Azure scheduled events: HTTP {response.status_code}")
            return list(self._notices)
        try:
            doc: Any = response.json()
            if not isinstance(doc, dict):
                raise NoticeParseError("Azure scheduled events: expected a JSON object")
            incarnation = doc.get("DocumentIncarnation")
            if incarnation is None or incarnation != self.document_incarnation:
                self._notices = parse_azure_events(doc, self.clock(), self.resource_name)
                self.document_incarnation = incarnation if isinstance(incarnation, int) else None
        except (ValueError, NoticeParseError) as exc:
            self.warnings.failed("scheduledevents document", f"Azure scheduled events: {exc}")
            return list(self._notices)
        self.warnings.recovered("scheduledevents")
        return list(self._notices)

    def acknowledge(self, notice: Notice) -> None:
        """Tells Azure to start the event now (``StartRequests``): call when ready to go.

        Raises MetadataUnavailable when the request fails."""
        if notice.provider != "azure":
            raise ValueError(f"cannot acknowledge a {notice.provider} notice on Azure")
        response = self.request(
            "POST", self.base_url + EVENTS_PATH, headers=METADATA_HEADERS,
            params={"api-version": EVENTS_API_VERSION},
            json={"StartRequests": [{"EventId": notice.event_id}]})
        if response.status_code not in (200, 201, 202, 204):
            raise MetadataUnavailable(
                f"Azure scheduled events: acknowledging {notice.event_id} returned "
                f"HTTP {response.status_code}")
        self.log.info("Azure scheduled event %s acknowledged", notice.event_id)
