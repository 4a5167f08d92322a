"""A node-local cache of chunk objects, as fetched from S3 (docs/storage.md, "Prefetch and
the chunk cache").

An entry is the stored object of one chunk, byte for byte (compressed and, in a sealed
store, sealed), filed under a name derived from where it lives in the store (endpoint,
bucket and object key). The cache is an optimisation only: whoever reads an entry verifies
it exactly as a download from S3 is verified (``store.download``), and drops an entry
that fails (``discard``). Entries are written atomically (a temporary file, then a
rename); temporary files left by an earlier run are deleted when the cache opens. The
total size is bounded: the least recently used entries go first.

Fetches through the cache are single-flight: the first thread to ``claim`` an entry name
fetches the object and then, whatever happened, gives the name up (``release``); a thread
that claims it meanwhile gets an event to ``await_fetch`` on, then reads the entry from
the cache and verifies it itself. Nothing but the cache entry passes between threads.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

_TMP_PREFIX: Final = ".tmp-"
# How often a thread waiting for another's fetch looks at its own stop event.
_STOP_POLL_SECONDS: Final = 0.2


def entry_name(location: str, key: str) -> str:
    """The file name of the object ``key`` of the store at ``location`` (endpoint and
    bucket): a sha256, so any key maps to one safe, fixed-length name."""
    return hashlib.sha256(f"{location}\n{key}".encode()).hexdigest()


@dataclass
class CacheTally:
    """Chunks one download (or prefetch) found in the cache or fetched; thread-safe."""

    hits: int = 0
    misses: int = 0
    stored_bytes: int = 0  # bytes of objects put into the cache
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def hit(self) -> None:
        with self._lock:
            self.hits += 1

    def miss(self) -> None:
        with self._lock:
            self.misses += 1

    def stored(self, size: int) -> None:
        with self._lock:
            self.stored_bytes += size

    @property
    def chunks(self) -> int:
        return self.hits + self.misses


class ChunkCache:
    """Chunk objects under ``root``, at most ``max_bytes`` of them (least recently used
    evicted first). Thread-safe within one process; one process per directory."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("a chunk cache needs a positive size")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()  # name -> size, oldest first
        self._bytes = 0
        self._seq = 0
        self._fetching: dict[str, threading.Event] = {}  # name -> set when its fetch ends
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._load()

    def _load(self) -> None:
        """Index what an earlier run left (least recently used first, by mtime: a hit
        touches its file); partial files go."""
        found: list[tuple[int, str, int]] = []
        for item in os.scandir(self.root):
            try:
                if item.name.startswith(_TMP_PREFIX) or not item.is_file(follow_symlinks=False):
                    _unlink(item.path)
                    continue
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            found.append((st.st_mtime_ns, item.name, st.st_size))
        for _, name, size in sorted(found):
            self._entries[name] = size
            self._bytes += size
        with self._lock:
            self._evict_locked(0)

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    def get(self, name: str) -> bytes | None:
        """The entry's bytes (now the most recently used), or None."""
        with self._lock:
            if name not in self._entries:
                return None
            self._entries.move_to_end(name)
        path = self.root / name
        try:
            data = path.read_bytes()
            os.utime(path)
        except OSError:
            self.discard(name)  # evicted meanwhile, or unreadable
            return None
        return data

    def put(self, name: str, data: bytes) -> bool:
        """Stores ``data`` as entry ``name`` (replacing one), evicting the least recently
        used to make room; False when it does not fit or cannot be written (a cache may
        always refuse)."""
        size = len(data)
        if size > self.max_bytes:
            return False
        with self._lock:
            self._seq += 1
            tmp = self.root / f"{_TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{self._seq}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                done = 0
                while done < size:
                    done += os.write(fd, view[done:])
            finally:
                os.close(fd)
            with self._lock:
                self._evict_locked(size, keep=name)
                os.replace(tmp, self.root / name)
                self._bytes += size - self._entries.pop(name, 0)
                self._entries[name] = size
        except OSError as exc:
            _unlink(str(tmp))
            log.warning("chunk cache: cannot store an entry under %s: %s", self.root, exc)
            return False
        return True

    def claim(self, name: str) -> threading.Event | None:
        """None: the caller now fetches entry ``name`` and must ``release`` it (in a
        ``finally``). Otherwise another thread is fetching it: the event is set when that
        fetch ends (stored or not), and the caller then reads the entry with ``get``."""
        with self._lock:
            pending = self._fetching.get(name)
            if pending is None:
                self._fetching[name] = threading.Event()
            return pending

    def release(self, name: str) -> None:
        """Ends the caller's claim on ``name``, waking the threads waiting for it."""
        with self._lock:
            pending = self._fetching.pop(name, None)
        if pending is not None:
            pending.set()

    @staticmethod
    def await_fetch(pending: threading.Event, timeout: float,
                    stop: threading.Event | None = None) -> bool:
        """Waits for a claimed fetch to end, at most ``timeout`` seconds and no longer
        than ``stop`` stays clear; True when it ended."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return pending.is_set()
            if pending.wait(min(left, _STOP_POLL_SECONDS)):
                return True

    def discard(self, name: str) -> None:
        """Forgets and deletes entry ``name`` (e.g. one that failed verification)."""
        with self._lock:
            size = self._entries.pop(name, None)
            if size is not None:
                self._bytes -= size
            _unlink(str(self.root / name))

    def _evict_locked(self, incoming: int, keep: str | None = None) -> None:
        """Deletes least recently used entries until ``incoming`` more bytes fit."""
        replaced = self._entries.get(keep, 0) if keep is not None else 0
        while self._entries and self._bytes - replaced + incoming > self.max_bytes:
            oldest = next(iter(self._entries))
            if oldest == keep:
                self._entries.move_to_end(oldest)
                if len(self._entries) == 1:
                    break
                continue
            self._bytes -= self._entries.pop(oldest)
            _unlink(str(self.root / oldest))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("chunk cache: cannot delete %s: %s", path, exc)
