"""Per turn: skip, files-only or full, from what the OS shows changed (pure).

A ``Snapshot`` is what ``snapshot.take`` read of one sandbox container at one moment:
the writable layer and the workspace (per path: size, mtimes, mode, inode, owner), the
processes of the container's cgroup (identity, memory counters, CPU time, context
switches), its listening sockets, and what could not be read. ``decide`` compares the
snapshot taken when the sandbox's last turn checkpoint was made with one taken now.

The rules are conservative: anything that is not known to be unchanged is a change.

- no earlier snapshot, or anything unreadable in either: ``full``;
- a process started or ended (pid, start time, executable, command line), a listening
  socket opened or closed, or any process's memory counters, CPU time or context
  switches moved (it ran, so its memory may differ): ``full``;
- otherwise a file of the writable layer or the workspace was added, removed or
  changed: ``files-only``;
- otherwise ``skip``.

Without soft-dirty page tracking (docs/architecture.md) the kernel cannot say whether a
process wrote to memory; a process that did not run at all did not. Hermit's own init
(``hermit-init``, the container's PID 1 and the root a restore adopted) wakes once a
second to reap children and changes nothing a restore needs: its CPU time and context
switches are ignored (``Proc.exempt``), its memory counters are not.
"""

from __future__ import annotations

import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from hermit_common import protocol

REASONS_SHOWN: Final = 3  # paths or pids named per reason; the rest are counted


@dataclass(frozen=True)
class FileSig:
    """What a file's change shows in ``lstat``: any write moves mtime or ctime."""

    kind_mode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    uid: int
    gid: int


@dataclass(frozen=True)
class Proc:
    """One process of the container."""

    pid: int
    start_ticks: int  # /proc/<pid>/stat starttime: with the pid, who it is
    exe: str
    cmdline: tuple[str, ...]
    memory: tuple[int, ...]  # VmSize, VmRSS, RssAnon, RssFile, RssShmem, VmData, VmSwap (kB)
    # utime, stime, threads, voluntary and nonvoluntary context switches (of all threads)
    activity: tuple[int, ...]
    exempt: bool = False  # Hermit's init: its activity is ignored

    @property
    def identity(self) -> tuple[int, int, str, tuple[str, ...]]:
        return (self.pid, self.start_ticks, self.exe, self.cmdline)


@dataclass(frozen=True)
class Snapshot:
    files: Mapping[str, Mapping[str, FileSig]]  # section (rootfs, workspace) -> path -> sig
    processes: Mapping[int, Proc]
    sockets: frozenset[str]  # "tcp 0100007F:1B58", "unix @/x", ...
    unreadable: tuple[str, ...] = field(default=())  # what could not be read, and why


@dataclass(frozen=True)
class Decision:
    decision: str  # protocol.TURN_DECISIONS
    reasons: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"decision": self.decision, "reasons": list(self.reasons)}


def _named(items: list[str]) -> str:
    shown = ", ".join(sorted(items)[:REASONS_SHOWN])
    more = len(items) - REASONS_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def file_changes(before: Snapshot, after: Snapshot) -> list[str]:
    """One reason per section whose files differ: added, removed, changed paths."""
    out = []
    for section in sorted(set(before.files) | set(after.files)):
        old, new = before.files.get(section, {}), after.files.get(section, {})
        if section not in before.files or section not in after.files:
            out.append(f"{section}: {'appeared' if section in after.files else 'vanished'}")
            continue
        added = [p for p in new if p not in old]
        removed = [p for p in old if p not in new]
        changed = [p for p in new if p in old and new[p] != old[p]]
        for verb, paths in (("added", added), ("removed", removed), ("changed", changed)):
            if paths:
                out.append(f"{section}: {len(paths)} {verb} ({_named(paths)})")
    return out


def process_changes(before: Snapshot, after: Snapshot) -> list[str]:
    """Reasons for a full checkpoint found in the processes and sockets."""
    out = []
    old, new = before.processes, after.processes
    started = [str(p.pid) for p in new.values()
               if p.pid not in old or old[p.pid].identity != p.identity]
    ended = [str(p.pid) for p in old.values()
             if p.pid not in new or new[p.pid].identity != p.identity]
    if started:
        out.append(f"processes started: {_named(started)}")
    if ended:
        out.append(f"processes ended: {_named(ended)}")
    same = [(old[pid], p) for pid, p in new.items()
            if pid in old and old[pid].identity == p.identity]
    grew = [str(p.pid) for o, p in same if o.memory != p.memory]
    ran = [str(p.pid) for o, p in same if not p.exempt and o.activity != p.activity]
    if grew:
        out.append(f"memory counters changed: pids {_named(grew)}")
    if ran:
        out.append(f"processes ran: pids {_named(ran)}")
    opened = sorted(after.sockets - before.sockets)
    closed = sorted(before.sockets - after.sockets)
    if opened:
        out.append(f"listening sockets opened: {_named(opened)}")
    if closed:
        out.append(f"listening sockets closed: {_named(closed)}")
    return out


