"""Read an ``inspector.Snapshot`` of a sandbox container from /proc and its directories.

The container is found as the checkpoint engine finds it (``locate``, ``container``):
its init by the container id in the processes' cgroups, the writable layer as the
overlay upperdir of its root mount, the workspace as the host source of its bind mount.
Nothing is written and nothing is frozen; reading /proc does not wake a process. What
cannot be read goes into ``Snapshot.unreadable`` (the inspector then decides full).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Final

from hermit_node.engine import safecopy
from hermit_node.engine.inspector import FileSig, Proc, Snapshot
from hermit_node.host import container, locate

INIT_NAME: Final = "hermit-init"
MEMORY_KEYS: Final = ("VmSize", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmData", "VmSwap")
VOLUNTARY: Final = "voluntary_ctxt_switches"
INVOLUNTARY: Final = "nonvoluntary_ctxt_switches"
TCP_LISTEN: Final = "0A"
UNIX_LISTEN_FLAG: Final = 0x10000  # __SO_ACCEPTCON
SECTION_ROOTFS: Final = "rootfs"
SECTION_WORKSPACE: Final = "workspace"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def status_fields(text: str) -> dict[str, int]:
    """The numeric fields of a /proc/<pid>/status text (``VmRSS: 123 kB`` -> 123)."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0])
    return out


def stat_fields(text: str) -> tuple[int, int, int]:
    """(utime, stime, starttime) of a /proc/<pid>/stat text."""
    fields = text.rsplit(")", 1)[1].split()  # fields[0] is field 3 (state)
    return int(fields[11]), int(fields[12]), int(fields[19])


def listening(net: dict[str, str]) -> frozenset[str]:
    """Listening TCP and bound UDP sockets, and listening unix sockets, from the texts of
    /proc/<pid>/net/{tcp,tcp6,udp,udp6,unix}."""
    out = set()
    for proto in ("tcp", "tcp6", "udp", "udp6"):
        for line in net.get(proto, "").splitlines()[1:]:
            cols = line.split()
            if len(cols) > 3 and (proto.startswith("udp") or cols[3] == TCP_LISTEN):
                out.add(f"{proto} {cols[1]}")
    for line in net.get("unix", "").splitlines()[1:]:
        cols = line.split()
        if len(cols) > 3 and int(cols[3], 16) & UNIX_LISTEN_FLAG:
            out.add(f"unix {cols[7] if len(cols) > 7 else '(unnamed) ' + cols[6]}")
    return frozenset(out)


def tree_signature(root: Path) -> dict[str, FileSig]:
    """Every entry under ``root`` (not following symlinks), by path relative to it.
    The tree is the tenant's: walked from directory fds, never by path (safecopy.walk;
    a directory swapped for a symlink meanwhile raises OSError: unreadable)."""
    return {rel: FileSig(st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else 0,
                         st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_uid, st.st_gid)
            for rel, st in safecopy.walk(root)}


