"""Unit tests of the watchers' pure parts: parsers, Notice, dedup, token logic, factory."""

from __future__ import annotations

import json
import logging
import math
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import requests

from hermit_common.settings import WatcherSettings
from hermit_node.control.watchers import (
    AwsImdsWatcher,
    AzureScheduledEventsWatcher,
    GcpMetadataWatcher,
    NoticeParseError,
    NullWatcher,
    build_watcher,
)
from hermit_node.control.watchers.base import WarningLimiter
from hermit_node.control.watchers.parse import (
    parse_aws_instance_action,
    parse_aws_rebalance,
    parse_aws_scheduled_events,
    parse_azure_events,
    parse_gcp_maintenance_event,
    parse_gcp_preempted,
)

NOW = datetime(2019, 1, 21, 8, 20, 0, tzinfo=UTC)

# Documents as AWS, GCP and Azure document them.
AWS_INSTANCE_ACTION = '{"action": "terminate", "time": "2019-01-21T08:22:00Z"}'
AWS_REBALANCE = '{"noticeTime": "2019-01-21T08:19:00Z"}'
AWS_SCHEDULED = json.dumps([
    {"NotBefore": "21 Jan 2019 09:00:43 GMT", "Code": "system-reboot",
     "Description": "scheduled reboot", "EventId": "instance-event-0d59937288b749b32",
     "NotAfter": "21 Jan 2019 09:17:23 GMT", "State": "active"},
    {"NotBefore": "14 Jan 2019 09:00:43 GMT", "Code": "instance-stop",
     "Description": "[Completed] scheduled stop", "EventId": "instance-event-0aaaaaaaaaaaaaaaa",
     "NotAfter": "14 Jan 2019 09:17:23 GMT", "State": "completed"},
    {"NotBefore": "22 Jan 2019 09:00:43 GMT", "Code": "instance-retirement",
     "Description": "[Canceled] retirement", "EventId": "instance-event-0bbbbbbbbbbbbbbbb",
     "NotAfter": "22 Jan 2019 09:17:23 GMT", "State": "canceled"},
])
AZURE_DOC: dict[str, Any] = {
    "DocumentIncarnation": 3,
    "Events": [
        {"EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123", "EventStatus": "Scheduled",
         "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": ["myspotvm"],
         "NotBefore": "Mon, 21 Jan 2019 08:20:30 GMT", "Description": "",
         "EventSource": "Platform", "DurationInSeconds": -1},
        {"EventId": "A123BC45-1234-5678-AB90-ABCDEF123456", "EventStatus": "Scheduled",
         "EventType": "Freeze", "ResourceType": "VirtualMachine",
         "Resources": ["WestNO_0", "WestNO_1"], "NotBefore": "Mon, 21 Jan 2019 08:35:00 GMT",
         "Description": "Virtual machine is being paused because of a memory-preserving "
                        "Live Migration operation.",
         "EventSource": "Platform", "DurationInSeconds": 5},
        {"EventId": "F020BA2E-3BC0-4C40-A10B-86575A9EABD5", "EventStatus": "Started",
         "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["myspotvm"],
         "NotBefore": "", "Description": "", "EventSource": "User",
         "DurationInSeconds": 15},
    ],
}


# -- AWS ----------------------------------------------------------------------


def test_aws_instance_action_gives_the_time_as_deadline() -> None:
    notice = parse_aws_instance_action(AWS_INSTANCE_ACTION, NOW)
    assert (notice.provider, notice.kind, notice.action) == ("aws", "spot-interruption",
                                                             "terminate")
    assert notice.deadline == datetime(2019, 1, 21, 8, 22, tzinfo=UTC)
    assert notice.seconds_left(NOW) == 120.0
    assert notice.received_at == NOW and notice.is_interruption
    assert notice.raw == {"action": "terminate", "time": "2019-01-21T08:22:00Z"}


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_aws_instance_action_other_actions(action: str) -> None:
    text = json.dumps({"action": action, "time": "2019-01-21T08:22:00Z"})
    assert parse_aws_instance_action(text, NOW).action == action


def test_aws_instance_action_event_id_is_stable_while_the_time_moves() -> None:
    # AEMM answers "request time + 2 minutes": the same notice must keep its key.
    a = parse_aws_instance_action(AWS_INSTANCE_ACTION, NOW)
    b = parse_aws_instance_action('{"action": "terminate", "time": "2019-01-21T08:22:05Z"}',
                                  NOW + timedelta(seconds=5))
    assert a.key == b.key


