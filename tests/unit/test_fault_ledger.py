from tests.faults.ledger import Ledger, Row


def test_the_table_lists_each_scenario_and_totals_lost_and_duplicated() -> None:
    ledger = Ledger()
    ledger.record(Row("node-agent SIGKILL during upload", 3, 3, 0, 0, "ok"))
    ledger.record(Row("MinIO stopped during restore", 1, 1, 0, 1, "", 0, 2))
    lines = ledger.table().splitlines()
    assert lines[0].split()[:2] == ["scenario", "faults"]
    assert "ledger lost ticks" in lines[0] and "ledger dup ticks" in lines[0]
    assert "node-agent SIGKILL during upload" in lines[2]
    assert lines[2].split()[-3:] == ["-", "-", "ok"]  # not judged by the tick ledger
    assert lines[-1].split() == ["TOTAL", "4", "4", "0", "1", "0", "2"]