def process(pid: int, proc_root: Path, exempt: bool) -> Proc | None:
    """One process; None when it ended while we looked."""
    base = proc_root / str(pid)
    stat_text, status_text = _read(base / "stat"), _read(base / "status")
    cmdline = _read(base / "cmdline")
    if stat_text is None or status_text is None or cmdline is None:
        return None
    utime, stime, start = stat_fields(stat_text)
    status = status_fields(status_text)
    voluntary = involuntary = 0
    try:
        tasks = list((base / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        fields = status_fields(_read(task / "status") or "")
        voluntary += fields.get(VOLUNTARY, 0)
        involuntary += fields.get(INVOLUNTARY, 0)
    try:
        exe = os.readlink(base / "exe")
    except OSError:
        exe = ""
    return Proc(pid=pid, start_ticks=start, exe=exe, cmdline=tuple(cmdline.split("\0")),
                memory=tuple(status.get(k, 0) for k in MEMORY_KEYS),
                activity=(utime, stime, status.get("Threads", 0), voluntary, involuntary),
                exempt=exempt)


def _init_pids(init_pid: int, proc_root: Path) -> set[int]:
    """Hermit's init processes: the container's PID 1 and a restored tree's old init."""
    roots = {init_pid, locate.dump_root(init_pid, proc_root)}
    return {pid for pid in roots
            if (_read(proc_root / str(pid) / "comm") or "").strip() == INIT_NAME}


def take(container_id: str, workspace_path: str | None,
         proc_root: Path = Path("/proc"), *, with_files: bool = True) -> Snapshot:
    """A snapshot of the container ``<runtime>://<id>``; a HermitError when it does not
    run here."""
    cid = locate.parse_container_id(container_id)
    members = locate.container_processes(cid, proc_root)
    init_pid = locate.pick_init(members)
    if init_pid is None:
        raise locate.ContainerNotFound(f"no process of container {cid[:12]} runs on this node")
    unreadable: list[str] = []
    view = container.inspect(init_pid)
    exempt = _init_pids(init_pid, proc_root)
    processes = {}
    for member in members:
        proc = process(member.pid, proc_root, member.pid in exempt)
        if proc is not None:
            processes[proc.pid] = proc
    net = {p: _read(proc_root / str(init_pid) / "net" / p) or "" for p in
           ("tcp", "tcp6", "udp", "udp6", "unix")}
    files: dict[str, dict[str, FileSig]] = {}
    sources = {SECTION_ROOTFS: view.upperdir,
               SECTION_WORKSPACE: Path(src) if workspace_path and (
                   src := view.bind_source(workspace_path)) else None}
    for section, source in sources.items():
        if source is None or not with_files:
            continue
        try:
            files[section] = tree_signature(source)
        except OSError as exc:
            unreadable.append(f"{section}: {exc.strerror or exc}")
    return Snapshot(files=files, processes=processes, sockets=listening(net),
                    unreadable=tuple(unreadable))



FROZEN_POLL_SECONDS: Final = 0.002
FROZEN_WAIT_SECONDS: Final = 0.2


def runnable_threads(pids: Iterable[int], proc_root: Path = Path("/proc")) -> list[int]:
    """The threads of ``pids`` in state R (running or runnable)."""
    out = []
    for pid in pids:
        try:
            tasks = list((proc_root / str(pid) / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            text = _read(task / "stat")
            if text is not None and text.rsplit(")", 1)[1].split()[:1] == ["R"]:
                out.append(int(task.name))
    return out


def frozen(read: Callable[[], Snapshot], proc_root: Path = Path("/proc")) -> Snapshot:
    """``read()`` of a frozen tree once none of its threads is runnable before and after
    the read. The freezer counts a task frozen a moment before it leaves the CPU, so its
    last context switch can land after a read taken at once. After FROZEN_WAIT_SECONDS,
    the read as it is: a switch counted late then makes the next turn full, never skip."""
    deadline = time.monotonic() + FROZEN_WAIT_SECONDS
    snap = read()
    while time.monotonic() < deadline:
        if not runnable_threads(snap.processes, proc_root):
            again = read()  # bracketed by two looks that found every thread off the CPU
            if not runnable_threads(again.processes, proc_root):
                return again
        time.sleep(FROZEN_POLL_SECONDS)
        snap = read()
    return snap


def at_dump(container_id: str) -> Snapshot:
    """The container's processes (no files) while a checkpoint's tree is still frozen
    after the dump (``frozen``)."""
    return frozen(lambda: take(container_id, None, with_files=False))


STEADY_POLL_SECONDS: Final = 0.05
STEADY_READS: Final = 20


def _counters(snap: Snapshot) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {pid: (p.memory, p.activity) for pid, p in snap.processes.items()}


def after_thaw(container_id: str, workspace_path: str | None) -> Snapshot:
    """The container just after a checkpoint thawed it: the processes once their counters
    hold still for STEADY_POLL_SECONDS (a thawed task wakes, finishes the wait it was in
    and sleeps again a moment later; after STEADY_READS reads, the last one), then the
    files."""
    last = take(container_id, None, with_files=False)
    for _ in range(STEADY_READS):
        time.sleep(STEADY_POLL_SECONDS)
        now = take(container_id, None, with_files=False)
        if _counters(now) == _counters(last):
            break
        last = now
    files = take(container_id, workspace_path)
    return Snapshot(files=files.files, processes=last.processes, sockets=files.sockets,
                    unreadable=(*last.unreadable, *files.unreadable))
