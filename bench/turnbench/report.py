"""The figures of a run, the table, the targets of issue #11 and the chart (pure but the
chart's file)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.turnbench.run import Check, Outcome

MB = 1e6


@dataclass(frozen=True)
class Figures:
    contender: str
    mem_mb: int
    turns: int
    uploaded_mb: float  # every checkpoint of the run, the notice's excluded
    checkpoints: int
    failed: int
    frozen_p50: float | None  # ms, the run's routine checkpoints
    frozen_p99: float | None
    slowdown_pct: float | None  # wall-clock vs off
    notice_ms: int
    notice_mb: float
    restore_ms: int | None  # full restore -> running (= all pages present)
    notice_ok: str  # the notice checkpoint restored (fully and lazily): ok / what broke
    recovered: str  # crash at turn N: restored checkpoint, turns lost, ok / what broke
    restores: int = 0  # Hermit restores checked (the notice's, full and lazy, the crash's)
    restores_ok: int = 0
    lazy_running_ms: int | None = None  # lazy restore of the notice checkpoint -> running
    lazy_all_pages_ms: int | None = None  # ... -> every page in (None: not all came in)


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) by nearest rank; None for no values."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, max(0, math.ceil(q * len(ranked)) - 1))]


def _recovered(o: Outcome) -> str:
    if o.contender == "off":
        return f"crash@{o.crash_turn}: nothing to restore"
    if o.contender == "full-dump":
        return "n/a (not a Hermit restore)"
    if o.crash is None:
        return f"crash@{o.crash_turn}: no durable checkpoint yet"
    c = o.crash
    lost = 0 if c.fingerprint == o.prints[o.crash_turn] else o.crash_turn - c.covered_turn
    verdict = "ok" if c.ok else "; ".join(c.details)
    mid = " (mid-turn: files not compared)" if c.mid_turn else ""
    return f"crash@{o.crash_turn}: {c.checkpoint} (turn {c.covered_turn}{mid}), " \
           f"{lost} turns lost, {verdict}"


def _notice_verdict(o: Outcome) -> str:
    """ok when every restore of the notice checkpoint held, else what broke in which."""
    checks = [(kind, c) for kind, c in (("full", o.notice_restore), ("lazy", o.lazy_restore))
              if c is not None]
    if not checks:
        return "-"
    if all(c.ok for _, c in checks):
        return "ok"
    return "; ".join(f"{kind}: {'ok' if c.ok else '; '.join(c.details)}" for kind, c in checks)


def _ms(check: Check | None, all_pages: bool = False) -> int | None:
    if check is None:
        return None
    return check.all_pages_ms if all_pages else check.restore_ms


def figures(o: Outcome, off: Outcome | None) -> Figures:
    done = [t.result for t in o.taken if t.result is not None]
    frozen = [float(r.frozen_ms) for r in done]
    checks = [c for c in (o.notice_restore, o.lazy_restore, o.crash) if c is not None]
    slowdown = (100.0 * (o.wall_s - off.wall_s) / off.wall_s) if off and off.wall_s else None
    return Figures(
        contender=o.contender, mem_mb=o.mem_mb, turns=o.turns,
        uploaded_mb=sum(r.uploaded_bytes for r in done) / MB, checkpoints=len(done),
        failed=len(o.taken) - len(done), frozen_p50=percentile(frozen, 0.5),
        frozen_p99=percentile(frozen, 0.99), slowdown_pct=slowdown, notice_ms=o.notice_ms,
        notice_mb=(o.notice.uploaded_bytes / MB) if o.notice else 0.0,
        restore_ms=_ms(o.notice_restore), recovered=_recovered(o),
        notice_ok=_notice_verdict(o), restores=len(checks),
        restores_ok=sum(1 for c in checks if c.ok), lazy_running_ms=_ms(o.lazy_restore),
        lazy_all_pages_ms=_ms(o.lazy_restore, all_pages=True))


def _num(value: float | None, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


HEADER = ("contender", "MiB", "turns", "uploaded MB", "ckpts/turns", "frozen p50/p99 ms",
          "slowdown", "notice->durable ms (MB)", "restore->running ms (eager = all pages)",
          "lazy: running ms / all pages ms", "notice restore", "crash recovery")


def table(rows: list[Figures]) -> str:
    """A Markdown table, one row per contender and size."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for f in rows:
        failed = f" ({f.failed} failed)" if f.failed else ""
        cells = (f.contender, str(f.mem_mb), str(f.turns), f"{f.uploaded_mb:.1f}",
                 f"{f.checkpoints}/{f.turns}{failed}",
                 f"{_num(f.frozen_p50)}/{_num(f.frozen_p99)}",
                 "-" if f.slowdown_pct is None else f"{f.slowdown_pct:+.1f}%",
                 f"{f.notice_ms} ({f.notice_mb:.1f})", _num(f.restore_ms),
                 f"{_num(f.lazy_running_ms)} / {_num(f.lazy_all_pages_ms)}"
                 if f.lazy_running_ms is not None or f.lazy_all_pages_ms is not None else "-",
                 f.notice_ok, f.recovered)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _row(rows: list[Figures], contender: str, mem_mb: int) -> Figures | None:
    return next((f for f in rows if f.contender == contender and f.mem_mb == mem_mb), None)