def thaw_only(at_dump: Proc, after_thaw: Proc) -> bool:
    """Whether all that moved in one process between its checkpoint's dump (read while
    the tree was still frozen) and the read after the thaw is the thaw's own wake-up: a
    thawed thread finishes the wait it was frozen in and sleeps again (one voluntary
    context switch; on a busy node it may also be preempted on the way, one involuntary
    one), with no clock tick of CPU time and no memory counter moved. Anything more means
    the process ran after the dump: its memory may differ from the checkpoint's. (Work
    that sleeps again makes a voluntary switch beyond the thaw's: one tick of a
    single-threaded workload after the dump is seen.)"""
    if at_dump.identity != after_thaw.identity or at_dump.memory != after_thaw.memory:
        return False
    if at_dump.exempt:
        return True
    utime, stime, threads, voluntary, involuntary = at_dump.activity
    woke = after_thaw.activity[3] - voluntary
    preempted = after_thaw.activity[4] - involuntary
    return (after_thaw.activity[:3] == (utime, stime, threads)
            and 0 <= woke <= threads and 0 <= preempted <= threads)


def settled(turn_end: Snapshot, at_dump: Snapshot, after_thaw: Snapshot) -> Snapshot:
    """The baseline a turn checkpoint leaves: its turn's end state, with each process's
    memory and activity counters as its checkpoint holds them. Freezing and dumping move
    them (every process is stopped, seized and resumed), so they are read after the dump
    while the tree is still frozen (``at_dump``); the thaw moves them once more, so the
    read after the thaw (``after_thaw``) is taken instead when ``thaw_only`` says that is
    all it moved. A process that ran after the dump keeps its counters at the dump: the
    next turn sees it ran, whenever the read after the thaw happened. The directories are
    as they were after the thaw (CRIU makes and removes a temporary directory under the
    sandbox's /tmp, copying /tmp up and moving its times). Files, sockets and which
    processes exist stay those of the turn's end, so a change after it shows at the next
    turn even when the checkpoint caught it too. A directory holds no data: its children
    are compared one by one."""
    files = {section: {**entries, **{path: sig for path, sig in
                                     after_thaw.files.get(section, {}).items()
                                     if stat.S_ISDIR(sig.kind_mode)}}
             for section, entries in turn_end.files.items()}
    processes = dict(turn_end.processes)
    for pid, proc in turn_end.processes.items():
        dumped = at_dump.processes.get(pid)
        if dumped is None or dumped.identity != proc.identity:
            continue  # ended before the dump: the next turn sees that
        post = after_thaw.processes.get(pid)
        counters = post if post is not None and thaw_only(dumped, post) else dumped
        processes[pid] = Proc(pid=pid, start_ticks=proc.start_ticks, exe=proc.exe,
                              cmdline=proc.cmdline, memory=counters.memory,
                              activity=counters.activity, exempt=proc.exempt)
    return Snapshot(files=files, processes=processes, sockets=turn_end.sockets,
                    unreadable=(*turn_end.unreadable, *at_dump.unreadable,
                                *after_thaw.unreadable))


def decide(before: Snapshot | None, after: Snapshot, *,
           baseline_note: str | None = None) -> Decision:
    """skip, files-only or full for a turn whose end state is ``after``, given the
    snapshot of the sandbox's last turn checkpoint (None: there is none usable, and
    ``baseline_note`` says why)."""
    if before is None:
        return Decision(protocol.TURN_FULL,
                        (baseline_note or "no earlier turn checkpoint of this pod",))
    unread = [f"not readable: {what}" for what in (*before.unreadable, *after.unreadable)]
    if unread:
        return Decision(protocol.TURN_FULL, tuple(unread[:REASONS_SHOWN]))
    processes = process_changes(before, after)
    files = file_changes(before, after)
    if processes:
        return Decision(protocol.TURN_FULL, tuple(processes + files))
    if files:
        return Decision(protocol.TURN_FILES_ONLY, tuple(files))
    return Decision(protocol.TURN_SKIP, ("nothing changed since the last turn checkpoint",))
