"""The attack suite's table: each attack test records what it tried and what happened.

Attack tests live in the tier that can perform them for real (integration for a race
against the capture code on real containers, e2e for the cluster's admission and the
turn endpoint) and carry ``@pytest.mark.attack``; ``hack/test attacks`` runs exactly them
on the local cluster, and the e2e tier (CI) runs them with everything else. Each test asks
for the ``attack`` fixture and records one row per attack; at the end of the run the
table is printed and written to $HERMIT_CACHE/logs/attacks-table.md (docs/security.md
carries the latest one). A test that fails after or before recording shows as FAILED, so
the table never reports a refusal the test did not see.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REFUSED = "refused"      # the request or input was turned away before it had any effect
CONTAINED = "contained"  # it ran, and reached nothing beyond what the sandbox already had
OUTCOMES = (REFUSED, CONTAINED)


@dataclass
class AttackRow:
    attack: str
    tried: str
    outcome: str
    evidence: str
    test: str
    failed: bool = False


@dataclass
class AttackTable:
    rows: list[AttackRow] = field(default_factory=list)

    def record(self, row: AttackRow) -> None:
        if row.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, not {row.outcome!r}")
        self.rows.append(row)

    def mark_failed(self, test: str, why: str) -> None:
        mine = [row for row in self.rows if row.test == test]
        for row in mine:
            row.failed = True
        if not mine:
            self.rows.append(AttackRow(test.rsplit("::", 1)[-1], "(failed before it recorded)",
                                       "FAILED", why, test, failed=True))

    def markdown(self) -> str:
        lines = ["| attack | what it tried | outcome | evidence | test |",
                 "|---|---|---|---|---|"]
        for row in self.rows:
            outcome = "FAILED" if row.failed else row.outcome
            test = row.test.split("::")[0] + "::" + row.test.rsplit("::", 1)[-1]
            lines.append(f"| {_cell(row.attack)} | {_cell(row.tried)} | {outcome} | "
                         f"{_cell(row.evidence)} | `{test}` |")
        refused = sum(1 for r in self.rows if not r.failed and r.outcome == REFUSED)
        contained = sum(1 for r in self.rows if not r.failed and r.outcome == CONTAINED)
        failed = sum(1 for r in self.rows if r.failed)
        lines.append("")
        lines.append(f"{len(self.rows)} attacks: {refused} refused, {contained} contained, "
                     f"{failed} failed")
        return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


TABLE = AttackTable()


class Attack:
    """What one attack test hands the table (one row per ``record``)."""

    def __init__(self, table: AttackTable, test: str) -> None:
        self._table = table
        self._test = test

    def record(self, attack: str, *, tried: str, outcome: str, evidence: str) -> None:
        self._table.record(AttackRow(attack, tried, outcome, evidence, self._test))


@pytest.fixture
def attack(request: pytest.FixtureRequest) -> Iterator[Attack]:
    yield Attack(TABLE, request.node.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    if item.get_closest_marker("attack") is not None and report.failed:
        first = str(call.excinfo.value).splitlines()[0] if call.excinfo else "failed"
        TABLE.mark_failed(item.nodeid, first[:200])
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TABLE.rows:
        return
    table = TABLE.markdown()
    terminalreporter.section("attack suite")
    terminalreporter.write_line(table)
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
    out = cache / "logs/attacks-table.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    terminalreporter.write_line(f"(also written to {out})")
