"""The node-agent's local copy of the objects it acts on, kept current by watches.

Instead of listing every Checkpoint in the cluster every loop, the node-agent lists
once and then watches, each restricted to its node: the pods bound to it (field selector
``spec.nodeName``), the Checkpoints labelled with it (``hermit.dev/node``) and its Node
object. An ``Informer`` per kind runs in a thread:

- list (the API's answer carries a resourceVersion), then watch from that
  resourceVersion, asking for bookmarks so the resourceVersion stays recent;
- a watch that ends (its server-side timeout) is reopened from the last
  resourceVersion; ``410 Gone`` (the resourceVersion is too old) lists again;
- any other failure waits with a capped exponential backoff (``backoff_seconds``)
  and lists again (a node's objects are few);
- every ``RELIST_SECONDS`` it lists again anyway: a safety net that drops objects whose
  DELETED event was missed.

Every change calls ``on_change`` (the agent's loop wakes at once). ``apply_event``,
``backoff_seconds`` and ``relist_due`` are pure; the thread only applies them.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from hermit_common import protocol
from hermit_common.kubeapi import KubeApiError, KubeTransient
from hermit_common.protocol import KubeObject

log = logging.getLogger("hermit_node")


GONE: Final = 410
# The API server ends a watch after this long (plus up to a quarter more, to spread the
# reconnections of many nodes); it is then reopened from the last resourceVersion.
WATCH_SECONDS: Final = 240
# A full list this often, whatever the watch says: objects whose DELETED event was lost.
RELIST_SECONDS: Final = 600.0
BACKOFF_FIRST_SECONDS: Final = 0.5
BACKOFF_MAX_SECONDS: Final = 30.0


class ListWatch(Protocol):
    """One kind of object, restricted by selectors (``control.kube.Kube`` builds them)."""

    what: str  # "pods on node spot-1", for messages

    def list(self) -> tuple[list[KubeObject], str]:
        """Every object and the list's resourceVersion; KubeApiError on failure."""
        ...

    def watch(self, resource_version: str, timeout_seconds: int
              ) -> Iterator[tuple[str, KubeObject]]:
        """(event type, object) from ``resource_version`` on, for at most
        ``timeout_seconds``; KubeApiError on failure (status 410: too old)."""
        ...


def key_of(obj: Mapping[str, Any]) -> str:
    """Objects are kept by namespace/name (a Node has no namespace)."""
    meta = protocol.meta(obj)
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


@dataclass
class Store:
    """The objects as last seen and the resourceVersion to watch from."""

    objects: dict[str, KubeObject] = field(default_factory=dict)
    resource_version: str | None = None

    def replace(self, items: Iterable[KubeObject], resource_version: str) -> None:
        self.objects = {key_of(o): o for o in items}
        self.resource_version = resource_version


def apply_event(store: Store, kind: str, obj: KubeObject) -> bool:
    """Apply one watch event to ``store``; True when an object changed. ``ERROR`` events
    are the caller's (the watch raises them as KubeApiError)."""
    version = protocol.meta(obj).get("resourceVersion")
    if version:
        store.resource_version = str(version)
    if kind == "BOOKMARK":
        return False
    key = key_of(obj)
    if kind == "DELETED":
        return store.objects.pop(key, None) is not None
    if kind in ("ADDED", "MODIFIED"):
        store.objects[key] = obj
        return True
    return False


def backoff_seconds(failures: int, jitter: float = 1.0) -> float:
    """The wait after the ``failures``-th failure in a row: 0.5 s doubling to 30 s, times
    ``jitter`` (0.5-1.0 from the caller: many nodes do not come back in step)."""
    exponent = min(max(failures, 1) - 1, 16)
    return float(min(BACKOFF_FIRST_SECONDS * 2 ** exponent, BACKOFF_MAX_SECONDS) * jitter)


def relist_due(listed_at: float | None, now: float, every: float = RELIST_SECONDS) -> bool:
    """Whether to list again now: never listed, or the last list is ``every`` seconds old."""
    return listed_at is None or now - listed_at >= every


