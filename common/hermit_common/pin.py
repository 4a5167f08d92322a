"""Which checkpoint, pinned how: the one value a restore, a prefetch, a fork's data key
and the store's manifest reads take to name a checkpoint and what it must match.

A Checkpoint's status names what was written (status.manifestDigest, .parent,
.lineage); the sandbox's uid is what it is bound to. A reader checks each one that is
set (None: not checked; ``parent`` "": restored from nothing): the digest against the
stored manifest's bytes before anything is parsed, the rest against what a sealed
manifest is signed for (seal.open_manifest) and what a plain one records (its binding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Pin:
    namespace: str
    sandbox: str  # the sandbox the checkpoint was taken of (differs from a fork's own)
    checkpoint: str
    uid: str | None = None  # that sandbox's uid, which the manifest is bound to
    parent: str | None = None  # status.parent: what a sealed manifest is signed with
    lineage: tuple[str, ...] | None = None  # status.lineage, when recorded
    digest: str | None = None  # status.manifestDigest: the stored manifest's sha256

    def bound(self) -> str:
        """The sandbox uid, which a download needs (the binding of every manifest)."""
        if self.uid is None:
            raise ValueError(f"checkpoint {self.namespace}/{self.sandbox}/{self.checkpoint}: "
                             "a download needs the sandbox uid it is bound to (Pin.uid)")
        return self.uid

    def with_uid(self, uid: str) -> Pin:
        return dataclasses.replace(self, uid=uid)
