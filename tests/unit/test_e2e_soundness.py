"""The e2e helpers' judgement of the workload after a move (tests/e2e/sandboxes.py
assert_sound): which log lines are failures, and how long a restored copy must run
before every self-check of the workload has had its chance."""

from __future__ import annotations

import re
from pathlib import Path

from tests.e2e import sandboxes as sb


def test_only_the_workloads_own_failure_lines_count() -> None:
    log = "\n".join([
        "tick 41",
        "hermit-stateful: ok counter=50 threads=49 seq=50 db=50 gen=1",
        "hermit-stateful: restore detected (gen=2) at counter 61",
        "hermit-stateful: invariant seq broken: the child echoed 7 after 5 (a gap)",
        "hermit-stateful: memory corrupted at word 12 (tick 62)",
        "hermit-stateful: background child 9 is gone (tick 63)",
    ])
    assert sb.workload_failures(log) == log.splitlines()[3:]
    assert sb.workload_failures("tick 1\ntick 2\n") == []


def test_a_restored_copy_runs_past_its_stall_window_and_a_whole_memory_pass() -> None:
    stall_ticks = sb.STALL_MS // sb.TICK_MS + sb.STALL_TICKS
    assert sb.ticks_to_be_sound(0) > stall_ticks
    # 1 GiB verified 64 MiB per tick: 16 ticks more than an empty block
    assert sb.ticks_to_be_sound(1024) - sb.ticks_to_be_sound(0) == 1024 // sb.VERIFY_MB
    assert sb.ticks_to_be_sound(sb.WORKLOAD_MEM_MB) > stall_ticks
    # a workload that verifies 2 MiB per tick needs a tick per 2 MiB for its pass
    assert sb.ticks_to_be_sound(192, 2) - sb.ticks_to_be_sound(0, 2) == 96


def test_the_windows_are_the_workloads_own_defaults() -> None:
    source = (Path(__file__).resolve().parents[1] / "workloads/stateful.c").read_text()
    assert re.search(rf"#define STALL_TICKS {sb.STALL_TICKS}\b", source)
    assert re.search(rf'env_long\("HERMIT_STALL_MS", {sb.STALL_MS},', source)
    assert re.search(rf'env_long\("HERMIT_WORKLOAD_VERIFY_MB", {sb.VERIFY_MB},', source)
