"""Running work the node can do without: the calling thread, and the threads it starts,
at the lowest CPU and I/O priority while it runs."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

NICEST = 19
# linux/ioprio.h: ioprio_set/ioprio_get(IOPRIO_WHO_PROCESS, tid, ...); class in bits 13+.
_SYS_IOPRIO_SET, _SYS_IOPRIO_GET = 251, 252  # x86_64
_IOPRIO_WHO_PROCESS = 1
IOPRIO_IDLE = 3 << 13


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@contextmanager
def lowest_priority() -> Iterator[None]:
    """Nice 19 and the idle I/O class for this thread (threads it starts inherit both),
    restored on the way out: a prefetch must never slow a checkpoint or a restore."""
    tid = threading.get_native_id()
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    libc = _libc()
    ioprio = libc.syscall(_SYS_IOPRIO_GET, _IOPRIO_WHO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICEST)
        if libc.syscall(_SYS_IOPRIO_SET, _IOPRIO_WHO_PROCESS, tid, IOPRIO_IDLE) != 0:
            log.debug("idle I/O priority not set: errno %d", ctypes.get_errno())
    except OSError as exc:
        log.debug("lowest priority not set: %s", exc)
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as exc:  # raising it back needs CAP_SYS_NICE (the node-agent has it)
            log.warning("cannot restore the priority of thread %d: %s", tid, exc)
        if ioprio >= 0:
            libc.syscall(_SYS_IOPRIO_SET, _IOPRIO_WHO_PROCESS, tid, ioprio)
