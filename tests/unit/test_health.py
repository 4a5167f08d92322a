"""The shared health port: heartbeats, and the HTTP server that answers the probes and
serves the metrics (a real server on a loopback port; no other service)."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from hermit_common.health import (
    LIVENESS_PATH,
    READINESS_PATH,
    Heartbeats,
    Verdict,
    age,
    serve,
)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_heartbeats_remember_the_last_beat() -> None:
    clock = Clock()
    beats = Heartbeats(clock)
    assert beats.last("loop") is None
    beats.beat("loop")
    clock.now += 7
    assert beats.last("loop") == 1000.0
    assert beats.now() == 1007.0
    assert age(beats.last("loop"), beats.now()) == 7.0
    assert age(None, beats.now()) is None


def _get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def base_url() -> Iterator[str]:
    def broken() -> Verdict:
        raise RuntimeError("boom")

    server = serve(0, lambda: Verdict(True, "all good"), broken, host="127.0.0.1")
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_probes_answer_200_when_ok_and_503_with_the_reason_when_not(base_url: str) -> None:
    assert _get(base_url + LIVENESS_PATH) == (200, "ok: all good\n")
    assert _get(base_url + LIVENESS_PATH + "?verbose=1") == (200, "ok: all good\n")
    status, body = _get(base_url + READINESS_PATH)  # its check raises: a bug, not a hang
    assert (status, body) == (503, "the check raised RuntimeError: boom\n")


def test_every_other_path_serves_the_metrics(base_url: str) -> None:
    for path in ("/metrics", "/"):
        status, body = _get(base_url + path)
        assert status == 200
        assert "# TYPE python_info gauge" in body or "# HELP" in body
