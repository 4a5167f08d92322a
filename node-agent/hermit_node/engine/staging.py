"""The node-agent's local staging area (``HERMIT_WORK_DIR``): room before use, clean after.

A checkpoint stages its CRIU images and copies of the writable layer and the workspace
under ``<work dir>/checkpoints/``; a restore downloads under ``<work dir>/restores/``.
Before a checkpoint freezes anything, ``check_checkpoint_room`` makes sure the work
dir's filesystem can hold it (the restore's own check is ``restore.check_room``). At
start the node-agent removes whatever an earlier run left there (``clean``): no job
runs yet, and nothing there is needed after a restart (durable data is in S3).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from hermit_common.errors import CheckpointFailed
from hermit_node.engine import safecopy

log = logging.getLogger(__name__)

STAGING_DIRS = ("checkpoints", "restores")
# Left free beyond what a checkpoint stages: CRIU's log, the manifest, other jobs' slack.
RESERVE_BYTES = 64 * 1024 * 1024


def needs_text(needs: Sequence[tuple[str, int]]) -> str:
    return " + ".join(f"{n} bytes for {what}" for what, n in needs)


def check_room(path: Path, needs: Sequence[tuple[str, int]], free: int,
               reserve: int = RESERVE_BYTES) -> None:
    """CheckpointFailed naming the path and the bytes needed and free, when ``needs`` (what,
    bytes) plus ``reserve`` do not fit in ``free``."""
    needed = sum(n for _, n in needs) + reserve
    if needed > free:
        raise CheckpointFailed(
            f"not enough free space in {path} to stage the checkpoint: "
            f"{needs_text(needs)} + {reserve} bytes reserve = {needed} bytes needed, "
            f"{free} bytes free")


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem."""
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (a hardlinked file once); 0 if absent.
    The tree is the tenant's: walked without following any of its paths (safecopy)."""
    return safecopy.tree_bytes(root)


def memory_bytes(cgroup_dirs: Iterable[Path]) -> int:
    """The memory a container's cgroup charges (v2 ``memory.current``, v1
    ``memory.usage_in_bytes``): about what CRIU's page images take. 0 when unknown."""
    for directory in cgroup_dirs:
        for name in ("memory.current", "memory.usage_in_bytes"):
            try:
                return int((directory / name).read_text().strip())
            except (OSError, ValueError):
                continue
    return 0


def check_checkpoint_room(work_dir: Path, *, cgroup_dirs: Iterable[Path],
                          trees: Sequence[tuple[str, Path]], strict: bool = True) -> None:
    """The work dir can hold a checkpoint of a container: its memory (the images; the
    cgroup's charge, page cache included, so an upper bound) and the trees it copies (the
    writable layer, the workspace). CheckpointFailed if not; with ``strict`` False (a
    stopping checkpoint: the sandbox is lost anyway if it is not taken) only a warning."""
    work_dir.mkdir(parents=True, exist_ok=True)
    needs = [("the memory images", memory_bytes(cgroup_dirs)),
             *((f"a copy of {what} ({path})", tree_bytes(path)) for what, path in trees)]
    try:
        check_room(work_dir, needs, free_bytes(work_dir))
    except CheckpointFailed as exc:
        if strict:
            raise
        log.warning("%s; trying anyway (a stopping checkpoint)", exc)


def discard(local: Path, keep: Path | None = None) -> None:
    """Removes a job's staging dir after a failure; ``keep`` (CRIU's log in it) is moved
    beside it first as ``<dir>.<log name>``, for whoever looks into the failure (the next
    start removes it)."""
    if keep is not None and keep.is_file():
        with contextlib.suppress(OSError):
            os.replace(keep, local.with_name(f"{local.name}.{keep.name}"))
    shutil.rmtree(local, ignore_errors=True)


def clean(work_dir: Path) -> list[Path]:
    """Removes what earlier runs left in the staging dirs; returns what it removed."""
    removed = []
    for name in STAGING_DIRS:
        top = work_dir / name
        if not top.is_dir():
            continue
        for child in sorted(top.iterdir()):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child)
    if removed:
        log.info("removed %d leftovers of earlier runs from %s", len(removed), work_dir)
    return removed
