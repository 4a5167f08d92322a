"""The counters a turn checkpoint's baseline keeps, on real processes in a real frozen
cgroup (``inspector.thaw_only``, ``inspector.settled``; docs/turns.md, "How the
baseline's counters are read").

A thaw alone moves a process's counters only as ``thaw_only`` allows, so an idle tree
frozen and thawed by a checkpoint is ``skip`` at its next turn. A process that runs after
the dump, and not after the (late) read that follows the thaw, still makes its next turn
``full``: before the counters were read at the dump, that turn was decided on files only,
and its checkpoint would have restored older memory beside newer files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermit_node.engine import inspector, snapshot
from hermit_node.engine.inspector import Snapshot
from hermit_node.host import freezer
from tests.support.cgroups import VERSIONS, scratch_cgroup
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

# An agent waiting for its model: threads asleep in several kinds of wait, main in a read.
IDLE = """
import os, select, sys, threading, time
lock = threading.Lock(); lock.acquire()
r, w = os.pipe()
for wait in (lock.acquire, lambda: os.read(r, 1), lambda: select.select([r], [], [], 1e5),
             lambda: time.sleep(1e5)):
    threading.Thread(target=wait, daemon=True).start()
sys.stdin.read()
"""
# A workload that writes 16 MiB of its memory every 50 ms.
TICKER = """
import time
memory = bytearray(16 << 20)
while True:
    for i in range(0, len(memory), 4096):
        memory[i] = (memory[i] + 1) % 256
    time.sleep(0.05)
"""
CYCLES = 5  # freeze-and-thaw cycles per idle tree: each must leave it skip


@pytest.fixture(params=VERSIONS)
def cgroup(request: pytest.FixtureRequest) -> Iterator[Path]:
    with scratch_cgroup(request.param) as path:
        yield path


def _start(cgroup: Path, program: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE,
                            preexec_fn=lambda: (Path(cgroup) / "cgroup.procs").write_text(
                                str(os.getpid())))
    return proc


def _read(pid: int) -> Snapshot:
    proc = snapshot.process(pid, Path("/proc"), exempt=False)
    assert proc is not None, f"process {pid} ended"
    return Snapshot(files={}, processes={pid: proc}, sockets=frozenset())


def _still(pid: int, seconds: float = 0.3) -> Snapshot:
    """The process once its counters held still for ``seconds``."""
    last = [_read(pid)]

    def held() -> Snapshot | None:
        time.sleep(seconds)
        now = _read(pid)
        same = now.processes == last[0].processes
        last[0] = now
        return now if same else None

    return wait_until(f"process {pid}'s counters to hold still", 20, held, 0)


def _checkpoint_cycle(cgroup: Path, pid: int) -> Snapshot:
    """Freeze, read the counters as a checkpoint's job reads them at the dump (once no
    thread is on its way off the CPU, ``snapshot.frozen``), thaw."""
    freezer.freeze(cgroup)
    try:
        return snapshot.frozen(lambda: _read(pid))
    finally:
        freezer.thaw(cgroup)


def test_a_thaw_alone_leaves_an_idle_tree_skip(cgroup: Path) -> None:
    proc = _start(cgroup, IDLE)
    try:
        turn_end = _still(proc.pid)
        threads = turn_end.processes[proc.pid].activity[2]
        assert threads == 5, turn_end
        decisions = []
        for _ in range(CYCLES):
            dumped = _checkpoint_cycle(cgroup, proc.pid)
            thawed = _still(proc.pid)  # as snapshot.after_thaw reads it
            assert inspector.thaw_only(dumped.processes[proc.pid], thawed.processes[proc.pid]), (
                dumped, thawed)
            base = inspector.settled(turn_end, dumped, thawed)
            decisions.append(inspector.decide(base, _still(proc.pid)).decision)
            turn_end = thawed
        assert decisions == ["skip"] * CYCLES
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_ran_after_the_dump_makes_the_next_turn_full_however_late_the_read(
        cgroup: Path) -> None:
    proc = _start(cgroup, TICKER)
    try:
        turn_end = _read(proc.pid)
        dumped = _checkpoint_cycle(cgroup, proc.pid)
        time.sleep(0.5)  # the read after the thaw is late: the workload ticked ~10 times
        os.kill(proc.pid, signal.SIGSTOP)  # and then not again before the next turn
        wait_until("the workload stopped", 10,
                   lambda: Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] == "T",
                   0.01)
        late = _read(proc.pid)
        next_turn = _read(proc.pid)
        assert late.processes == next_turn.processes
        assert not inspector.thaw_only(dumped.processes[proc.pid], late.processes[proc.pid])
        decision = inspector.decide(inspector.settled(turn_end, dumped, late), next_turn)
        assert decision.decision == "full", decision
        assert f"processes ran: pids {proc.pid}" in decision.reasons, decision
        # What the baseline said before the counters were read at the dump:
        blind = inspector.decide(inspector.settled(turn_end, late, late), next_turn)
        assert blind.decision == "skip", blind
    finally:
        proc.kill()
        proc.wait()
