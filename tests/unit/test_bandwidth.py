"""The node's upload limiter (hermit_common.bandwidth): the pure schedule under a fake
clock, then the threaded limiter's gate, stop and deadline."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from unittest.mock import Mock

import pytest

from hermit_common.bandwidth import ROUTINE, URGENT, Schedule, UploadLimiter

MIB = 1024 * 1024


class Sim:
    """Drives a Schedule like the threaded limiter does: every open upload keeps
    ``depth`` requests of ``size`` bytes waiting (its PUT threads), a granted request is
    sent at once; the clock jumps to the next time the schedule names."""

    def __init__(self, rate: float, size: int = MIB, depth: int = 4) -> None:
        self.schedule = Schedule(rate)
        self.size, self.depth = size, depth
        self.now = 0.0
        self.owner: dict[int, int] = {}  # request -> upload
        self.left: dict[int, int] = {}  # upload -> chunks not asked yet
        self.sent: list[tuple[float, int]] = []  # (time, upload) of each grant

    def open(self, klass: str, chunks: int) -> int:
        upload = self.schedule.open(klass)
        self.left[upload] = chunks
        self._refill(upload)
        return upload

    def _refill(self, upload: int) -> None:
        waiting = sum(1 for u in self.owner.values() if u == upload)
        while self.left.get(upload, 0) > 0 and waiting < self.depth:
            self.owner[self.schedule.ask(upload, self.size)] = upload
            self.left[upload] -= 1
            waiting += 1

    def step(self) -> float | None:
        """Grants what may go now, then moves the clock on; None when nothing may go."""
        granted, at = self.schedule.grant(self.now)
        for rid in granted:
            upload = self.owner.pop(rid)
            self.sent.append((self.now, upload))
            self._refill(upload)
        if granted:
            return self.now
        if at is None:
            return None
        self.now = at
        return at

    def run_until(self, end: float) -> None:
        while self.now <= end and self.step() is not None:
            pass

    def done(self, upload: int) -> bool:
        return self.left[upload] == 0 and upload not in self.owner.values()


def test_the_rate_is_kept_and_never_exceeded() -> None:
    sim = Sim(rate=8 * MIB)
    sim.open(ROUTINE, chunks=100)
    sim.run_until(10.0)
    # Granted bytes by any time t: at most rate * t + one chunk (the one granted at t).
    for t, _ in sim.sent:
        assert sum(1 for s, _ in sim.sent if s <= t) * MIB <= 8 * MIB * t + MIB
    sent_in_10s = sum(1 for s, _ in sim.sent if s < 10.0) * MIB
    assert sent_in_10s == pytest.approx(80 * MIB, rel=0.02)


def test_no_burst_after_an_idle_spell() -> None:
    schedule = Schedule(MIB)
    upload = schedule.open(ROUTINE)
    first = schedule.ask(upload, MIB)
    assert schedule.grant(0.0) == ([first], None)
    # Idle for 100 s: the next chunk goes at once, the one after a second later.
    second, third = schedule.ask(upload, MIB), schedule.ask(upload, MIB)
    assert schedule.grant(100.0) == ([second], 101.0)
    assert schedule.grant(100.5) == ([], 101.0)
    assert schedule.grant(101.0) == ([third], None)


def test_two_routine_uploads_share_evenly() -> None:
    sim = Sim(rate=4 * MIB, depth=8)
    a = sim.open(ROUTINE, chunks=40)
    b = sim.open(ROUTINE, chunks=40)
    sim.run_until(5.0)
    counts = Counter(u for t, u in sim.sent if t < 5.0)
    assert abs(counts[a] - counts[b]) <= 1
    assert counts[a] + counts[b] == pytest.approx(20, abs=1)


def test_turns_go_round_whatever_the_number_of_waiting_threads() -> None:
    schedule = Schedule(MIB)
    a, b = schedule.open(ROUTINE), schedule.open(ROUTINE)
    asked = {schedule.ask(a, MIB): a for _ in range(8)}  # a has 8 threads waiting
    asked |= {schedule.ask(b, MIB): b}  # b has one
    order = []
    now = 0.0
    while len(order) < 3:
        granted, at = schedule.grant(now)
        order += [asked[r] for r in granted]
        now = at if at is not None else now
    assert order == [a, b, a]


def test_an_urgent_upload_holds_routine_back_until_it_ends() -> None:
    sim = Sim(rate=8 * MIB)
    routine = sim.open(ROUTINE, chunks=40)
    sim.run_until(1.0)
    before = sum(1 for _, u in sim.sent if u == routine)
    urgent = sim.open(URGENT, chunks=16)
    while not sim.done(urgent):
        assert sim.step() is not None
    urgent_end = sim.now
    # The urgent upload had the whole rate: 16 MiB at 8 MiB/s.
    assert urgent_end - 1.0 == pytest.approx(2.0, abs=0.15)
    assert sum(1 for _, u in sim.sent if u == routine) == before  # not one routine chunk
    sim.schedule.close(urgent)
    sim.run_until(urgent_end + 1.0)
    assert sum(1 for _, u in sim.sent if u == routine) >= before + 7  # resumed at the rate


def test_routine_waits_while_an_urgent_upload_is_open_even_unlimited() -> None:
    schedule = Schedule(0)
    routine = schedule.open(ROUTINE)
    urgent = schedule.open(URGENT)  # open, between chunks (e.g. CRIU still dumping)
    waiting = schedule.ask(routine, MIB)
    assert schedule.grant(0.0) == ([], None)
    sent = schedule.ask(urgent, 5 * MIB)
    assert schedule.grant(0.0) == ([sent], None)
    schedule.close(urgent)
    assert schedule.grant(0.0) == ([waiting], None)


def test_a_promoted_routine_upload_goes_with_the_urgent_ones() -> None:
    schedule = Schedule(0)
    mine = schedule.open(ROUTINE, ("ns", "a"))
    other = schedule.open(ROUTINE, ("ns", "b"))
    schedule.open(URGENT, ("ns", "c"))
    mine_waits, other_waits = schedule.ask(mine, MIB), schedule.ask(other, MIB)
    assert schedule.grant(0.0) == ([], None)  # both held back by the urgent upload
    assert schedule.promote(("ns", "a")) == 1
    assert schedule.class_of(mine) == URGENT and schedule.class_of(other) == ROUTINE
    assert schedule.grant(0.0) == ([mine_waits], None)  # only the promoted one
    assert schedule.promote(("ns", "a")) == 0  # already urgent
    assert schedule.promote(("ns", "z")) == 0
    schedule.close(mine)
    assert schedule.active(URGENT) == 1 and schedule.active(ROUTINE) == 1
    assert other_waits not in schedule.grant(0.0)[0]


def test_limiter_promote_releases_a_held_routine_put() -> None:
    waits: list[tuple[str, float]] = []
    limiter = UploadLimiter(0, on_wait=lambda k, s: waits.append((k, s)))
    with limiter.upload(ROUTINE, key=("ns", "a")) as routine, limiter.upload(URGENT):
        thread, out = _in_thread(lambda: routine.acquire(MIB))
        thread.join(0.2)
        assert thread.is_alive() and not out  # held back
        assert limiter.promote(("ns", "a")) == 1
        thread.join(5.0)
        assert out == [True]
        assert limiter.active(URGENT) == 2
    assert waits == [(URGENT, waits[0][1])]  # counted as what it was when granted


def test_unlimited_never_waits() -> None:
    schedule = Schedule(0)
    uploads = [schedule.open(ROUTINE) for _ in range(3)]
    asked = [schedule.ask(u, 64 * MIB) for u in uploads for _ in range(10)]
    granted, at = schedule.grant(0.0)
    assert sorted(granted) == sorted(asked) and at is None


def test_urgent_uploads_share_among_themselves() -> None:
    sim = Sim(rate=2 * MIB)
    a, b = sim.open(URGENT, chunks=20), sim.open(URGENT, chunks=20)
    sim.run_until(4.0)
    counts = Counter(u for t, u in sim.sent if t < 4.0)
    assert abs(counts[a] - counts[b]) <= 1


def test_a_closed_or_cancelled_request_is_never_granted() -> None:
    schedule = Schedule(MIB)
    a, b = schedule.open(ROUTINE), schedule.open(ROUTINE)
    assert schedule.grant(0.0) == ([], None)
    first = schedule.ask(a, MIB)
    assert schedule.grant(0.0) == ([first], None)
    gone, kept = schedule.ask(a, MIB), schedule.ask(b, MIB)
    cancelled = schedule.ask(b, MIB)
    schedule.cancel(cancelled)
    schedule.close(a)
    assert schedule.grant(1.0) == ([kept], None)
    assert gone not in schedule.grant(5.0)[0]
    assert schedule.active(ROUTINE) == 1 and schedule.active(URGENT) == 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        Schedule(-1)
    with pytest.raises(ValueError):
        Schedule(0).open("bulk")
    schedule = Schedule(0)
    upload = schedule.open(ROUTINE)
    schedule.close(upload)
    with pytest.raises(ValueError, match="is closed"):
        schedule.ask(upload, 1)


# -- the threaded limiter ----------------------------------------------------------------

def _in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(target()), daemon=True)
    thread.start()
    return thread, out


def test_limiter_gate_holds_a_routine_put_until_the_urgent_upload_ends() -> None:
    waits: list[tuple[str, float]] = []
    limiter = UploadLimiter(0, on_wait=lambda k, s: waits.append((k, s)))
    with limiter.upload(ROUTINE) as routine:
        assert routine.acquire(MIB)  # unlimited, no urgent: at once
        with limiter.upload(URGENT) as urgent:
            assert limiter.active(URGENT) == 1
            thread, out = _in_thread(lambda: routine.acquire(MIB))
            assert urgent.acquire(10 * MIB)
            thread.join(0.3)
            assert thread.is_alive() and not out  # held back
        thread.join(5.0)
        assert out == [True]
    assert [k for k, _ in waits] == [ROUTINE, URGENT, ROUTINE]
    assert waits[-1][1] >= 0.3
    assert limiter.active(ROUTINE) == limiter.active(URGENT) == 0


def test_limiter_gives_up_on_stop_and_deadline() -> None:
    limiter = UploadLimiter(0)
    stop = threading.Event()
    with limiter.upload(ROUTINE) as routine, limiter.upload(URGENT):
        thread, out = _in_thread(lambda: routine.acquire(MIB, stop))
        stop.set()
        thread.join(5.0)
        assert out == [False]
        began = time.monotonic()
        assert not routine.acquire(MIB, None, began + 0.2)
        assert time.monotonic() - began < 2.0


def test_limiter_keeps_the_rate_in_real_time() -> None:
    limiter = UploadLimiter(20 * MIB)
    began = time.monotonic()
    with limiter.upload(ROUTINE) as ticket:
        for _ in range(11):
            assert ticket.acquire(MIB)
    elapsed = time.monotonic() - began
    # 11 chunks: the 11th is granted 10 MiB / 20 MiB/s = 0.5 s after the first.
    assert 0.45 <= elapsed < 1.5


def test_the_engine_holds_a_ticket_of_its_class_while_it_uploads(tmp_path: Path) -> None:
    from hermit_node.engine.checkpoint import CheckpointEngine

    limiter = UploadLimiter(0)
    engine = CheckpointEngine(Mock(), Mock(), tmp_path, limiter=limiter)
    for urgent, klass in ((True, URGENT), (False, ROUTINE)):
        with engine._bandwidth(urgent, ("ns", "sb")) as pace:
            assert limiter.active(klass) == 1 and pace is not None
            assert pace(MIB, None, None)
        assert limiter.active(klass) == 0
    with CheckpointEngine(Mock(), Mock(), tmp_path)._bandwidth(True, ("ns", "sb")) as pace:
        assert pace is None  # no limiter (the CLI): chunk PUTs never wait
