"""One agent run under one policy: replay the trace, then a notice, then restores.

After the trace: the queued checkpoints finish, then a spot notice arrives and the final
checkpoint is taken with ``stop=True`` (frozen until durable, as on a notice); it is
restored on the second node and checked, first fully (every page in before the tree
runs), then again lazily (the tree runs while CRIU's lazy-pages daemon copies its memory
in; checked once every page is in). Then the checkpoint that a crash at the chosen
turn would have left (the newest durable one at the end of that turn's model wait) is
restored and checked against what the sandbox held at the end of the turn it covers.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from bench.turnbench import sandbox
from bench.turnbench.contenders import NAMESPACE, Policy, Taken, make_policy
from bench.turnbench.sandbox import Box
from bench.turnbench.trace import Trace
from hermit_common.pin import Pin
from hermit_common.store import CheckpointStore
from hermit_node.engine.checkpoint import CheckpointEngine, CheckpointResult, NoProgress
from hermit_node.engine.inspector import Decision
from hermit_node.engine.lazypages import Filled
from hermit_node.engine.restore import LAZY_FILL_TIMEOUT_SECONDS, RestoreEngine, RestoreTarget
from hermit_node.host.criu import Criu
from hermit_testbed.cni import CniNetwork
from hermit_testbed.scenario import Node


@dataclass
class Env:
    """What every run shares: CRIU, the store, the two nodes, the network."""

    criu: Criu
    store: CheckpointStore
    naive_store: CheckpointStore
    nodes: tuple[Node, Node]
    network: CniNetwork
    interval: float


@dataclass
class Check:
    """A restore and what held after it."""

    checkpoint: str
    covered_turn: int
    mid_turn: bool = False
    lazy: bool = False  # restored lazily (restore_ms: to running; all_pages_ms: every page in)
    restore_ms: int | None = None  # restore -> running (full: every page is in by then)
    all_pages_ms: int | None = None  # restore -> every page in (None: not all came in)
    phases: str = ""  # where restore -> running went (download, apply, CRIU)
    ok: bool = False
    fingerprint: str = ""  # of the restored files
    details: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    contender: str
    mem_mb: int
    turns: int
    wall_s: float = 0.0  # the agent's run: first command to the end of the last wait
    command_s: float = 0.0  # of which its commands
    taken: list[Taken] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    notice: CheckpointResult | None = None
    notice_ms: int = 0  # notice -> durable
    notice_restore: Check | None = None
    lazy_restore: Check | None = None  # the notice checkpoint again, restored lazily
    crash_turn: int = -1
    crash: Check | None = None
    prints: list[str] = field(default_factory=list)  # files at the end of each turn


def replay(policy: Policy, trace: Trace, crash_turn: int,
           prints: list[str]) -> tuple[float, float, Taken | None]:
    """Run the trace; (wall s, command s, the checkpoint a crash after ``crash_turn``
    would restore). ``prints`` gets the sandbox's fingerprint at the end of each turn."""
    began, commands, crash_pick = time.monotonic(), 0.0, None
    for i, turn in enumerate(trace.turns):
        started = time.monotonic()
        policy.progress.running = True
        for command in turn.run:
            sandbox.run_command(policy.box, command)
        policy.progress.ended, policy.progress.running = i, False
        ended = time.monotonic()
        commands += ended - started
        policy.turn_ended()
        prints.append(sandbox.fingerprint(policy.box))
        time.sleep(max(0.0, ended + turn.wait_s - time.monotonic()))
        if i == crash_turn:
            crash_pick = policy.latest_durable(time.monotonic())
    return time.monotonic() - began, commands, crash_pick


def _check(env: Env, policy: Policy, name: str, turn: int, mid_turn: bool,
           prints: list[str], trace: Trace, mem_mb: int, *, lazy: bool = False) -> Check:
    """Restore ``name`` on the second node (``lazy``: with lazy restore, checked once every
    page is in); the holder's memory, the server (when the trace had started it by then)
    and the files (unless taken mid-turn) must hold."""
    check = Check(name, turn, mid_turn, lazy=lazy)
    box = sandbox.start_box(env.nodes[1], env.network, mem_mb, restore=True)
    try:
        _restore(env, policy, name, box, check)
        if not check.details:
            _verify(box, check, turn, mid_turn, prints, trace)
    except Exception as exc:  # a failed restore is a failed recovery, shown as such
        check.details.append(f"restore failed: {exc}")
    finally:
        sandbox.destroy_box(box, env.network)
    check.ok = not check.details
    return check


