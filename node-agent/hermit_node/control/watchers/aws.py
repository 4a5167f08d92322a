"""AWS: spot interruption, rebalance recommendation and scheduled events via IMDSv2."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

import requests

from hermit_common.settings import WatcherSettings
from hermit_node.control.watchers.base import Clock, Watcher, utc_now
from hermit_node.control.watchers.errors import MetadataUnavailable, NoticeParseError
from hermit_node.control.watchers.notice import Notice
from hermit_node.control.watchers.parse import (
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_aws_scheduled_events,
)

TOKEN_PATH = "/latest/api/token"
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
SCHEDULED_EVENTS_PATH = "/latest/meta-data/events/maintenance/scheduled"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
TOKEN_RETRY_AFTER = timedelta(seconds=30)

_ENDPOINTS: tuple[tuple[str, Callable[[str, datetime], Notice | list[Notice]]], ...] = (
    (INSTANCE_ACTION_PATH, parse_aws_instance_action),
    (REBALANCE_PATH, parse_aws_rebalance),
    (SCHEDULED_EVENTS_PATH, parse_aws_scheduled_events),
)


class AwsImdsWatcher(Watcher):
    """Polls IMDS with a session token (IMDSv2), refreshed before it expires and on 401.

    When no token can be had (an IMDSv1-only endpoint, or the PUT is lost to a
    hop limit) requests go without one and the failure is logged.
    """

    provider = "aws"

    def __init__(self, settings: WatcherSettings, session: requests.Session | None = None,
                 clock: Clock = utc_now, logger: logging.Logger | None = None,
                 token_ttl_seconds: int = 21600) -> None:
        super().__init__(settings, session, clock, logger)
        if not 1 <= token_ttl_seconds <= 21600:
            raise ValueError("token_ttl_seconds must be between 1 and 21600")
        self.base_url = settings.aws_imds_url.rstrip("/")
        self.token_ttl_seconds = token_ttl_seconds
        self._token: str | None = None
        self._token_expires: datetime | None = None
        self._token_retry_at: datetime | None = None

    # -- IMDSv2 session token -------------------------------------------------

    def _token_fresh(self, now: datetime) -> bool:
        if self._token is None or self._token_expires is None:
            return False
        margin = timedelta(seconds=min(60.0, self.token_ttl_seconds / 4))
        return now < self._token_expires - margin

    def token(self, *, force: bool = False) -> str | None:
        """The current session token, fetching a new one when needed; None if unavailable."""
        now = self.clock()
        if not force and self._token_fresh(now):
            return self._token
        if not force and self._token_retry_at is not None and now < self._token_retry_at:
            return None  # the PUT got no answer lately; a 401 forces a new try
        self._token, self._token_expires, self._token_retry_at = None, None, None
        try:
            response = self.request(
                "PUT", self.base_url + TOKEN_PATH,
                headers={TOKEN_TTL_HEADER: str(self.token_ttl_seconds)},
            )
        except MetadataUnavailable as exc:
            # Lost PUTs (a hop limit of 1 seen from a container) must not cost a
            # timeout on every poll: go without a token for a while.
            self._token_retry_at = now + TOKEN_RETRY_AFTER
            self.warnings.failed("IMDSv2 token", f"IMDSv2 token: {exc}")
            return None
        if response.status_code != 200 or not response.text.strip():
            self.warnings.failed(
                "IMDSv2 token", f"IMDSv2 token: PUT {TOKEN_PATH} returned HTTP "
                f"{response.status_code}; continuing without a token")
            return None
        self.warnings.recovered("IMDSv2 token")
        self._token = response.text.strip()
        self._token_expires = now + timedelta(seconds=self.token_ttl_seconds)
        return self._token

    # -- polling --------------------------------------------------------------

    def _get(self, path: str) -> requests.Response:
        token = self.token()
        headers = {TOKEN_HEADER: token} if token else {}
        response = self.request("GET", self.base_url + path, headers=headers)
        if response.status_code == 401:
            token = self.token(force=True)
            if token:
                response = self.request("GET", self.base_url + path,
                                        headers={TOKEN_HEADER: token})
        return response

    def fetch(self, path: str) -> str | None:
        """The document at ``path``; None when there is none (404) or it failed (logged)."""
        try:
            return self._fetch(path)
        except MetadataUnavailable:
            return None

    def _fetch(self, path: str) -> str | None:
        """Like ``fetch`` but raises MetadataUnavailable when IMDS cannot be reached."""
        try:
            response = self._get(path)
        except MetadataUnavailable as exc:
            self.warnings.failed(path, f"AWS IMDS: {exc}")
            raise
        if response.status_code == 404:
            self.warnings.recovered(path)
            return None
        if response.status_code != 200:
            self.warnings.failed(path, f"AWS IMDS {path}: HTTP {response.status_code}")
            return None
        self.warnings.recovered(path)
        return response.text

    def poll_once(self) -> list[Notice]:
        notices: list[Notice] = []
        for path, parse in _ENDPOINTS:
            try:
                text = self._fetch(path)
            except MetadataUnavailable:
                break  # unreachable: the other paths would only wait for timeouts too
            if text is None:
                continue
            try:
                parsed = parse(text, self.clock())
            except NoticeParseError as exc:
                self.warnings.failed(f"{path} document", str(exc))
                continue
            notices.extend(parsed if isinstance(parsed, list) else [parsed])
        return notices
