"""Prefetches (docs/storage.md#prefetch-and-the-chunk-cache): the chunk cache filled from
a sandbox's newest Completed checkpoint while its pod waits for a checkpoint in flight."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from hermit_common.chunkcache import CacheTally
from hermit_common.protocol import KubeObject
from hermit_node.control import background, metrics, planner
from hermit_node.control.jobs import PRIORITY_PREFETCH, Jobs
from hermit_node.control.kube import Kube
from hermit_node.control.planner import SandboxPod
from hermit_node.control.ports import StoreResolver

log = logging.getLogger("hermit_node")


class Prefetches:
    def __init__(self, kube: Kube, stores: StoreResolver | None, jobs: Jobs, *,
                 on: bool, halted: Callable[[], bool]) -> None:
        self._kube = kube
        self._stores = stores
        self._jobs = jobs
        self._on = on and stores is not None
        self._halted = halted  # a notice came or the agent stops
        self._lock = threading.Lock()
        # By pod uid: the event that stops one. An entry stays while its pod waits, so each
        # pod gets one.
        self._prefetches: dict[str, threading.Event] = {}

    def start(self, pods: list[SandboxPod], known: list[KubeObject] | None) -> None:
        """A prefetch job (low priority) for each pod waiting for a checkpoint in flight,
        once per pod. A prefetch goes on while its pod still waits for its restore: the
        restore starts only once the pod runs, seconds after the checkpoint is durable, and
        a prefetch's first second can go to its credentials and manifest. It is stopped
        when the restore starts, the pod is gone, or a notice came here."""
        on = self._on and not self._halted()
        waiting = {sp.uid: sp for sp in planner.pods_to_prefetch(pods, known)} if on else {}
        unrestored = {sp.uid for sp in pods if sp.restore_from and sp.restore_phase is None} \
            if on else set()
        with self._lock:
            for uid in [u for u in self._prefetches if u not in waiting.keys() | unrestored]:
                self._prefetches.pop(uid).set()
            new = [(sp, self._prefetches.setdefault(uid, threading.Event()))
                   for uid, sp in waiting.items() if uid not in self._prefetches]
        for sp, stop in new:
            self._jobs.submit((sp.namespace, f"{sp.pod}/prefetch"),
                              functools.partial(self.run, sp, stop),
                              priority=PRIORITY_PREFETCH)

    def stop(self, uid: str) -> None:
        with self._lock:
            stop = self._prefetches.pop(uid, None)
        if stop is not None:
            stop.set()

    def run(self, sp: SandboxPod, stop: threading.Event) -> None:
        """Fills the chunk cache from the sandbox's newest Completed checkpoint
        (``planner.prefetch_source``) while its pod waits; never fails anything."""
        if stop.is_set() or self._stores is None:
            return
        began, tally = time.monotonic(), CacheTally()
        try:
            source = planner.prefetch_source(
                self._kube.list_sandbox_checkpoints(sp.namespace, sp.sandbox), sp)
            owner = None if source is None else self._kube.get_sandbox(sp.namespace, sp.sandbox)
            if source is None or owner is None:
                log.info("prefetch for pod %s/%s: no earlier Completed checkpoint", sp.namespace,
                         sp.pod)
                return
            with background.lowest_priority():  # never at the cost of the node's real work
                self._stores.for_checkpoint(dict(source.ckpt), owner).prefetch(
                    source.pin.with_uid(sp.sandbox_uid), stop=stop, tally=tally)
            log.info("prefetched %d bytes of checkpoint %s/%s for pod %s in %.1f s%s",
                     tally.stored_bytes, sp.namespace, source.pin.checkpoint, sp.pod,
                     time.monotonic() - began, " (stopped)" if stop.is_set() else "")
        except Exception as exc:  # anything: a prefetch is only an optimisation
            log.warning("prefetch for pod %s/%s stopped: %s", sp.namespace, sp.pod, exc)
        finally:
            metrics.record_prefetch(tally.stored_bytes)
