"""Watchers against real services: AEMM for AWS, and the real HTTP fakes for GCP and Azure."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import pytest
import requests

from hermit_common.settings import WatcherSettings
from hermit_node.control.watchers import (
    AwsImdsWatcher,
    AzureScheduledEventsWatcher,
    GcpMetadataWatcher,
    MetadataUnavailable,
    Notice,
    Watcher,
    build_watcher,
)
from tests.fakes.azure_events import AzureEventsServer
from tests.fakes.gcp_metadata import GcpMetadataServer, etag_of
from tests.support.aemm import AemmFactory
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

POLL = 0.2


class Watching:
    """Runs ``watcher.watch(stop)`` in a thread; the test reads notices with deadlines."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher
        self.stop = threading.Event()
        self.notices: queue.Queue[Notice] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for notice in self.watcher.watch(self.stop):
            self.notices.put(notice)

    def next(self, timeout: float) -> Notice:
        try:
            return self.notices.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no notice from {self.watcher.provider} within {timeout} s")

    def nothing_for(self, seconds: float) -> None:
        try:
            extra = self.notices.get(timeout=seconds)
        except queue.Empty:
            return
        pytest.fail(f"unexpected extra notice: {extra}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "watch() did not return after stop was set"


@pytest.fixture
def watching() -> Iterator[Callable[[Watcher], Watching]]:
    started: list[Watching] = []

    def start(watcher: Watcher) -> Watching:
        started.append(Watching(watcher))
        return started[-1]

    yield start
    for w in started:
        w.close()


def settings(**kwargs: object) -> WatcherSettings:
    values: dict[str, object] = {"poll_interval_seconds": POLL, "request_timeout_seconds": 1.0}
    return WatcherSettings(**{**values, **kwargs})  # type: ignore[arg-type]


# -- AWS against the real amazon-ec2-metadata-mock ---------------------------


def test_aws_spot_interruption_with_imdsv2(aemm: AemmFactory,
                                          watching: Callable[[Watcher], Watching]) -> None:
    server = aemm("spot", "--imdsv2", "--mock-delay-sec", "2", "--rebalance-delay-sec", "600")
    # IMDSv2 really is enforced: no token, no answer.
    assert requests.get(server.url + "/latest/meta-data/spot/instance-action",
                        timeout=2).status_code == 401
    watcher = AwsImdsWatcher(settings(provider="aws", aws_imds_url=server.url))
    assert watcher.poll_once() == []  # before the mock delay: 404, no notice
    w = watching(watcher)
    notice = w.next(timeout=10)
    seen = datetime.now(UTC)
    assert (notice.provider, notice.kind, notice.action) == ("aws", "spot-interruption",
                                                             "terminate")
    assert notice.deadline is not None
    assert abs((notice.deadline - notice.received_at).total_seconds() - 120) <= 2
    assert 115 <= notice.seconds_left(seen) <= 121
    w.nothing_for(1.0)  # polled again several times: the same notice is not repeated
    assert watcher.warnings._last == {}, "no endpoint should be failing"


def test_aws_rebalance_recommendation(aemm: AemmFactory) -> None:
    server = aemm("spot", "--mock-delay-sec", "600", "--rebalance-delay-sec", "0")
    watcher = AwsImdsWatcher(settings(provider="aws", aws_imds_url=server.url))
    notices = watcher.poll_once()
    assert [(n.kind, n.deadline) for n in notices] == [("rebalance-recommendation", None)]
    assert not notices[0].is_interruption


def test_aws_scheduled_maintenance_event(aemm: AemmFactory) -> None:
    server = aemm("events", "--code", "instance-stop", "--state", "active", "--imdsv2")
    notices = AwsImdsWatcher(settings(provider="aws", aws_imds_url=server.url)).poll_once()
    assert len(notices) == 1
    assert (notices[0].kind, notices[0].action) == ("scheduled-maintenance", "instance-stop")
    assert notices[0].event_id.startswith("instance-event-")
    assert notices[0].deadline is not None


def test_aws_token_expiry_and_aemm_restart(aemm: AemmFactory,
                                          caplog: pytest.LogCaptureFixture) -> None:
    server = aemm("spot", "--imdsv2")
    watcher = AwsImdsWatcher(settings(provider="aws", aws_imds_url=server.url),
                             token_ttl_seconds=2)
    assert {n.kind for n in watcher.poll_once()} >= {"spot-interruption"}
    first = watcher.token()
    wait_until("a refreshed token before expiry", 5, lambda: watcher.token() != first, 0.05)
    assert {n.kind for n in watcher.poll_once()} >= {"spot-interruption"}

    # A restarted IMDS forgets its tokens: the 401 makes the watcher get a new one.
    watcher.token_ttl_seconds = 21600
    watcher.token(force=True)
    server.restart()
    stale = watcher.token()
    assert requests.get(server.url + "/latest/meta-data/spot/instance-action", timeout=2,
                        headers={"X-aws-ec2-metadata-token": stale or ""}).status_code == 401
    assert {n.kind for n in watcher.poll_once()} >= {"spot-interruption"}
    assert watcher.token() != stale

    # Unreachable for a while: poll_once keeps returning, with rate-limited warnings.
    server.stop()
    with caplog.at_level(logging.DEBUG, logger="hermit.watchers.aws"):
        started = time.monotonic()
        for _ in range(5):
            assert watcher.poll_once() == []
        assert time.monotonic() - started < 10
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert 1 <= len(warnings) <= 4, "one warning per failing endpoint, not one per poll"
        assert "cannot connect (Connection refused)" in warnings[0].getMessage()
        server.start()
        assert {n.kind for n in watcher.poll_once()} >= {"spot-interruption"}
    assert any("working again" in r.getMessage() for r in caplog.records)


def test_aws_watch_survives_an_outage_and_reports_once(
        aemm: AemmFactory, watching: Callable[[Watcher], Watching]) -> None:
    server = aemm("spot", "--imdsv2", "--mock-delay-sec", "600", "--rebalance-delay-sec", "600")
    watcher = AwsImdsWatcher(settings(provider="aws", aws_imds_url=server.url))
    w = watching(watcher)
    w.nothing_for(1.0)
    server.stop()
    w.nothing_for(1.0)  # connection refused, polling goes on
    server.args = ("spot", "--imdsv2", "--mock-delay-sec", "0", "--rebalance-delay-sec", "600")
    server.start()
    notice = w.next(timeout=10)
    assert notice.kind == "spot-interruption"
    w.nothing_for(1.0)


def test_build_watcher_aws(aemm: AemmFactory) -> None:
    server = aemm("spot")
    watcher = build_watcher(WatcherSettings.from_env({
        "HERMIT_CLOUD_PROVIDER": "aws", "HERMIT_AWS_IMDS_URL": server.url}))
    assert isinstance(watcher, AwsImdsWatcher)
    assert "spot-interruption" in {n.kind for n in watcher.poll_once()}


# -- GCP against the fake metadata server -------------------------------------


@pytest.fixture
def gcp() -> Iterator[GcpMetadataServer]:
    with GcpMetadataServer() as server:
        yield server


def test_gcp_fake_requires_the_flavor_header(gcp: GcpMetadataServer) -> None:
    url = gcp.url + "/computeMetadata/v1/instance/preempted"
    assert requests.get(url, timeout=2).status_code == 403
    ok = requests.get(url, timeout=2, headers={"Metadata-Flavor": "Google"})
    assert (ok.status_code, ok.text, ok.headers["Metadata-Flavor"]) == (200, "FALSE", "Google")


def test_gcp_preemption_is_seen_through_the_long_poll(
        gcp: GcpMetadataServer, watching: Callable[[Watcher], Watching]) -> None:
    watcher = GcpMetadataWatcher(settings(provider="gcp", gcp_metadata_url=gcp.url,
                                          poll_interval_seconds=2.0), long_poll_seconds=30)
    assert watcher.poll_once() == []
    w = watching(watcher)
    wait_until("a long-poll with last_etag", 5, lambda: any(
        r.query.get("last_etag") for r in gcp.requests_for("preempted")), 0.05)
    flipped = time.monotonic()
    gcp.set("preempted", "TRUE")
    notice = w.next(timeout=5)
    # Seen at once, not at the next 2 s poll: the long-poll answered on the change.
    assert time.monotonic() - flipped < 1.0
    assert (notice.provider, notice.kind) == ("gcp", "preemption")
    assert 28 <= notice.seconds_left(datetime.now(UTC)) <= 30
    long_polls = [r for r in gcp.requests_for("preempted") if r.query.get("last_etag")]
    assert long_polls[0].query["wait_for_change"] == "true"
    assert long_polls[0].query["timeout_sec"] == "30"
    w.nothing_for(0.5)


def test_gcp_maintenance_events_repeat(gcp: GcpMetadataServer,
                                       watching: Callable[[Watcher], Watching]) -> None:
    watcher = GcpMetadataWatcher(settings(provider="gcp", gcp_metadata_url=gcp.url),
                                 long_poll_seconds=5)
    w = watching(watcher)
    gcp.set("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
    assert w.next(timeout=5).action == "migrate"
    gcp.set("maintenance-event", "NONE")
    wait_until("the watcher to read NONE and long-poll on it", 5, lambda: any(
        r.query.get("last_etag") == etag_of("NONE")
        for r in gcp.requests_for("maintenance-event")), 0.05)
    gcp.set("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
    notice = w.next(timeout=5)
    assert (notice.kind, notice.action) == ("scheduled-maintenance", "terminate")


def test_gcp_survives_errors_and_timeouts(gcp: GcpMetadataServer,
                                          watching: Callable[[Watcher], Watching],
                                          caplog: pytest.LogCaptureFixture) -> None:
    watcher = GcpMetadataWatcher(settings(provider="gcp", gcp_metadata_url=gcp.url),
                                 long_poll_seconds=2)
    gcp.fail_next(4, status=503)
    gcp.delay_next(1.5, count=2, name="preempted")  # beyond the 1 s request timeout
    gcp.missing.add("maintenance-event")
    with caplog.at_level(logging.DEBUG, logger="hermit.watchers.gcp"):
        assert watcher.poll_once() == []
        w = watching(watcher)
        w.nothing_for(1.5)
        gcp.set("preempted", "TRUE")
        assert w.next(timeout=8).kind == "preemption"
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "HTTP 503" in messages and "timed out" in messages and "HTTP 404" in messages


# -- Azure against the fake Scheduled Events server ---------------------------


@pytest.fixture
def azure() -> Iterator[AzureEventsServer]:
    with AzureEventsServer(vm_name="hermit-vm-0") as server:
        yield server


def test_azure_fake_requires_the_metadata_header(azure: AzureEventsServer) -> None:
    url = azure.url + "/metadata/scheduledevents?api-version=2020-07-01"
    bad = requests.get(url, timeout=2)
    assert bad.status_code == 400 and "metadata header" in bad.json()["error"]
    assert requests.get(azure.url + "/metadata/scheduledevents", timeout=2,
                        headers={"Metadata": "true"}).status_code == 400


def test_azure_preempt_notice_and_acknowledgment(
        azure: AzureEventsServer, watching: Callable[[Watcher], Watching]) -> None:
    watcher = AzureScheduledEventsWatcher(settings(provider="azure",
                                                   azure_metadata_url=azure.url))
    assert watcher.poll_once() == []
    assert watcher.resource_name == "hermit-vm-0"
    w = watching(watcher)
    azure.add_event("Reboot", resources=["some-other-vm"])  # not ours: filtered out
    not_before = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=30)
    event_id = azure.add_event("Preempt", not_before=not_before)
    notice = w.next(timeout=5)
    assert (notice.provider, notice.kind, notice.event_id) == ("azure", "preemption", event_id)
    assert notice.deadline == not_before
    assert watcher.document_incarnation == azure.incarnation
    watcher.acknowledge(notice)
    assert azure.acks == [event_id]
    assert azure.document()["Events"][1]["EventStatus"] == "Started"
    w.nothing_for(1.0)  # the started event is the same event: not yielded again
    with pytest.raises(MetadataUnavailable, match="HTTP 400"):
        watcher.acknowledge(Notice(provider="azure", kind="preemption", action="preempt",
                                   deadline=None, received_at=notice.received_at,
                                   event_id="no-such-event"))


def test_azure_survives_errors_and_slow_answers(
        azure: AzureEventsServer, watching: Callable[[Watcher], Watching],
        caplog: pytest.LogCaptureFixture) -> None:
    watcher = AzureScheduledEventsWatcher(settings(provider="azure",
                                                   azure_metadata_url=azure.url),
                                          resource_name="hermit-vm-0")
    azure.fail_next(3, status=503)
    azure.delay_next(1.5, count=2)
    with caplog.at_level(logging.WARNING, logger="hermit.watchers.azure"):
        w = watching(watcher)
        w.nothing_for(1.0)
        azure.add_event("Preempt")
        assert w.next(timeout=8).kind == "preemption"
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "HTTP 503" in messages or "timed out" in messages
