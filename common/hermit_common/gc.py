"""What S3 garbage collection deletes, decided from listings alone (pure functions).

A sandbox's prefix holds manifests (``checkpoints/<name>/manifest.json``) and chunks
(``chunks/<name>``). A manifest is kept while its Checkpoint object exists (``keep``);
a chunk is kept while a kept manifest references it. Nothing younger than
``min_age_seconds`` is deleted: it may belong to an upload that is still running.
The I/O (listing, reading manifests, deleting) is ``CheckpointStore.collect``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class CollectResult:
    """What one collection deleted (object names under the sandbox's prefix)."""

    manifests: tuple[str, ...] = ()  # checkpoint names whose manifest was deleted
    chunks: tuple[str, ...] = ()  # chunk object names deleted
    aborted: bool = False  # stopped before the end (``may_delete`` said no)

    @property
    def deleted(self) -> int:
        return len(self.manifests) + len(self.chunks)


def old_enough(age_seconds: float | None, min_age_seconds: float) -> bool:
    """True when an object of that age may go (an unknown age counts as old)."""
    return min_age_seconds <= 0 or age_seconds is None or age_seconds >= min_age_seconds


def doomed(stored: Mapping[str, float | None], keep: Collection[str],
           min_age_seconds: float) -> list[str]:
    """The names in ``stored`` (name -> age in seconds, None when unknown) that are not in
    ``keep`` and are at least ``min_age_seconds`` old, sorted."""
    return sorted(name for name, age in stored.items()
                  if name not in keep and old_enough(age, min_age_seconds))