def _met(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "NOT met")


def _bytes_target(rows: list[Figures], mem: int) -> tuple[str, str, bool | None]:
    naive, turn = _row(rows, "full-dump", mem), _row(rows, "turn-aware", mem)
    if naive is None or turn is None or not naive.uploaded_mb:
        return (f"bytes uploaded, turn-aware vs full dump per turn ({mem} MiB)", "-", None)
    cut = 100.0 * (1 - turn.uploaded_mb / naive.uploaded_mb)
    return (f"bytes uploaded, turn-aware vs full dump per turn ({mem} MiB): >= 90% less",
            f"{cut:.1f}% less ({turn.uploaded_mb:.1f} vs {naive.uploaded_mb:.1f} MB)",
            cut >= 90.0)


def _slowdown_target(rows: list[Figures], mem: int) -> tuple[str, str, bool | None]:
    turn = _row(rows, "turn-aware", mem)
    value = turn.slowdown_pct if turn else None
    return (f"slowdown vs off, turn-aware ({mem} MiB): <= 2%",
            "-" if value is None else f"{value:+.1f}%", None if value is None else value <= 2.0)


def _ms_target(label: str, f: Figures | None, value: float | None,
               limit: float) -> tuple[str, str, bool | None]:
    if f is None or value is None:
        return (label, "-", None)
    return (label, f"{value:.0f} ms", value <= limit)


def targets(rows: list[Figures], big: int, small: int) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for each target of issue #11."""
    off, turn = _row(rows, "off", big), _row(rows, "turn-aware", big)
    small_turn = _row(rows, "turn-aware", small)
    restores, ok = sum(f.restores for f in rows), sum(f.restores_ok for f in rows)
    sizes = sorted({small, big})
    out = [_bytes_target(rows, m) for m in sizes]
    out += [_slowdown_target(rows, m) for m in sizes]
    out += [
        _ms_target(f"notice->durable {big} MiB, no earlier checkpoint (off): <= 3000 ms", off,
                   off.notice_ms if off else None, 3000),
        _ms_target(f"notice->durable {big} MiB, recent checkpoint (turn-aware): <= 1000 ms",
                   turn, turn.notice_ms if turn else None, 1000),
        _ms_target(f"restore->running {big} MiB, lazy (turn-aware): <= 1000 ms", turn,
                   turn.lazy_running_ms if turn else None, 1000),
        _ms_target(f"restore->running {big} MiB, all pages present (turn-aware, full "
                   "restore): <= 3000 ms", turn, turn.restore_ms if turn else None, 3000),
        _ms_target(f"frozen p50, turn-aware {small} MiB (<= 64 MiB changed): <= 100 ms",
                   small_turn, small_turn.frozen_p50 if small_turn else None, 100),
        ("recovery correct (the notice, full and lazy restore; a crash at a random turn): "
         "100%",
         f"{ok}/{restores} restores", ok == restores if restores else None),
    ]
    return out


def targets_text(items: list[tuple[str, str, bool | None]]) -> str:
    width = max(len(label) for label, _, _ in items)
    return "\n".join(f"{label:<{width}}  {value:<28} {_met(ok)}" for label, value, ok in items)


def chart(rows: list[Figures], path: Path, title: str) -> Path:
    """The table's figures as bar charts, one panel per figure, one bar per contender."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, Callable[[Figures], float], bool]] = [
              ("uploaded MB (log)", lambda f: f.uploaded_mb, True),
              ("checkpoints per turn", lambda f: f.checkpoints / f.turns, False),
              ("frozen p50 ms", lambda f: f.frozen_p50 or 0.0, False),
              ("frozen p99 ms", lambda f: f.frozen_p99 or 0.0, False),
              ("slowdown vs off %", lambda f: f.slowdown_pct or 0.0, False),
              ("notice->durable ms", lambda f: float(f.notice_ms), False),
              ("full restore->running (= all pages) ms",
               lambda f: float(f.restore_ms or 0), False),
              ("lazy restore->running ms", lambda f: float(f.lazy_running_ms or 0), False),
              ("lazy restore->all pages present ms",
               lambda f: float(f.lazy_all_pages_ms or 0), False)]
    fig, axes = plt.subplots(3, 3, figsize=(16, 12))
    sizes = sorted({f.mem_mb for f in rows})
    contenders = list(dict.fromkeys(f.contender for f in rows))
    for ax, (label, value, log) in zip(axes.flat, panels, strict=True):
        _panel(ax, rows, sizes, contenders, label, value, log)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _panel(ax: Any, rows: list[Figures], sizes: list[int], contenders: list[str],
           label: str, value: Callable[[Figures], float], log: bool) -> None:
    width = 0.8 / max(1, len(contenders))
    for i, name in enumerate(contenders):
        xs, ys = [], []
        for j, size in enumerate(sizes):
            f = _row(rows, name, size)
            if f is not None:
                xs.append(j + i * width)
                ys.append(value(f))
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))])
    ax.set_xticklabels([f"{s} MiB" for s in sizes])
    ax.set_title(label)
    if log:
        ax.set_yscale("log")
    if label.startswith("uploaded"):
        ax.legend(fontsize=8)
