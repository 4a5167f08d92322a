"""The turn endpoint's limits (turnlimits, pure with a fake clock), its settings, and how
the service uses them: rate limits per source and per user, the TokenReview cache."""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest
from prometheus_client import REGISTRY

from hermit_common import metrics as hermit_metrics
from hermit_common import turnlimits
from hermit_common.errors import SettingsError
from hermit_common.kubeapi import KubeApiError
from hermit_common.settings import TURN_AUDIENCE, NodeSettings
from hermit_common.turnlimits import ConnectionSlots, Deadlines, RateLimiter, ReviewCache
from hermit_node.turns import turns
from tests.support.turns import FakeKube, post, service, snap


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the rate limiter -----------------------------------------------------------------------

def test_a_bucket_allows_its_burst_then_its_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(2.0, 3, clock=clock)
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b"), "another caller has its own bucket"
    assert limiter.retry_after("a") == pytest.approx(0.5)
    clock.now += 0.5
    assert limiter.allow("a") and not limiter.allow("a")
    clock.now += 100
    assert [limiter.allow("a") for _ in range(4)] == [True, True, True, False], \
        "the bucket refills up to the burst, no more"


def test_the_limiter_remembers_a_bounded_number_of_callers() -> None:
    limiter = RateLimiter(1.0, 1, max_keys=3, clock=Clock())
    for key in "abcd":
        assert limiter.allow(key)
    assert len(limiter._buckets) == 3 and "a" not in limiter._buckets


# -- the TokenReview cache ------------------------------------------------------------------

def test_reviews_are_cached_positive_and_negative_for_their_ttl() -> None:
    clock = Clock()
    cache: ReviewCache[dict[str, Any]] = ReviewCache(
        lambda r: bool(r["ok"]), ttl=20, negative_ttl=10, clock=clock)
    calls: list[str] = []

    def review(key: str, ok: bool) -> dict[str, Any]:
        return cache.get_or_compute(key, lambda: calls.append(key) or {"ok": ok})

    assert review("good", True) == {"ok": True} and review("good", True) == {"ok": True}
    assert review("junk", False) == {"ok": False} and review("junk", False) == {"ok": False}
    assert calls == ["good", "junk"]
    clock.now += 10.5
    review("good", True)
    review("junk", False)
    assert calls == ["good", "junk", "junk"], "a refusal is kept for the shorter ttl"
    clock.now += 10
    review("good", True)
    assert calls[-1] == "good" and cache.computed == 4


def test_the_cache_is_bounded_and_errors_are_not_cached() -> None:
    cache: ReviewCache[int] = ReviewCache(lambda v: True, max_entries=2, clock=Clock())
    for i, key in enumerate("abc"):
        cache.get_or_compute(key, lambda i=i: i)  # type: ignore[misc]
    assert len(cache) == 2 and cache.get("a") is None and cache.get("c") == 2

    def broken() -> int:
        raise OSError("the API server did not answer")

    with pytest.raises(OSError):
        cache.get_or_compute("d", broken)
    assert cache.get_or_compute("d", lambda: 7) == 7


def test_concurrent_requests_with_one_token_make_one_review() -> None:
    cache: ReviewCache[int] = ReviewCache(lambda v: False)
    release = threading.Event()
    calls: list[int] = []

    def slow() -> int:
        calls.append(1)
        release.wait(5)
        return 0

    out: list[int] = []
    threads = [threading.Thread(target=lambda: out.append(cache.get_or_compute("k", slow)))
               for _ in range(8)]
    for t in threads:
        t.start()
    threading.Timer(0.2, release.set).start()
    for t in threads:
        t.join(5)
    assert out == [0] * 8 and calls == [1]


def test_the_cache_key_is_a_hash_of_token_and_audience() -> None:
    key = turnlimits.token_key("secret-token", ("hermit.dev/turns",))
    assert "secret" not in key and len(key) == 64
    assert key != turnlimits.token_key("secret-token", ())


# -- connections and deadlines --------------------------------------------------------------

def test_connection_slots_cap_the_total_and_each_source() -> None:
    slots = ConnectionSlots(total=3, per_source=2)
    assert slots.take("a") and slots.take("a") and not slots.take("a")
    assert slots.take("b") and not slots.take("c"), "the total is reached"
    slots.give("a")
    assert slots.take("c") and slots.open == 3


def test_deadlines_pop_what_expired_and_forget_what_was_disarmed() -> None:
    clock = Clock()
    deadlines = Deadlines(clock)
    first, second = deadlines.arm(1, "slow"), deadlines.arm(2, "fast")
    assert deadlines.disarm(second)
    clock.now += 1.5
    assert deadlines.expired() == ["slow"]
    clock.now += 1
    assert deadlines.expired() == []
    assert not deadlines.disarm(first), "an expired one reports it was cut off"


def test_the_request_budget_refuses_a_head_past_it() -> None:
    import http.client

    from hermit_common.hardhttp import _Budget

    budget = _Budget(io.BytesIO(b"GET / HTTP/1.0\r\n" + b"X: " + b"a" * 100 + b"\r\n"), 32)
    assert budget.readline(65537) == b"GET / HTTP/1.0\r\n"
    assert len(budget.readline(65537)) == 16
    with pytest.raises(http.client.LineTooLong):
        budget.readline(65537)


# -- the service: rates and the cache -------------------------------------------------------