@pytest.mark.parametrize("text, message", [
    ("<html>404</html>", "not JSON"),
    ("[]", "expected a JSON object"),
    ('{"action": "explode", "time": "2019-01-21T08:22:00Z"}', "unknown action"),
    ('{"action": "terminate"}', "RFC 3339"),
    ('{"action": "terminate", "time": "soon"}', "not an RFC 3339 time"),
])
def test_aws_instance_action_rejects_malformed(text: str, message: str) -> None:
    with pytest.raises(NoticeParseError, match=message):
        parse_aws_instance_action(text, NOW)


def test_aws_rebalance_is_advisory() -> None:
    notice = parse_aws_rebalance(AWS_REBALANCE, NOW)
    assert notice.kind == "rebalance-recommendation" and notice.deadline is None
    assert math.isinf(notice.seconds_left(NOW)) and not notice.is_interruption
    with pytest.raises(NoticeParseError):
        parse_aws_rebalance('{"noticeTime": 5}', NOW)


def test_aws_scheduled_events_keep_only_active() -> None:
    notices = parse_aws_scheduled_events(AWS_SCHEDULED, NOW)
    assert len(notices) == 1
    (notice,) = notices
    assert notice.kind == "scheduled-maintenance" and notice.action == "system-reboot"
    assert notice.event_id == "instance-event-0d59937288b749b32"
    assert notice.deadline == datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC)
    assert parse_aws_scheduled_events("", NOW) == []
    assert parse_aws_scheduled_events("[]", NOW) == []


def test_aws_scheduled_events_rejects_malformed() -> None:
    with pytest.raises(NoticeParseError, match="JSON list"):
        parse_aws_scheduled_events("{}", NOW)
    with pytest.raises(NoticeParseError, match="not a date"):
        parse_aws_scheduled_events('[{"Code": "x", "EventId": "e", "NotBefore": "later"}]', NOW)


# -- GCP ----------------------------------------------------------------------


def test_gcp_preempted() -> None:
    assert parse_gcp_preempted("FALSE", NOW) is None
    notice = parse_gcp_preempted("TRUE", NOW, etag="abc")
    assert notice is not None
    assert (notice.kind, notice.action) == ("preemption", "terminate")
    assert notice.seconds_left(NOW) == 30.0 and notice.raw["etag"] == "abc"
    with pytest.raises(NoticeParseError, match="TRUE or FALSE"):
        parse_gcp_preempted("maybe", NOW)


def test_gcp_maintenance_event() -> None:
    assert parse_gcp_maintenance_event("NONE", NOW) is None
    terminate = parse_gcp_maintenance_event("TERMINATE_ON_HOST_MAINTENANCE", NOW)
    migrate = parse_gcp_maintenance_event("MIGRATE_ON_HOST_MAINTENANCE", NOW)
    assert terminate is not None and migrate is not None
    assert terminate.action == "terminate" and terminate.is_interruption
    assert migrate.action == "migrate" and not migrate.is_interruption
    assert terminate.seconds_left(NOW) == 60.0
    with pytest.raises(NoticeParseError, match="unknown value"):
        parse_gcp_maintenance_event("REBOOT_NOW", NOW)


# -- Azure --------------------------------------------------------------------


def test_azure_events() -> None:
    notices = {n.event_id: n for n in parse_azure_events(AZURE_DOC, NOW)}
    assert len(notices) == 3
    preempt = notices["C7061BAC-AFDC-4513-B24B-AA5F13A16123"]
    assert (preempt.provider, preempt.kind, preempt.action) == ("azure", "preemption", "preempt")
    assert preempt.seconds_left(NOW) == 30.0
    freeze = notices["A123BC45-1234-5678-AB90-ABCDEF123456"]
    assert freeze.kind == "scheduled-maintenance" and not freeze.is_interruption
    started = notices["F020BA2E-3BC0-4C40-A10B-86575A9EABD5"]
    assert started.deadline == NOW  # already underway


def test_azure_events_filter_by_resource_and_accept_text() -> None:
    mine = parse_azure_events(json.dumps(AZURE_DOC), NOW, resource_name="myspotvm")
    assert sorted(n.action for n in mine) == ["preempt", "reboot"]
    assert parse_azure_events({"DocumentIncarnation": 0, "Events": []}, NOW) == []
    done = {"Events": [{**AZURE_DOC["Events"][0], "EventStatus": "Completed"}]}
    assert parse_azure_events(done, NOW) == []


def test_azure_events_rejects_malformed() -> None:
    with pytest.raises(NoticeParseError, match="not a list"):
        parse_azure_events({"Events": {}}, NOW)
    with pytest.raises(NoticeParseError, match="EventId and EventType"):
        parse_azure_events({"Events": [{"EventType": "Preempt"}]}, NOW)


# -- shared machinery ---------------------------------------------------------


