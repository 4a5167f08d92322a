"""The fault-injection suite (hack/test faults): the e2e fixtures (tests/e2e/cluster.py,
a plugin of every session, so a run of both tiers shares one release), plus the ledger
whose table is printed at the end of the run and written to
$HERMIT_CACHE/logs/faults-table.txt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.ledger import Ledger, Row

LEDGER = Ledger()


@pytest.fixture(scope="session")
def ledger() -> Ledger:
    return LEDGER


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not LEDGER.rows:
        return
    table = LEDGER.table()
    terminalreporter.section("fault-injection summary")
    terminalreporter.write_line(table)
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache/hermit"))
    out = cache / "logs/faults-table.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table + "\n")
    terminalreporter.write_line(f"(also written to {out})")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    """A scenario that fails before it records its row (a wait timed out) still gets one:
    its sandbox counts as lost, so the table never hides a failure."""
    before = len(LEDGER.rows)
    try:
        return (yield)
    except BaseException as exc:
        if len(LEDGER.rows) == before:
            LEDGER.record(Row(item.name, 1, 1, 1, 0,
                              f"failed before it was judged: {str(exc).splitlines()[0]}"[:200]))
        raise
