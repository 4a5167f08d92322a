"""The fork fan-out benchmark's pure parts (bench/fanout_figures.py): the restore-message
parsed as the node-agent writes it, the chunk cache's share per node and the targets."""

from __future__ import annotations

from bench.fanout_figures import Restore, cache_by_node, parse_restore_message, spread, targets
from hermit_node.control import planner
from hermit_node.engine.restore import RestoreResult


def _result(chunks: int, cached: int) -> RestoreResult:
    return RestoreResult(download_ms=900, apply_ms=10, restore_ms=300, total_ms=1234,
                         restored_pid=7, downloaded_bytes=256 * 2**20,
                         chunks_fetched=chunks, chunks_cached=cached)


def test_parses_the_message_the_node_agent_writes() -> None:
    message = planner.restored_message("fanout-source", _result(64, 48))
    r = parse_restore_message(message)
    assert r == Restore("fanout-source", 1234, 256 * 2**20, 64, 48)
    assert r.from_store == 16
    assert r.store_bytes == 64 * 2**20


def test_other_messages_have_no_figures() -> None:
    assert parse_restore_message(None) is None
    assert parse_restore_message("") is None
    assert parse_restore_message("S3 timed out") is None
    assert parse_restore_message(
        "restored from Checkpoint x (the node-agent restarted after CRIU restored the tree; "
        "adopted)") is None
    assert parse_restore_message(planner.restored_message("c", _result(0, 0))) == Restore(
        "c", 1234, 256 * 2**20, 0, 0)
    assert Restore("c", 1, 100, 0, 0).store_bytes == 0


def test_cache_by_node_orders_restores_and_counts_those_that_fetched_nothing() -> None:
    full, half, none = Restore("c", 1, 64, 64, 0), Restore("c", 1, 64, 64, 32), \
        Restore("c", 1, 64, 64, 64)
    lines = cache_by_node([("spot-2", 3.0, none), ("spot-1", 2.0, half),
                           ("spot-1", 1.0, full), ("spot-1", 3.0, none),
                           ("spot-1", 4.0, None)])
    assert len(lines) == 2
    assert lines[0].startswith("spot-1: 4 restores, chunks from S3 96 ")
    assert "from the cache 96 (50 %)" in lines[0]
    assert "in finishing order: 64 32 0 ?" in lines[0]
    assert "fetched nothing from S3: 1/4 (restores #3)" in lines[0]
    assert lines[0].endswith("; 1 without figures")
    assert lines[1].startswith("spot-2: 1 restores, chunks from S3 0 ")
    assert "fetched nothing from S3: 1/1 (restores #1)" in lines[1]


def test_spread() -> None:
    assert spread([3.0, None, 1.0, 2.0], 4) == "p50 2.0 s, max 3.0 s (3/4)"
    assert spread([None], 2) == "none (0/2)"


def test_targets_are_figures_met_or_missed() -> None:
    met = targets(2, [10.0, 29.9], [1.0, 4.9], running_within=30, tick_within=5)
    assert met[0].startswith("MET: all 2 forks running within 30 s") and "2/2 did" in met[0]
    assert met[1].startswith("MET: each fork's first tick within 5 s") and "4.9 s" in met[1]
    late = targets(3, [10.0, 31.0, None], [1.0, 6.0, None], running_within=30,
                   tick_within=5)
    assert late[0].startswith("MISSED") and "1/3 did; slowest 31.0 s" in late[0]
    assert late[1].startswith("MISSED") and "1/3 did; slowest 6.0 s" in late[1]
    none = targets(1, [None], [None], running_within=30, tick_within=5)
    assert none[0].startswith("MISSED") and "slowest - s" in none[0]