def test_fresh_yields_each_notice_once_and_forget_resets() -> None:
    watcher = NullWatcher(WatcherSettings(provider="none"))
    first = parse_aws_instance_action(AWS_INSTANCE_ACTION, NOW)
    again = parse_aws_instance_action(AWS_INSTANCE_ACTION, NOW + timedelta(seconds=1))
    assert watcher.fresh([first, again]) == [first]
    assert watcher.fresh([again]) == []
    watcher.forget("spot-interruption")
    assert watcher.fresh([again]) == [again]


def test_null_watcher_returns_when_stopped() -> None:
    stop = threading.Event()
    stop.set()
    assert list(NullWatcher(WatcherSettings(provider="none")).watch(stop)) == []


def test_warning_limiter_rate_limits(caplog: pytest.LogCaptureFixture) -> None:
    clock = [0.0]
    limiter = WarningLimiter(logging.getLogger("t"), interval=30.0, monotonic=lambda: clock[0])
    with caplog.at_level(logging.DEBUG, logger="t"):
        for _ in range(5):
            limiter.failed("k", "GET x failed")
            clock[0] += 1.0
        clock[0] = 31.0
        limiter.failed("k", "GET x failed")
        limiter.recovered("k")
        limiter.recovered("k")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert warnings == ["GET x failed", "GET x failed (4 more since the last warning)"]
    assert infos == ["k: working again"]


@pytest.mark.parametrize("provider, cls", [
    ("aws", AwsImdsWatcher), ("gcp", GcpMetadataWatcher),
    ("azure", AzureScheduledEventsWatcher), ("none", NullWatcher),
])
def test_build_watcher_picks_by_provider(provider: str, cls: type) -> None:
    watcher = build_watcher(WatcherSettings(provider=provider))
    assert type(watcher) is cls
    assert watcher.session.trust_env is False  # never through an environment proxy


class _ScriptedSession(requests.Session):
    """Answers from a script instead of the network (unit tests only)."""

    def __init__(self, answers: list[tuple[int, str] | Exception]) -> None:
        super().__init__()
        self.answers = answers
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    def request(self, method: str | bytes, url: str | bytes, *args: Any,
                **kwargs: Any) -> requests.Response:
        self.calls.append((str(method), str(url), dict(kwargs.get("headers") or {})))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        status, body = answer
        response = requests.Response()
        response.status_code = status
        response._content = body.encode()
        return response


def test_aws_token_is_reused_then_refreshed_before_expiry() -> None:
    now = [NOW]
    session = _ScriptedSession(
        [(200, "tok-1"), (404, ""), (404, ""), (200, "tok-2"), (404, "")])
    watcher = AwsImdsWatcher(WatcherSettings(aws_imds_url="http://imds"), session,
                             clock=lambda: now[0], token_ttl_seconds=100)
    assert watcher.fetch("/p") is None
    now[0] += timedelta(seconds=70)  # still fresh: reused
    assert watcher.fetch("/p") is None
    now[0] += timedelta(seconds=10)  # within the 25 s refresh margin of the 100 s TTL
    assert watcher.fetch("/p") is None
    methods = [(m, h.get("X-aws-ec2-metadata-token")) for m, _, h in session.calls]
    assert methods == [("PUT", None), ("GET", "tok-1"), ("GET", "tok-1"),
                       ("PUT", None), ("GET", "tok-2")]
    assert session.calls[0][2] == {"X-aws-ec2-metadata-token-ttl-seconds": "100"}


def test_aws_token_is_refreshed_on_401() -> None:
    session = _ScriptedSession([(200, "old"), (401, ""), (200, "new"), (200, AWS_REBALANCE)])
    watcher = AwsImdsWatcher(WatcherSettings(aws_imds_url="http://imds"), session,
                             clock=lambda: NOW)
    assert watcher.fetch("/p") == AWS_REBALANCE
    assert [h.get("X-aws-ec2-metadata-token") for _, _, h in session.calls] == [
        None, "old", None, "new"]


def test_aws_lost_token_put_backs_off_and_a_401_forces_a_retry() -> None:
    now = [NOW]
    refused = requests.ConnectionError("[Errno 111] Connection refused")
    session = _ScriptedSession([
        requests.Timeout("read timed out"), (404, ""), (404, ""), (404, ""),  # IMDSv1 works
        (404, ""), (404, ""), (404, ""),  # next poll: no PUT within the back-off
        (401, ""), (200, "tok"), (404, ""), (404, ""), (404, ""),  # 401 forces a PUT
        refused,  # unreachable: the poll stops at the first path
    ])
    watcher = AwsImdsWatcher(WatcherSettings(aws_imds_url="http://imds"), session,
                             clock=lambda: now[0])
    assert watcher.poll_once() == []
    now[0] += timedelta(seconds=5)
    assert watcher.poll_once() == []
    assert watcher.poll_once() == []
    assert watcher.poll_once() == []
    assert session.answers == []
    assert [m for m, _, _ in session.calls].count("PUT") == 2
