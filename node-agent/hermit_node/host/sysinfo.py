"""Facts about this node that a checkpoint is bound to: kernel and CPU features."""

from __future__ import annotations

import os
import re
from pathlib import Path

# CPU features user space code may pick at run time (libc ifuncs, JITs, numeric
# libraries). A restored process that used one the new CPU lacks dies with SIGILL.
_USER_VISIBLE = re.compile(
    r"^(sse\w*|ssse3|avx\w*|aes|vaes|sha_ni|bmi\d|fma\w*|f16c|popcnt|movbe|adx|rdrand|rdseed|"
    r"pclmulqdq|vpclmulqdq|gfni|amx\w*|abm|lzcnt|erms|fsrm|cx16|clflushopt|clwb|xsave\w*|"
    r"pku|ospke|rtm|hle|mmx|sse4\w*|avx512\w*|sm\d|asimd\w*|sve\w*|atomics|crc32)$"
)


def kernel_release() -> str:
    return os.uname().release


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The user-visible CPU features of this machine, sorted."""
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return tuple(sorted({f for f in value.split() if _USER_VISIBLE.match(f)}))
    return ()


def missing_cpu_flags(source: tuple[str, ...], here: tuple[str, ...]) -> tuple[str, ...]:
    """Features the source CPU had that this one lacks (empty: restore is safe)."""
    return tuple(sorted(set(source) - set(here)))
