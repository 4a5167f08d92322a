"""Find the host pid of a pod container's init on this node, from /proc alone.

The kubelet reports ``containerStatuses[].containerID`` as ``<runtime>://<id>``.
Every process of that container sits in a cgroup whose path contains ``<id>``
(cgroupfs: ``.../kubepods/.../<id>``; systemd: ``.../cri-containerd-<id>.scope``).
Of those processes the init is the one that is PID 1 of its pid namespace; when
/proc shows no pid namespace ids, it is the one whose parent is outside the set
(``kubectl exec`` processes also have the runtime as parent, so PID 1 wins).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from hermit_common.errors import HermitError

_ID = re.compile(r"^[0-9a-f]{12,128}$")


class ContainerNotFound(HermitError):
    """No process of the container runs on this node."""


def parse_container_id(container_id: str) -> str:
    """``containerd://<hex id>`` (any runtime scheme) -> ``<hex id>``."""
    _, sep, rest = container_id.partition("://")
    cid = rest if sep else container_id
    if not _ID.match(cid):
        raise HermitError(f"container id {container_id!r} is not <runtime>://<hex id>")
    return cid


def cgroup_mentions(cgroup_text: str, cid: str) -> bool:
    """True when any line of a /proc/<pid>/cgroup text has ``cid`` in its path."""
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and cid in parts[2]:
            return True
    return False


def parse_ppid(stat_text: str) -> int:
    """The parent pid from a /proc/<pid>/stat text (the name may hold spaces and ')')."""
    return int(stat_text.rsplit(")", 1)[1].split()[1])


def parse_nspid(status_text: str) -> tuple[int, ...]:
    """The NSpid line of /proc/<pid>/status: the pid in each nested pid namespace."""
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            return tuple(int(p) for p in line.split()[1:])
    return ()


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    nspid: tuple[int, ...]


def pick_init(procs: list[ProcInfo]) -> int | None:
    """The container's init among the processes of its cgroup (pure)."""
    members = {p.pid for p in procs}
    roots = [p for p in procs if p.ppid not in members]
    if not roots:
        return None
    pid1 = [p for p in roots if len(p.nspid) > 1 and p.nspid[-1] == 1]
    if pid1:
        return min(p.pid for p in pid1)
    return min(p.pid for p in roots)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the process ended while we looked
        return None


def container_processes(cid: str, proc_root: Path = Path("/proc")) -> list[ProcInfo]:
    """Every process whose cgroup path names the container ``cid``."""
    found = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        cgroup = _read(entry / "cgroup")
        if cgroup is None or not cgroup_mentions(cgroup, cid):
            continue
        stat = _read(entry / "stat")
        if stat is None:
            continue
        status = _read(entry / "status") or ""
        found.append(ProcInfo(int(entry.name), parse_ppid(stat), parse_nspid(status)))
    return found


def pick_adopted_root(init: ProcInfo, children: list[ProcInfo]) -> int | None:
    """The root of a tree that a restore made a child of the container's init (pure).

    A restore re-creates the checkpointed tree in a pid namespace of its own, nested one
    level under the new container's, and the tree is reparented to the container's
    init. So the adopted root is the child that is PID 1 of a pid namespace one level
    deeper than the init's. Nothing else can be such a child: what the init forks lives
    in the init's own pid namespace, and ``kubectl exec`` processes are children of the
    runtime shim. None when the init adopted nothing (a fresh sandbox).
    """
    depth = len(init.nspid)
    adopted = [c.pid for c in children if c.ppid == init.pid and depth > 0
               and len(c.nspid) == depth + 1 and c.nspid[-1] == 1]
    if len(adopted) > 1:
        raise HermitError(f"pid {init.pid} adopted {len(adopted)} restored trees "
                          f"({', '.join(map(str, sorted(adopted)))}); expected at most one")
    return adopted[0] if adopted else None


def proc_info(pid: int, proc_root: Path = Path("/proc")) -> ProcInfo | None:
    """The pid, parent and NSpid of one process; None when it is gone."""
    stat = _read(proc_root / str(pid) / "stat")
    if stat is None:
        return None
    return ProcInfo(pid, parse_ppid(stat), parse_nspid(_read(proc_root / str(pid) / "status")
                                                       or ""))


def children_of(pid: int, proc_root: Path = Path("/proc")) -> list[ProcInfo]:
    """The direct children of ``pid`` (every thread's children list)."""
    kids: set[int] = set()
    try:
        tasks = list((proc_root / str(pid) / "task").iterdir())
    except OSError:
        return []
    for task in tasks:
        kids.update(int(k) for k in (_read(task / "children") or "").split())
    return [info for k in sorted(kids) if (info := proc_info(k, proc_root)) is not None]


def dump_root(init_pid: int, proc_root: Path = Path("/proc")) -> int:
    """The process CRIU must dump for the container whose init is ``init_pid``.

    A fresh sandbox: the init itself. A restored one: the tree the init adopted, since
    CRIU cannot dump the nested pid namespace the restore put it in; dumping its root
    keeps the nesting at one level however often the sandbox moves.
    """
    init = proc_info(init_pid, proc_root)
    if init is None:
        raise ContainerNotFound(f"no process with pid {init_pid}")
    adopted = pick_adopted_root(init, children_of(init_pid, proc_root))
    return adopted if adopted is not None else init_pid


def find_init_pid(container_id: str, proc_root: Path = Path("/proc")) -> int:
    """Host pid of the init of the container ``<runtime>://<id>``; ContainerNotFound if none."""
    cid = parse_container_id(container_id)
    pid = pick_init(container_processes(cid, proc_root))
    if pid is None:
        raise ContainerNotFound(f"no process of container {cid[:12]} runs on this node")
    return pid
