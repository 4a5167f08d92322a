"""The fault suite's ledger: one row per scenario, printed as the suite's summary table.
(Not the external tick ledger, tests/support/ledger.py, whose lost and duplicated tick
counts are two of its columns.)

A scenario records its row before it asserts, so a failing scenario still shows what it
measured (a lost or duplicated sandbox is the failure the table exists to show).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    """What one scenario injected and what became of its sandboxes."""

    scenario: str
    faults: int
    sandboxes: int
    lost: int
    duplicated: int
    note: str = ""
    # Tick numbers the external tick ledger found lost / duplicated (None: not judged).
    ledger_lost: int | None = None
    ledger_duplicated: int | None = None


@dataclass
class Ledger:
    rows: list[Row] = field(default_factory=list)

    def record(self, row: Row) -> None:
        self.rows.append(row)

    def table(self) -> str:
        return render(self.rows)


HEADERS = ("scenario", "faults injected", "sandboxes", "lost", "duplicated",
           "ledger lost ticks", "ledger dup ticks", "note")


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def render(rows: list[Row]) -> str:
    """A plain-text table with a totals line; lost and duplicated, and the external tick
    ledger's lost and duplicated ticks, must all total 0."""
    cells = [HEADERS] + [
        (r.scenario, str(r.faults), str(r.sandboxes), str(r.lost), str(r.duplicated),
         _count(r.ledger_lost), _count(r.ledger_duplicated), r.note)
        for r in rows]
    totals = ("TOTAL", str(sum(r.faults for r in rows)), str(sum(r.sandboxes for r in rows)),
              str(sum(r.lost for r in rows)), str(sum(r.duplicated for r in rows)),
              str(sum(r.ledger_lost or 0 for r in rows)),
              str(sum(r.ledger_duplicated or 0 for r in rows)), "")
    cells.append(totals)
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADERS))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:-1]), rule,
                      line(cells[-1])])
