"""The fault suite's metadata server, met by the node-agent's real AWS watcher: no fault
raises out of a poll or reads as a notice, a hang costs at most the request timeout,
and a notice (or its withdrawal) is read as such."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import requests

from hermit_common.settings import WatcherSettings
from hermit_node.control.watchers.aws import INSTANCE_ACTION_PATH, AwsImdsWatcher
from hermit_node.control.watchers.notice import Notice
from hermit_testbed import faulty_imds as fi

TIMEOUT = 0.3


@pytest.fixture
def imds() -> Iterator[fi.FaultyImds]:
    with fi.FaultyImds() as server:
        yield server


def _watcher(imds: fi.FaultyImds) -> AwsImdsWatcher:
    return AwsImdsWatcher(WatcherSettings(aws_imds_url=imds.url, request_timeout_seconds=TIMEOUT,
                                          poll_interval_seconds=0.1))


@pytest.mark.parametrize("mode", sorted(fi.FAULTS))
def test_a_fault_is_no_notice_and_raises_nothing(imds: fi.FaultyImds, mode: str) -> None:
    imds.set(mode)
    started = time.monotonic()
    assert _watcher(imds).poll_once() == []
    assert imds.served(mode) >= 1
    assert time.monotonic() - started < 2 * TIMEOUT + 1.0  # token PUT + one GET at most


def test_a_notice_is_read_with_its_deadline_and_a_withdrawal_is_quiet(
        imds: fi.FaultyImds) -> None:
    watcher = _watcher(imds)
    assert watcher.poll_once() == []
    when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    imds.set(fi.NOTICE, when)
    [notice] = watcher.poll_once()
    assert notice.is_interruption and notice.deadline == when
    imds.set(fi.CANCELLED)
    assert watcher.poll_once() == []


def test_the_watch_loop_goes_on_after_a_hang(imds: fi.FaultyImds) -> None:
    imds.set(fi.HANG)
    watcher = _watcher(imds)
    stop = threading.Event()
    seen: list[Notice] = []

    def watch() -> None:
        seen.extend(watcher.watch(stop))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while imds.served(fi.HANG) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    imds.set(fi.NOTICE, datetime.now(UTC) + timedelta(seconds=30))
    while not seen and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    stop.set()
    thread.join(5)
    assert imds.served(fi.HANG) >= 2 and len(seen) == 1, seen


def test_raw_answers(imds: fi.FaultyImds) -> None:
    assert fi.answer(fi.OK, "PUT", fi.TOKEN_PATH, None).status == 200
    assert fi.answer(fi.OK, "GET", INSTANCE_ACTION_PATH, None).status == 404
    assert fi.answer(fi.CANCELLED, "GET", INSTANCE_ACTION_PATH, None).status == 404
    assert fi.answer(fi.ERROR500, "PUT", fi.TOKEN_PATH, None).status == 500
    when = datetime(2030, 1, 1, tzinfo=UTC)
    body = fi.answer(fi.NOTICE, "GET", INSTANCE_ACTION_PATH, when).body
    assert body == b'{"action": "terminate", "time": "2030-01-01T00:00:00Z"}'
    with pytest.raises(ValueError):
        imds.set("nonsense")


def test_a_stopped_server_refuses(imds: fi.FaultyImds) -> None:
    url = imds.url
    imds.stop()
    with pytest.raises(requests.ConnectionError):
        requests.get(url + INSTANCE_ACTION_PATH, timeout=1)
