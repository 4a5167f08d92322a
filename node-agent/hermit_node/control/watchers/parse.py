"""Pure functions from the clouds' metadata documents to ``Notice`` objects.

Each takes the document as served and ``now`` (aware UTC, when it was seen)
and raises ``NoticeParseError`` with a one-line message on a malformed one.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

from hermit_node.control.watchers.errors import NoticeParseError
from hermit_node.control.watchers.notice import (
    PREEMPTION,
    REBALANCE_RECOMMENDATION,
    SCHEDULED_MAINTENANCE,
    SPOT_INTERRUPTION,
    TERMINATION,
    Notice,
)

# GCP gives a preempted VM about 30 s and a host-maintenance event 60 s.
GCP_PREEMPTION_NOTICE = timedelta(seconds=30)
GCP_MAINTENANCE_NOTICE = timedelta(seconds=60)

_AWS_ACTIONS = ("terminate", "stop", "hibernate")
_AWS_LIVE_EVENT_STATES = ("active",)
_AZURE_LIVE_STATUSES = ("Scheduled", "Started")
_AZURE_KINDS = {"Preempt": PREEMPTION, "Terminate": TERMINATION}
_GCP_MAINTENANCE_ACTIONS = {
    "MIGRATE_ON_HOST_MAINTENANCE": "migrate",
    "TERMINATE_ON_HOST_MAINTENANCE": "terminate",
}


def _utc(value: datetime) -> datetime:
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def _iso_time(value: object, what: str) -> datetime:
    if not isinstance(value, str):
        raise NoticeParseError(f"{what}: expected an RFC 3339 time, got {value!r}")
    try:
        return _utc(datetime.fromisoformat(value.strip()))
    except ValueError:
        raise NoticeParseError(f"{what}: {value!r} is not an RFC 3339 time") from None


def _http_date(value: object, what: str) -> datetime:
    if not isinstance(value, str):
        raise NoticeParseError(f"{what}: expected a date, got {value!r}")
    try:
        return _utc(parsedate_to_datetime(value.strip()))
    except (TypeError, ValueError, IndexError):
        raise NoticeParseError(f"{what}: {value!r} is not a date") from None


def _json(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise NoticeParseError(f"{what}: not JSON: {str(text)[:80]!r}") from None


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise NoticeParseError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


def parse_aws_instance_action(text: str, now: datetime) -> Notice:
    """``/latest/meta-data/spot/instance-action``: ``{"action": ..., "time": ...}``."""
    doc = _object(_json(text, "AWS spot instance-action"), "AWS spot instance-action")
    action = doc.get("action")
    if action not in _AWS_ACTIONS:
        raise NoticeParseError(f"AWS spot instance-action: unknown action {action!r}")
    deadline = _iso_time(doc.get("time"), "AWS spot instance-action time")
    return Notice(
        provider="aws", kind=SPOT_INTERRUPTION, action=str(action), deadline=deadline,
        received_at=_utc(now), event_id=f"instance-action:{action}", raw=doc,
    )


def parse_aws_rebalance(text: str, now: datetime) -> Notice:
    """``/latest/meta-data/events/recommendations/rebalance``: ``{"noticeTime": ...}``."""
    doc = _object(_json(text, "AWS rebalance recommendation"), "AWS rebalance recommendation")
    _iso_time(doc.get("noticeTime"), "AWS rebalance recommendation noticeTime")
    return Notice(
        provider="aws", kind=REBALANCE_RECOMMENDATION, action="rebalance", deadline=None,
        received_at=_utc(now), event_id="rebalance-recommendation", raw=doc,
    )


def parse_aws_scheduled_events(text: str, now: datetime) -> list[Notice]:
    """``/latest/meta-data/events/maintenance/scheduled``: a list; only active events count."""
    if not text.strip():
        return []
    doc = _json(text, "AWS scheduled events")
    if not isinstance(doc, list):
        raise NoticeParseError("AWS scheduled events: expected a JSON list")
    notices = []
    for item in doc:
        event = _object(item, "AWS scheduled event")
        if str(event.get("State", "active")).lower() not in _AWS_LIVE_EVENT_STATES:
            continue
        event_id = event.get("EventId")
        code = event.get("Code")
        if not isinstance(event_id, str) or not isinstance(code, str):
            raise NoticeParseError("AWS scheduled event: EventId and Code are required")
        notices.append(Notice(
            provider="aws", kind=SCHEDULED_MAINTENANCE, action=code,
            deadline=_http_date(event.get("NotBefore"),
                                f"AWS scheduled event {event_id} NotBefore"),
            received_at=_utc(now), event_id=event_id, raw=event,
        ))
    return notices


def parse_gcp_preempted(value: str, now: datetime, etag: str | None = None) -> Notice | None:
    """``/computeMetadata/v1/instance/preempted``: ``TRUE`` or ``FALSE``."""
    flag = value.strip().upper()
    if flag == "FALSE":
        return None
    if flag != "TRUE":
        raise NoticeParseError(f"GCP preempted: expected TRUE or FALSE, got {value[:40]!r}")
    received = _utc(now)
    return Notice(
        provider="gcp", kind=PREEMPTION, action="terminate",
        deadline=received + GCP_PREEMPTION_NOTICE, received_at=received,
        event_id="preempted", raw={"value": value.strip(), "etag": etag},
    )


def parse_gcp_maintenance_event(
    value: str, now: datetime, etag: str | None = None,
) -> Notice | None:
    """``/computeMetadata/v1/instance/maintenance-event``: ``NONE`` or the coming event."""
    event = value.strip().upper()
    if event == "NONE":
        return None
    action = _GCP_MAINTENANCE_ACTIONS.get(event)
    if action is None:
        raise NoticeParseError(f"GCP maintenance-event: unknown value {value[:60]!r}")
    received = _utc(now)
    return Notice(
        provider="gcp", kind=SCHEDULED_MAINTENANCE, action=action,
        deadline=received + GCP_MAINTENANCE_NOTICE, received_at=received,
        event_id=event,
        raw={"value": value.strip(), "etag": etag},
    )


def parse_azure_events(
    doc: dict[str, Any] | str, now: datetime, resource_name: str | None = None,
) -> list[Notice]:
    """``/metadata/scheduledevents``: every Scheduled or Started event, optionally
    only those whose ``Resources`` name this VM."""
    body = _object(_json(doc, "Azure scheduled events") if isinstance(doc, str) else doc,
                   "Azure scheduled events")
    events = body.get("Events", [])
    if not isinstance(events, list):
        raise NoticeParseError("Azure scheduled events: Events is not a list")
    received = _utc(now)
    notices = []
    for item in events:
        event = _object(item, "Azure scheduled event")
        event_id, event_type = event.get("EventId"), event.get("EventType")
        if not isinstance(event_id, str) or not isinstance(event_type, str):
            raise NoticeParseError("Azure scheduled event: EventId and EventType are required")
        if event.get("EventStatus", "Scheduled") not in _AZURE_LIVE_STATUSES:
            continue
        resources = event.get("Resources") or []
        if resource_name is not None and resources and resource_name not in resources:
            continue
        not_before = event.get("NotBefore") or ""
        deadline = (
            _http_date(not_before, f"Azure event {event_id} NotBefore")
            if not_before else received
        )
        notices.append(Notice(
            provider="azure", kind=_AZURE_KINDS.get(event_type, SCHEDULED_MAINTENANCE),
            action=event_type.lower(), deadline=deadline, received_at=received,
            event_id=event_id, raw=event,
        ))
    return notices