class Informer:
    """A thread that keeps a ``Store`` of one ``ListWatch`` current (see the module)."""

    def __init__(self, source: ListWatch, on_change: Callable[[], None],
                 stop: threading.Event, *, relist_seconds: float = RELIST_SECONDS,
                 watch_seconds: int = WATCH_SECONDS) -> None:
        self._source = source
        self._on_change = on_change
        self._stop = stop
        self._relist_seconds = relist_seconds
        self._watch_seconds = watch_seconds
        self._store = Store()
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._listed_at: float | None = None
        self._failures = 0  # in a row; 0 while the watch is open and well
        self._thread = threading.Thread(target=self._run, name=f"watch {source.what}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    @property
    def healthy(self) -> bool:
        """Listed, and the last list or watch did not fail (a watch that hangs fails at
        its read timeout)."""
        return self._synced.is_set() and self._failures == 0

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def snapshot(self) -> list[KubeObject]:
        """The objects as last seen; KubeTransient before the first list."""
        if not self._synced.is_set():
            raise KubeTransient(f"watching {self._source.what}: not listed yet")
        with self._lock:
            return list(self._store.objects.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
                continue
            except KubeApiError as exc:
                # Whatever went wrong, list again next: a node's objects are few, and the
                # list says at once whether the API answers again.
                self._listed_at = None
                if exc.status == GONE:
                    log.info("watching %s: %s; listing again", self._source.what, exc.detail)
                    continue
                self._failures += 1
                delay = backoff_seconds(self._failures, random.uniform(0.5, 1.0))
                log.warning("watching %s: %s; again in %.1f s", self._source.what, exc, delay)
                self._stop.wait(delay)
            except Exception:  # a bug must not end the thread: the agent would go blind
                self._listed_at = None
                self._failures += 1
                log.exception("watching %s", self._source.what)
                self._stop.wait(backoff_seconds(self._failures))

    def step(self) -> None:
        """List when due, then watch until the server ends the watch."""
        if relist_due(self._listed_at, time.monotonic(), self._relist_seconds):
            items, version = self._source.list()
            with self._lock:
                self._store.replace(items, version)
            self._listed_at = time.monotonic()
            self._failures = 0
            self._synced.set()
            self._on_change()
        version = self._store.resource_version or ""
        left = self._relist_seconds - (time.monotonic() - (self._listed_at or 0.0))
        timeout = max(1, min(int(left) + 1, int(self._watch_seconds * random.uniform(1, 1.25))))
        for kind, obj in self._source.watch(version, timeout):
            with self._lock:
                changed = apply_event(self._store, kind, obj)
            if changed:
                self._on_change()
            if self._stop.is_set():
                return


class NodeSources(Protocol):
    """What ``WatchedNode`` watches (``hermit_node.control.kube.Kube``)."""

    def node_pods(self) -> ListWatch: ...

    def node_checkpoints(self) -> ListWatch: ...

    def this_node(self) -> ListWatch: ...


class WatchedNode:
    """The pods bound to one node, the Checkpoints labelled with it and its Node object,
    each kept by an ``Informer``: ``hermit_node.control.ports.NodeView``."""

    def __init__(self, kube: NodeSources, stop: threading.Event) -> None:
        self._changed = threading.Event()
        self._pods = Informer(kube.node_pods(), self._changed.set, stop)
        self._checkpoints = Informer(kube.node_checkpoints(), self._changed.set, stop)
        self._node = Informer(kube.this_node(), self._changed.set, stop)
        self._all = (self._pods, self._checkpoints, self._node)

    def start(self, sync_timeout: float = 30.0) -> None:
        """Start the watches; wait (at most ``sync_timeout``) for their first lists."""
        for informer in self._all:
            informer.start()
        deadline = time.monotonic() + sync_timeout
        for informer in self._all:
            informer.wait_synced(max(0.0, deadline - time.monotonic()))

    def pods_now(self) -> list[KubeObject]:
        return self._pods.snapshot()

    def checkpoints_now(self) -> list[KubeObject]:
        return self._checkpoints.snapshot()

    def node_now(self) -> KubeObject | None:
        nodes = self._node.snapshot()
        return nodes[0] if nodes else None

    def healthy(self) -> bool:
        """Every watch is open and well: the API server answers."""
        return all(i.healthy for i in self._all)

    def wait_for_change(self, timeout: float) -> None:
        """Until an object changed (or ``timeout``)."""
        self._changed.wait(timeout)
        self._changed.clear()
