"""The node-agent's jobs: a few worker threads, one job per sandbox at a time, the most
urgent first (``Jobs``), and the bookkeeping of which Checkpoints and pods this process
took up (``Taken``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from hermit_node.control.ports import NO_LIMITER, UploadPromoter

log = logging.getLogger("hermit_node")

WORKERS = 4
# Checkpoints at once (each freezes its sandbox until captured, a stopping one until
# durable): see Jobs.
FREEZING = 2

# Job priorities, first served first: a stopping checkpoint (protocol.is_stopping: a
# notice, a drain or a Suspend), a restore (a sandbox waits for it), a routine checkpoint
# (it can wait), a prefetch (an optimisation: at most ``BACKGROUND`` run at once, so
# workers stay free). Not bandwidth.URGENT, which is the migrating reasons only.
PRIORITY_STOPPING, PRIORITY_RESTORE, PRIORITY_ROUTINE, PRIORITY_PREFETCH = 0, 1, 2, 3
BACKGROUND = 1


@dataclass(order=True)
class _Queued:
    priority: int
    seq: int  # first come, first served within a priority
    key: tuple[str, str] = field(compare=False)
    fn: Callable[[], None] = field(compare=False)
    freezes: bool = field(compare=False)


class Jobs:
    """A few worker threads that run at most one job per key (a sandbox) at a time, the
    queued job of the first priority first (``PRIORITY_STOPPING``, ``PRIORITY_RESTORE``,
    ``PRIORITY_ROUTINE``; in submission order within one), and at most ``freezing`` jobs
    that freeze a sandbox (checkpoints) at once.

    A job only freezes its sandbox once it runs, so a sandbox never stays frozen while it
    waits for a worker; and a stopping checkpoint keeps its sandbox frozen until durable, so
    fewer of them at once on a node of few cores makes each one durable, and its sandbox
    free, sooner (``FREEZING``) and makes no more durable by a notice's deadline with more
    of them sharing the node than with fewer. Routine work queued when a notice comes waits
    behind every stopping checkpoint.
    """

    def __init__(self, workers: int = WORKERS, freezing: int = FREEZING) -> None:
        self._freezing_limit = max(1, min(freezing, workers))
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._busy: set[tuple[str, str]] = set()
        self._freezing = 0
        self._background = 0  # prefetches running
        self._seq = 0
        self._closed = False
        self._local = threading.local()  # the job a worker thread runs
        self._threads = [threading.Thread(target=self._work, name=f"hermit-job-{i}",
                                          daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, key: tuple[str, str], fn: Callable[[], None], *,
               priority: int = PRIORITY_ROUTINE, freezes: bool = False) -> bool:
        """Queue ``fn`` unless a job for ``key`` is queued or runs; True when queued."""
        with self._cond:
            if key in self._busy or self._closed:
                return False
            self._busy.add(key)
            self._seq += 1
            self._queue.append(_Queued(priority, self._seq, key, fn, freezes))
            self._queue.sort()
            self._cond.notify()
        return True

    def _next(self) -> _Queued | None:
        """The most urgent queued job that may start now (under the condition's lock)."""
        for job in self._queue:
            if job.priority >= PRIORITY_PREFETCH and self._background >= BACKGROUND:
                continue
            if not job.freezes or self._freezing < self._freezing_limit:
                self._queue.remove(job)
                self._freezing += job.freezes
                self._background += job.priority >= PRIORITY_PREFETCH
                return job
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                while (job := self._next()) is None:
                    if self._closed and not self._queue:
                        return
                    self._cond.wait()
            self._local.job = job
            try:
                job.fn()
            except Exception:  # a bug in a job must not take the agent down
                log.exception("job for %s/%s crashed", *job.key)
            finally:
                self._local.job = None
                with self._cond:
                    self._busy.discard(job.key)
                    self._freezing -= job.freezes
                    self._background -= job.priority >= PRIORITY_PREFETCH
                    self._cond.notify_all()

    def unfrozen(self) -> None:
        """Called by a job once its checkpoint is durable (its sandbox thawed, or about to
        be ended): its freezing slot goes to the next checkpoint while it cleans up (the
        removal of its staging directory took 3-5 s on a loaded node)."""
        job = getattr(self._local, "job", None)
        if job is None or not job.freezes:
            return
        with self._cond:
            job.freezes = False
            self._freezing -= 1
            self._cond.notify_all()

    def busy(self) -> set[tuple[str, str]]:
        with self._cond:
            return set(self._busy)

    def shutdown(self) -> None:
        """Run what is queued, then stop the workers; nothing is queued after this."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()


class Taken:
    """The uids of the Checkpoints and pods this process took up (a job queued or run for
    each): forgotten once the local copy no longer shows them waiting (planner.awaiting)
    and no job runs for them, so none is taken twice."""

    def __init__(self, jobs: Jobs, limiter: UploadPromoter = NO_LIMITER) -> None:
        self._jobs = jobs
        self._limiter = limiter  # the node's upload bandwidth, shared with the engine
        self._lock = threading.Lock()
        self.taken: set[str] = set()
        self.running: set[str] = set()

    def start(self, uid: str, key: tuple[str, str], fn: Callable[[], None], *,
              priority: int, freezes: bool = False) -> None:
        with self._lock:
            if uid in self.taken:
                return
            self.taken.add(uid)
            self.running.add(uid)

        def job() -> None:
            try:
                fn()
            finally:
                with self._lock:
                    self.running.discard(uid)

        if not self._jobs.submit(key, job, priority=priority, freezes=freezes):
            with self._lock:
                self.taken.discard(uid)  # busy with another job: next loop
                self.running.discard(uid)
            if priority == PRIORITY_STOPPING:
                # The job in the way (a routine checkpoint) now uploads as a notice's
                # does: this sandbox's stopping checkpoint waits for it.
                self._limiter.promote(key)

    def release(self, uid: str) -> None:
        """Forget a job that did not get to write anything, so the next loop retries it."""
        with self._lock:
            self.taken.discard(uid)

    def forget_finished(self, waiting: set[str]) -> None:
        """Keep ``taken`` bounded: a uid stays while its job runs or while the local copy
        still shows the object waiting (a status just written may not be seen yet)."""
        with self._lock:
            self.taken = {uid for uid in self.taken if uid in waiting or uid in self.running}
