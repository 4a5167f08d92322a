"""Human-readable sizes, durations and progress for status fields that printer columns show.

A printer column can only print a field, so the writer of a status adds a display
field next to the exact number (``storedBytes: 25270000`` and ``size: "24.1 MiB"``).
Every display field is formatted here, so ``kubectl get asb`` and ``kubectl get ckpt``
read the same way whoever wrote them. Pure functions, no I/O.
"""

from __future__ import annotations

import math
from typing import Final

_UNITS: Final = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

# Checkpoint.status.progress before the upload's chunks are counted.
DUMPING: Final = "dumping"  # frozen: CRIU dump and file copy
UPLOADING: Final = "uploading"  # the chunks are being cut and counted


def size(num_bytes: int | float) -> str:
    """Bytes in binary units with one decimal: ``"512 B"``, ``"24.1 MiB"``, ``"1.0 GiB"``."""
    value = max(0.0, float(num_bytes))
    if value < 1024:
        return f"{int(value)} B"
    unit = 0
    while unit < len(_UNITS) - 1 and round(value, 1) >= 1024:
        value /= 1024
        unit += 1
    return f"{value:.1f} {_UNITS[unit]}"


def duration(seconds: float) -> str:
    """Like kubectl's ages, with tenths under a minute: ``"850ms"``, ``"1.8s"``,
    ``"2m5s"``, ``"1h2m"``."""
    value = max(0.0, float(seconds))
    if value < 1:
        return f"{int(value * 1000)}ms"
    if value < 60:
        tenths = math.floor(value * 10) / 10
        return f"{tenths:.1f}s"
    whole = int(value)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60}s"
    return f"{whole // 3600}h{whole % 3600 // 60}m"


def upload_progress(chunks_done: int, chunks_total: int, bytes_done: int,
                    bytes_total: int) -> str:
    """A running upload: ``"uploading 12/40 chunks (30%)"``; the percentage is of the
    bytes, rounded down, so 100% means every byte is stored."""
    if chunks_total <= 0:
        return UPLOADING
    percent = 100 * bytes_done // bytes_total if bytes_total > 0 else \
        100 * chunks_done // chunks_total
    return f"uploading {chunks_done}/{chunks_total} chunks ({min(100, max(0, percent))}%)"


def upload_summary(chunks_total: int, chunks_new: int | None) -> str:
    """A finished upload: ``"40 chunks, 3 new"`` (chunks the store did not have yet)."""
    noun = "chunk" if chunks_total == 1 else "chunks"
    if chunks_new is None:
        return f"{chunks_total} {noun}"
    return f"{chunks_total} {noun}, {chunks_new} new"