def _restore(env: Env, policy: Policy, name: str, box: Box, check: Check) -> None:
    """Restores into ``box``; fills ``check``'s times. A lazy restore returns once every
    page is in (or the fill failed, then named in ``check.details``)."""
    engine = RestoreEngine(env.criu, env.store, env.nodes[1].work_dir, lazy=check.lazy)
    if check.lazy and not engine.lazy:
        check.details.append("this node cannot restore lazily (criu check --feature "
                             "uffd-noncoop fails)")
        return
    filled: list[Filled] = []
    ended = threading.Event()

    def on_filled(f: Filled) -> None:
        filled.append(f)
        ended.set()

    began = time.monotonic()
    result = engine.restore(
        RestoreTarget(pin=Pin(NAMESPACE, policy.box_name, name, uid=policy.uid),
                      init_pid=box.container.init_pid,
                      image_digest=env.nodes[1].image_digest()),
        on_filled=on_filled)
    check.restore_ms = result.total_ms
    check.phases = (f"download {result.download_ms} ms, apply {result.apply_ms} ms, "
                    f"criu {result.restore_ms} ms")
    if not result.lazy:
        check.all_pages_ms = result.total_ms
        return
    if not ended.wait(LAZY_FILL_TIMEOUT_SECONDS + 60):
        check.details.append("the lazy-pages daemon never ended")
        return
    if filled[0].ok:
        check.all_pages_ms = int((filled[0].ended_at - began) * 1000)
    else:
        check.details.append(f"lazy fill failed: {filled[0].message}")


def _verify(box: Box, check: Check, turn: int, mid_turn: bool, prints: list[str],
            trace: Trace) -> None:
    if not sandbox.holder_intact(box):
        check.details.append("holder memory not intact")
    check.fingerprint = sandbox.fingerprint(box)
    if turn >= 0 and not mid_turn and check.fingerprint != prints[turn]:
        check.details.append(f"files differ from the end of turn {turn}")
    if any(t.kind == "server" for t in trace.turns[:turn + 1]):
        page = sandbox.server_page(box)
        if not sandbox.server_answers(box, page):
            check.details.append("background server not answering")


class _Durable(NoProgress):
    """Appends when the checkpoint is durable (``time.monotonic()``) to ``at``."""

    def __init__(self, at: list[float]) -> None:
        self._at = at

    def durable(self, result: CheckpointResult) -> None:
        self._at.append(time.monotonic())


def _notice(env: Env, policy: Policy, out: Outcome) -> None:
    """The final checkpoint on a notice: frozen until durable, then the sandbox ends."""
    durable: list[float] = []
    began = time.monotonic()
    out.notice = policy.engine.checkpoint(
        policy.target("notice"), stop=True, store=policy.store,
        progress=_Durable(durable))
    out.notice_ms = int(((durable[0] if durable else time.monotonic()) - began) * 1000)


def run_contender(env: Env, contender: str, mem_mb: int, trace: Trace,
                  crash_turn: int) -> Outcome:
    out = Outcome(contender, mem_mb, len(trace.turns), crash_turn=crash_turn)
    node = env.nodes[0]
    box = sandbox.start_box(node, env.network, mem_mb)
    engine = CheckpointEngine(env.criu, env.store, node.work_dir)
    policy = make_policy(contender, box, engine, str(uuid.uuid4()), env.naive_store,
                         env.interval)
    prints = out.prints
    policy.start()
    try:
        out.wall_s, out.command_s, pick = replay(policy, trace, crash_turn, prints)
        policy.drain()
        out.taken, out.decisions = list(policy.taken), list(policy.decisions)
        _notice(env, policy, out)
    finally:
        sandbox.destroy_box(box, env.network)
    if contender == "full-dump":
        return out  # its tarballs are not something Hermit restores
    last = len(trace.turns) - 1
    out.notice_restore = _check(env, policy, "notice", last, False, prints, trace, mem_mb)
    out.lazy_restore = _check(env, policy, "notice", last, False, prints, trace, mem_mb,
                              lazy=True)
    if pick is not None:
        out.crash = _check(env, policy, pick.name, pick.turn, pick.mid_turn, prints, trace,
                           mem_mb)
    return out
