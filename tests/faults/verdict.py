"""Lost and duplicated, measured: how each fault scenario decides its row of the table.

The verdict on ticks is the external tick ledger's (tests/support/ledger.py): every tick
any copy of the sandbox made, reported as it happened to a collector in the test
process, judged over the whole run. Its lost and duplicated tick counts are columns of
the table of their own, and fold into the row's lost and duplicated.

Lost: the sandbox is not Running again, or the ledger has a tick number no copy reported
(between the first and the last), or the workload's own checks (memory, child, pipes,
socket, database, files) fail, or the restored pod's log does not continue from the
ledger's last tick before it (a cross-check).
Duplicated: a tick number reported twice in the ledger, or more than one live copy,
counted both in the API (live pods of the sandbox) and on the host (workload process
trees carrying the sandbox's marker in their environment; the local cluster's nodes share
this host's kernel) as a cross-check.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hermit_common import protocol
from tests.e2e import sandboxes as sb
from tests.e2e.cluster import Kube
from tests.support import ledger

MARKER = "HERMIT_FAULT_SANDBOX"


def spec(image: str, name: str, **extra: Any) -> dict[str, Any]:
    """The self-checking workload's spec with the sandbox's marker in its environment."""
    body = sb.stateful_spec(image, **extra)
    body["podTemplate"]["spec"]["containers"][0]["env"].append({"name": MARKER, "value": name})
    return body


def live_process_trees(name: str) -> int:
    """Live workload processes of ``name`` on this host whose parent is not one of them.
    A process that is exiting or has a SIGKILL pending never runs the workload again, so
    it is no copy: a stopped tree dies from its root down (SIGKILL to the pid namespace),
    and its children, whose parent is gone, would otherwise count as trees of their own."""
    pids = {pid for pid in sb.host_pids(b"hermit-stateful", {f"{MARKER}={name}".encode()})
            if _alive(pid)}
    return sum(1 for pid in pids if _parent(pid) not in pids)


PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit
SIGKILL_BIT = 1 << (9 - 1)  # /proc/<pid>/status signal masks: bit n-1 is signal n


def _alive(pid: int) -> bool:
    """Not a zombie, not exiting, and no SIGKILL pending (read from /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    if stat[0] in "ZXx" or int(stat[6]) & PF_EXITING:
        return False
    pending = {k: int(v, 16) for k, _, v in (line.partition(":\t") for line in
                                             status.splitlines())
               if k in ("SigPnd", "ShdPnd")}
    return not any(mask & SIGKILL_BIT for mask in pending.values())


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def live_pods(kube: Kube, ns: str, name: str) -> list[str]:
    return [p.metadata.name for p in kube.api.list_namespaced_pod(ns).items
            if (p.metadata.labels or {}).get(protocol.LABEL_SANDBOX) == name
            and p.metadata.deletion_timestamp is None and p.status.phase == "Running"]


@dataclass(frozen=True)
class Outcome:
    lost: int
    duplicated: int
    detail: str
    ledger_lost: int | None = None  # tick numbers, from the external ledger (None: unjudged)
    ledger_duplicated: int | None = None


def judge(kube: Kube, ns: str, name: str, before: int = 0, *, restores: int,
          avoid: str = "", allow_replay: bool = False, timeout: float = 300) -> Outcome:
    """Waits for the sandbox to run again and judges it without raising, so the row is
    recorded before the scenario asserts. The ledger decides the ticks; ``before`` (the
    old pod's last tick read from its log, 0: not read) is a cross-check, noted.
    ``allow_replay``: the move restored a routine checkpoint (the node or pod was lost),
    so ticks redone after the old copy ended are no duplicate."""
    try:
        after = sb.wait_running(kube, ns, name, restores=restores, avoid=avoid,
                                timeout=timeout, min_ticks=1)
        first = sb.ticks(kube, ns, after.pod)
    except (AssertionError, pytest.fail.Exception) as exc:
        return Outcome(1, _duplicates(kube, ns, name), f"lost: {exc}"[:300],
                       *_ledger_counts(name, allow_replay))
    try:
        v = sb.ledger_verdict(name, after=first[-1] if first else 0)
        previous = max((c.last_tick for c in v.copies if c.gen < after.restores), default=0)
        # The restored pod's log must not restart the counter, have a gap or a repeat, or
        # skip past the ledger's last tick before it (a tick cut by the freeze is reported
        # before it is logged), and the workload's own checks must hold.
        seen = sb.assert_continues(kube, ns, after.pod, previous, exact=False)
    except (AssertionError, pytest.fail.Exception) as exc:
        return Outcome(1, _duplicates(kube, ns, name), f"lost: {exc}"[:300],
                       *_ledger_counts(name, allow_replay))
    final = sb.ledger_verdict(name, after=seen[-1])
    lost, dup = _counts(final, allow_replay)
    # A copy's last report dropped could hide a duplicate: such a record proves nothing.
    unproven = bool(final.edge_dropped or final.refused or final.first != 1)
    # Cross-check, noted: the old pod's log as last read (0: never) against the restored
    # pod's first logged tick (a read that came too late or too early shows up here).
    crosscheck = "" if not before or allow_replay or seen[0] == before + 1 else (
        f"; log cross-check: the old pod's log read ended at {before}, the restored log "
        f"starts at {seen[0]}")
    detail = (f"runs on {after.node} from tick {seen[0]}; "
              f"{'UNPROVEN ' if unproven else ''}ledger {final.summary()}{crosscheck}")
    return Outcome(1 if (lost or unproven) else 0,
                   max(_duplicates(kube, ns, name), 1 if dup else 0), detail[:700], lost, dup)


def _counts(v: ledger.Verdict, allow_replay: bool) -> tuple[int, int]:
    return len(v.lost), len(v.concurrent if allow_replay else v.duplicated)


def _ledger_counts(name: str, allow_replay: bool, after: int = 0) -> tuple[int, int]:
    """(lost, duplicated) tick counts of the external ledger's verdict on ``name``."""
    try:
        v = sb.ledger_verdict(name, after=after, timeout=10)
    except (AssertionError, pytest.fail.Exception):
        return 1, 0  # no report at all: nothing shows the ticks were made
    return _counts(v, allow_replay)


def _duplicates(kube: Kube, ns: str, name: str) -> int:
    copies = max(len(live_pods(kube, ns, name)), live_process_trees(name))
    return max(0, copies - 1)

