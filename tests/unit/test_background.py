"""Background work runs at the lowest CPU and I/O priority, and only while it runs."""

from __future__ import annotations

import os
import threading

from hermit_node.control import background


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_thread_and_the_threads_it_starts_are_nicest_only_inside() -> None:
    before = _nice()
    seen: list[int] = []
    with background.lowest_priority():
        inside = _nice()
        child = threading.Thread(target=lambda: seen.append(_nice()))
        child.start()
        child.join()
    assert inside == background.NICEST
    assert seen == [background.NICEST]
    if os.geteuid() == 0:  # raising it back needs CAP_SYS_NICE, which the node-agent has
        assert _nice() == before


def test_other_threads_keep_their_priority() -> None:
    other: list[int] = []
    ready, release = threading.Event(), threading.Event()

    def work() -> None:
        ready.set()
        release.wait(5)
        other.append(_nice())

    thread = threading.Thread(target=work)
    thread.start()
    ready.wait(5)
    before = os.getpriority(os.PRIO_PROCESS, thread.native_id or 0)
    with background.lowest_priority():
        release.set()
        thread.join(5)
    assert other == [before]