class CountingKube(FakeKube):
    def __init__(self) -> None:
        super().__init__()
        self.token_reviews = 0

    def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
        self.token_reviews += 1
        return super().review_token(token, audiences)


def test_a_source_over_its_rate_gets_429_before_any_review() -> None:
    kube = CountingKube()
    svc = service(kube, [], guards=turns.Guards(sources=RateLimiter(1.0, 2, clock=Clock())))
    replies = [svc.handle("/x", "Bearer junk", b"{}", source="10.0.0.9") for _ in range(5)]
    assert [r.status for r in replies] == [404, 404, 429, 429, 429]
    assert replies[2].body["retryAfterSeconds"] == 1
    assert svc.handle("/x", None, b"", source="10.0.0.10").status == 404
    assert kube.token_reviews == 0


def test_junk_tokens_are_reviewed_once_each_then_cached() -> None:
    kube = CountingKube()
    svc = service(kube, [])
    for _ in range(3):
        for token in ("junk-1", "junk-2"):
            assert post(svc, 1, token=token).status == 401
    assert kube.token_reviews == 2


def _reviews_counted() -> dict[str, float]:
    return {result: REGISTRY.get_sample_value(hermit_metrics.NODE_TURN_TOKEN_REVIEWS,
                                              {"result": result}) or 0.0
            for result in hermit_metrics.TOKEN_REVIEW_RESULTS}


def test_each_token_review_sent_is_counted_by_result_and_cache_hits_are_not() -> None:
    class Failing(CountingKube):
        def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
            if token == "no-api":
                raise KubeApiError("tokenreviews create failed: timed out")
            return super().review_token(token, audiences)

    kube = Failing()
    svc = service(kube, [snap()])
    before = _reviews_counted()
    for _ in range(3):
        assert post(svc, 1, token="junk-1").status == 401
    assert post(svc, 1, token="junk-2").status == 401
    assert [post(svc, 1).status, post(svc, 1).status] == [201, 200]  # a repeat: cached
    assert post(svc, 2, token="no-api").status == 503  # not cached: sent again
    assert post(svc, 2, token="no-api").status == 503
    after = _reviews_counted()
    assert {k: after[k] - before[k] for k in after} == {
        "authenticated": 1, "unauthenticated": 2, "error": 2}
    assert kube.token_reviews == 3


def test_an_authenticated_user_over_its_rate_gets_429() -> None:
    kube = CountingKube()
    svc = service(kube, [snap() for _ in range(3)],
                  guards=turns.Guards(users=RateLimiter(1.0, 2, clock=Clock())))
    assert [post(svc, n).status for n in (1, 2, 3)] == [201, 201, 429]
    assert "system:serviceaccount:agents:harness" in post(svc, 4).body["error"]
    assert kube.token_reviews == 1


def test_the_default_audience_is_hermits_own() -> None:
    kube = FakeKube()
    post(turns.TurnService("n", kube, lambda sp: snap(), lambda sp: None,
                           spawn=lambda fn: fn(), sleep=lambda s: None), 1)
    assert kube.audiences == [[TURN_AUDIENCE]] and TURN_AUDIENCE == "hermit.dev/turns"


# -- settings -------------------------------------------------------------------------------

BASE = {"HERMIT_NODE_NAME": "n", "HERMIT_S3_BUCKET": "b"}


def test_the_turn_audience_defaults_to_hermits_and_opts_out_explicitly() -> None:
    assert NodeSettings.from_env(BASE).turn_audience == "hermit.dev/turns"
    assert NodeSettings.from_env({**BASE, "HERMIT_TURN_AUDIENCE": ""}).turn_audience == \
        "hermit.dev/turns", "empty is the default, not the API server's audiences"
    assert NodeSettings.from_env(
        {**BASE, "HERMIT_TURN_AUDIENCE": "@api-server"}).turn_audience == ""
    assert NodeSettings.from_env(
        {**BASE, "HERMIT_TURN_AUDIENCE": "my-turns"}).turn_audience == "my-turns"
    with pytest.raises(SettingsError, match="HERMIT_TURN_AUDIENCE"):
        NodeSettings.from_env({**BASE, "HERMIT_TURN_AUDIENCE": "@apiserver"})


def test_turn_tls_needs_both_files() -> None:
    s = NodeSettings.from_env({**BASE, "HERMIT_TURN_TLS_CERT_FILE": "/c",
                               "HERMIT_TURN_TLS_KEY_FILE": "/k"})
    assert (s.turn_tls_cert_file, s.turn_tls_key_file) == ("/c", "/k")
    assert NodeSettings.from_env(BASE).turn_tls_cert_file is None
    with pytest.raises(SettingsError, match="HERMIT_TURN_TLS_KEY_FILE"):
        NodeSettings.from_env({**BASE, "HERMIT_TURN_TLS_CERT_FILE": "/c"})


def test_unusable_tls_files_fail_at_start_naming_the_settings(tmp_path: Any) -> None:
    from hermit_node.turns import turnserver

    (tmp_path / "c").write_text("not a certificate")
    (tmp_path / "k").write_text("not a key")
    s = NodeSettings.from_env({**BASE, "HERMIT_TURN_TLS_CERT_FILE": str(tmp_path / "c"),
                               "HERMIT_TURN_TLS_KEY_FILE": str(tmp_path / "k")})
    with pytest.raises(SettingsError, match="HERMIT_TURN_TLS_CERT_FILE"):
        turnserver.tls_of(s)
