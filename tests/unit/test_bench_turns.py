"""The turn benchmark's pure parts: traces, percentiles, the table and the targets."""

from __future__ import annotations

import pytest

from bench.turnbench import report, trace
from bench.turnbench.run import Check, Outcome


def test_shipped_trace_mixes_every_kind_with_model_waits() -> None:
    mixed = trace.load("mixed")
    assert {"read", "edit", "install", "server", "build"} <= set(mixed.kinds())
    assert all(2 <= t.wait_s <= 10 for t in mixed.turns)
    # the 1 GiB case replays the first six turns: they still hold every kind
    assert {"read", "edit", "install", "server", "build"} <= set(mixed.kinds()[:6])


@pytest.mark.parametrize("data", [{}, {"turns": []}, {"turns": [{"run": "ls", "wait_s": 1}]},
                                  {"turns": [{"run": ["ls"], "wait_s": -1}]}])
def test_parse_refuses_malformed_traces(data: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        trace.parse(data)


def test_shortened_keeps_first_turns_and_scales_waits() -> None:
    t = trace.parse({"turns": [{"run": ["a"], "wait_s": 4}, {"run": ["b"], "wait_s": 8}]})
    short = trace.shortened(t, 1, 0.25)
    assert [(x.run, x.wait_s) for x in short.turns] == [(("a",), 1.0)]
    assert len(trace.shortened(t, None).turns) == 2


def test_percentile_nearest_rank() -> None:
    assert report.percentile([], 0.5) is None
    assert report.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert report.percentile([float(i) for i in range(1, 101)], 0.99) == 99.0


def _fig(contender: str, mem: int, uploaded: float, slowdown: float | None,
         **kw: object) -> report.Figures:
    base: dict[str, object] = dict(
        contender=contender, mem_mb=mem, turns=6, uploaded_mb=uploaded, checkpoints=3,
        failed=0, frozen_p50=80.0, frozen_p99=120.0, slowdown_pct=slowdown, notice_ms=900,
        notice_mb=0.1, restore_ms=2500, notice_ok="ok", recovered="crash@2: ok",
        restores=2, restores_ok=2)
    base.update(kw)
    return report.Figures(**base)  # type: ignore[arg-type]


def test_targets_met_and_not_met() -> None:
    rows = [_fig("full-dump", 64, 100.0, 10.0, restores=0, restores_ok=0),
            _fig("turn-aware", 64, 5.0, 1.0),
            _fig("off", 64, 0.0, 0.0, notice_ms=4000, restores=1, restores_ok=0)]
    got = {label.split(":")[0]: (value, ok) for label, value, ok in
           report.targets(rows, 64, 64)}
    assert got["bytes uploaded, turn-aware vs full dump per turn (64 MiB)"] == (
        "95.0% less (5.0 vs 100.0 MB)", True)
    assert got["slowdown vs off, turn-aware (64 MiB)"][1] is True
    assert got["notice->durable 64 MiB, no earlier checkpoint (off)"][1] is False
    assert got["notice->durable 64 MiB, recent checkpoint (turn-aware)"][1] is True
    assert got["restore->running 64 MiB, lazy (turn-aware)"] == ("-", None)
    assert got["restore->running 64 MiB, all pages present (turn-aware, full restore)"] == (
        "2500 ms", True)
    assert got["recovery correct (the notice, full and lazy restore; a crash at a random "
               "turn)"] == ("2/3 restores", False)
    assert "| turn-aware | 64 | 6 | 5.0 | 3/6 | 80/120 | +1.0% |" in report.table(rows)


def _lazy_targets(rows: list[report.Figures]) -> tuple[str, bool | None]:
    (hit,) = [(value, ok) for label, value, ok in report.targets(rows, 1024, 64)
              if label.startswith("restore->running 1024 MiB, lazy")]
    return hit


def test_lazy_restore_target_is_measured_on_turn_aware_at_the_big_size() -> None:
    small = _fig("turn-aware", 64, 5.0, 1.0, lazy_running_ms=5000)
    assert _lazy_targets([small, _fig("turn-aware", 1024, 5.0, 1.0, lazy_running_ms=800,
                                      lazy_all_pages_ms=2900)]) == ("800 ms", True)
    assert _lazy_targets([small, _fig("turn-aware", 1024, 5.0, 1.0,
                                      lazy_running_ms=1200)]) == ("1200 ms", False)
    assert _lazy_targets([small, _fig("off", 1024, 0.0, 0.0, lazy_running_ms=10)]) == (
        "-", None)


def _outcome(full: Check | None, lazy: Check | None, crash: Check | None) -> Outcome:
    return Outcome("turn-aware", 1024, 2, crash_turn=1, notice_restore=full,
                   lazy_restore=lazy, crash=crash, prints=["a", "b"])


def test_figures_take_full_and_lazy_restore_times_and_count_both_restores() -> None:
    full = Check("notice", 1, restore_ms=2400, all_pages_ms=2400, ok=True)
    lazy = Check("notice", 1, lazy=True, restore_ms=700, all_pages_ms=2600, ok=True)
    crash = Check("c1-turn", 0, restore_ms=2000, ok=True, fingerprint="a")
    f = report.figures(_outcome(full, lazy, crash), None)
    assert (f.restore_ms, f.lazy_running_ms, f.lazy_all_pages_ms) == (2400, 700, 2600)
    assert (f.notice_ok, f.restores, f.restores_ok) == ("ok", 3, 3)
    row = report.table([f]).splitlines()[-1]
    assert "| 2400 | 700 / 2600 | ok |" in row
    assert "restore->running ms (eager = all pages) | lazy: running ms / all pages ms" in \
        report.table([f])


def test_a_failed_lazy_fill_is_named_and_has_no_all_pages_time() -> None:
    full = Check("notice", 1, restore_ms=2400, all_pages_ms=2400, ok=True)
    lazy = Check("notice", 1, lazy=True, restore_ms=700,
                 details=["lazy fill failed: criu lazy-pages failed: exit code 1"])
    f = report.figures(_outcome(full, lazy, None), None)
    assert f.notice_ok == "full: ok; lazy: lazy fill failed: criu lazy-pages failed: exit code 1"
    assert (f.lazy_running_ms, f.lazy_all_pages_ms, f.restores, f.restores_ok) == (
        700, None, 2, 1)
    assert "| 2400 | 700 / - |" in report.table([f])
    assert "| - | - |" in report.table([report.figures(_outcome(None, None, None), None)])
