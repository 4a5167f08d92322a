"""The fork fan-out benchmark's pure parts (bench/fork_fanout.py): the node-agent's
restore-message parsed, the chunk cache's share per node, the spreads and the targets."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# hermit_node.control.planner.restored_message: "restored from X in N ms (B bytes; k of m
# chunks from the local cache)". B is the checkpoint's image size (manifest totals), not
# what crossed the network; m counts the distinct chunks fetched before the tree ran (a
# lazy restore's deferred pages are not in it), k of them from the node's chunk cache.
_RESTORED = re.compile(
    r"restored from (?P<checkpoint>\S+) in (?P<ms>\d+) ms \((?P<bytes>\d+) bytes; "
    r"(?P<cached>\d+) of (?P<chunks>\d+) chunks from the local cache\)")


@dataclass(frozen=True)
class Restore:
    """One restore as its node-agent reported it."""

    checkpoint: str
    ms: int
    image_bytes: int
    chunks: int
    cached: int

    @property
    def from_store(self) -> int:
        """Chunks fetched from S3 (not found in the node's cache)."""
        return self.chunks - self.cached

    @property
    def store_bytes(self) -> int:
        """The image bytes those chunks hold (an estimate: chunks are about equal in size;
        what crossed the network is their compressed form)."""
        return self.image_bytes * self.from_store // self.chunks if self.chunks else 0


def parse_restore_message(message: str | None) -> Restore | None:
    """The figures of a Restored pod's ``hermit.dev/restore-message``; None for any other
    message (a failure, an adopted restore after an agent restart, none yet)."""
    m = _RESTORED.search(message or "")
    if m is None:
        return None
    return Restore(m["checkpoint"], int(m["ms"]), int(m["bytes"]), int(m["chunks"]),
                   int(m["cached"]))


def spread(values: Iterable[float | None], total: int) -> str:
    """``p50 X s, max Y s (n/total)`` of the values there are."""
    have = sorted(v for v in values if v is not None)
    if not have:
        return f"none (0/{total})"
    return (f"p50 {statistics.median(have):.1f} s, max {have[-1]:.1f} s "
            f"({len(have)}/{total})")


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cache_by_node(restores: Sequence[tuple[str, float, Restore | None]]) -> list[str]:
    """Per node, from (node, when restored, its restore) in any order: how many chunks came
    from S3 and how many from the node's chunk cache, and which restores (in the order
    they finished) fetched nothing from S3: the claim that the tenth fork on a node
    downloads nothing."""
    lines = []
    for node in sorted({n for n, _, _ in restores}):
        mine = sorted(((t, r) for n, t, r in restores if n == node), key=lambda tr: tr[0])
        known = [r for _, r in mine if r is not None]
        unknown = len(mine) - len(known)
        store = sum(r.from_store for r in known)
        cached = sum(r.cached for r in known)
        chunks = store + cached
        none_from_store = [i + 1 for i, (_, r) in enumerate(mine)
                           if r is not None and r.from_store == 0]
        per_fork = " ".join(str(r.from_store) if r is not None else "?" for _, r in mine)
        share = f"{100 * cached / chunks:.0f} %" if chunks else "-"
        lines.append(
            f"{node}: {len(mine)} restores, chunks from S3 {store} "
            f"(~{mib(sum(r.store_bytes for r in known))}), from the cache {cached} "
            f"({share}); S3 chunks per restore in finishing order: {per_fork}; "
            f"fetched nothing from S3: {len(none_from_store)}/{len(mine)}"
            + (f" (restores #{','.join(map(str, none_from_store))})" if none_from_store
               else "")
            + (f"; {unknown} without figures" if unknown else ""))
    return lines


def targets(total: int, running: Sequence[float | None], first_tick: Sequence[float | None],
            *, running_within: float, tick_within: float) -> list[str]:
    """The issue's targets as verdict lines (figures, never a failure): every fork running
    within ``running_within`` s of its create, and each one's first tick within
    ``tick_within`` s of its pod starting."""
    up = [v for v in running if v is not None]
    ticked = [v for v in first_tick if v is not None]
    late = [v for v in up if v > running_within]
    slow = [v for v in ticked if v > tick_within]
    all_up = len(up) == total and not late
    all_ticked = len(ticked) == total and not slow
    worst_up = f"{max(up):.1f}" if up else "-"
    worst_tick = f"{max(ticked):.1f}" if ticked else "-"
    return [
        f"{'MET' if all_up else 'MISSED'}: all {total} forks running within "
        f"{running_within:g} s of their create ({len(up) - len(late)}/{total} did; "
        f"slowest {worst_up} s)",
        f"{'MET' if all_ticked else 'MISSED'}: each fork's first tick within "
        f"{tick_within:g} s of its pod starting ({len(ticked) - len(slow)}/{total} did; "
        f"slowest {worst_tick} s)",
    ]
