"""The external tick ledger: every tick of the self-checking workload, as it happens, in
a record kept outside the sandbox and outside every node.

The workload (tests/workloads/stateful.c) with ``HERMIT_LEDGER=<ip>:<port>`` sends one
UDP datagram per tick::

    hermit-ledger v1 tick=<n> prev=<n> first=<n> gen=<n> pid=<n> start=<n> host=<name> errs=<n>

``Collector`` is a small UDP server in the test process that records each one with its
source address and receive time; ``judge`` (pure) decides from that record, over the
whole run, which tick numbers were lost or duplicated. Unlike the pod log (deleted with
the old pod as soon as a stopping checkpoint is durable) and /proc scans (sampled), the
record keeps a tick the old copy made after its checkpoint even if that copy is gone a
moment later.

A copy is one running process image: (source address, start time, pid). The start time
changes with every restore (CRIU creates a new process), the source address is the pod's
IP, and ``host`` is the UTS name, which the operator sets to the sandbox's name (a fork
has its own), so one collector serves many sandboxes.

UDP may drop a datagram (the local cluster dropped seven in a row once, mid-run). So a
copy's reports are read as a span: one process image counts its ticks one by one, so it
made every tick from its first (``first``, which each report repeats from the copy's
memory) to its last report, whether or not each report arrived.
Lost and duplicated are judged on the spans: lost is a tick in no copy's span, duplicated
a tick in two copies' spans (or reported twice by one). A report missing inside a span
is counted (``dropped``) and harmless: it can neither hide a loss nor a duplicate. A
report carries ``prev``, the tick its image reported before, kept in its memory (a
restored copy carries it): a tick some ``prev`` claims but no span covers is a copy's
last report lost in transit, just before a restore (``edge_dropped``). That is where an
old copy's extra tick could hide, so a verdict with one is not clean (``Verdict.clean``):
a drop never turns a loss into a pass, and never a possible duplicate into one either.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise

ENV = "HERMIT_LEDGER"
MAX_DATAGRAM = 512  # a report is < 200 bytes; longer datagrams are refused, not parsed
MAX_RECORDS = 200_000  # about 11 hours of one sandbox at 5 ticks/s; then refused, counted
RECV_BUFFER = 4 << 20  # the kernel's queue for bursts while the recorder thread waits

REPORT = re.compile(
    r"hermit-ledger v1 tick=(\d{1,15}) prev=(\d{1,15}) first=(\d{1,15}) gen=(\d{1,9}) "
    r"pid=(\d{1,9}) "
    r"start=(-?\d{1,20}) host=([A-Za-z0-9.?-]{1,64}) errs=(\d{1,15})\n?")


@dataclass(frozen=True)
class Report:
    """One datagram: what the copy said, where it came from, when it arrived."""

    tick: int
    prev: int
    first: int  # the copy's first tick, from its memory (since its start or restore)
    gen: int
    pid: int
    start: int
    host: str
    errs: int
    source: str  # the sender's IP (the pod's: the local cluster does not masquerade)
    received: float  # time.monotonic() of the collector

    @property
    def copy(self) -> tuple[str, int, int]:
        """The process image that sent it."""
        return (self.source, self.start, self.pid)


def parse(data: bytes, source: str, received: float) -> Report | None:
    """The report in ``data``, or None when it is not one (oversized, malformed)."""
    if len(data) > MAX_DATAGRAM:
        return None
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None
    m = REPORT.fullmatch(text)
    if not m:
        return None
    tick, prev, first, gen, pid, start, host, errs = m.groups()
    return Report(int(tick), int(prev), int(first), int(gen), int(pid), int(start), host,
                  int(errs), source, received)


@dataclass(frozen=True)
class Copy:
    """One process image's reports, in the order they arrived."""

    source: str
    start: int
    pid: int
    gen: int
    first_tick: int
    last_tick: int
    reports: int
    first_seen: float
    last_seen: float
    errs: int = 0  # sends the copy itself saw fail, as of its last report

    def __str__(self) -> str:
        errs = f", {self.errs} send errors" if self.errs else ""
        return (f"{self.source} pid {self.pid} gen {self.gen}: ticks {self.first_tick}.."
                f"{self.last_tick} ({self.reports} reports{errs})")


@dataclass(frozen=True)
class Verdict:
    """Lost and duplicated tick numbers of one sandbox, over the whole record."""

    first: int  # 0: no report
    last: int
    lost: tuple[int, ...]  # between first and last, in no copy's span, claimed by no prev
    duplicated: tuple[int, ...]  # in two copies' spans, or reported twice by one copy
    replayed: tuple[int, ...]  # of the duplicated: redone by a copy that started after the
    #                            one before it had stopped (work lost to a routine checkpoint)
    dropped: int  # reports lost in transit inside a copy's span (harmless)
    copies: tuple[Copy, ...]
    refused: int = 0  # datagrams the collector refused (malformed, oversized, over the cap)
    edge_dropped: int = 0  # a copy's last reports lost before a restore (a prev no span covers)

    @property
    def concurrent(self) -> tuple[int, ...]:
        """Duplicated ticks that are not a replay: two copies at once, or one copy twice."""
        replayed = set(self.replayed)
        return tuple(t for t in self.duplicated if t not in replayed)

    def clean(self, *, allow_replay: bool = False) -> bool:
        """Nothing lost, nothing duplicated (a replay only if allowed), no copy's last
        report dropped and nothing refused (either could hide a duplicate)."""
        dup = self.concurrent if allow_replay else self.duplicated
        return (self.first > 0 and not self.lost and not dup and not self.edge_dropped
                and not self.refused)

    def summary(self) -> str:
        def ranges(ticks: tuple[int, ...]) -> str:
            return _ranges(ticks) or "none"

        return (f"ticks {self.first}..{self.last}: lost {ranges(self.lost)}, duplicated "
                f"{ranges(self.duplicated)} (replayed {ranges(self.replayed)}), "
                f"{self.dropped} dropped in spans, {self.edge_dropped} at a copy's end, "
                f"{self.refused} refused; copies: "
                + "; ".join(str(c) for c in self.copies))


def _ranges(ticks: Iterable[int]) -> str:
    out: list[str] = []
    for t in sorted(ticks):
        if out and out[-1].split("..")[-1] == str(t - 1):
            out[-1] = f"{out[-1].split('..')[0]}..{t}"
        else:
            out.append(str(t))
    return ",".join(out)


def judge(reports: Iterable[Report], refused: int = 0) -> Verdict:
    """Lost, duplicated, replayed and dropped, from every report of one sandbox."""
    rs = sorted(reports, key=lambda r: r.received)
    if not rs:
        return Verdict(0, 0, (), (), (), 0, (), refused)
    copies = _copies(rs)
    made: Counter[int] = Counter()  # how many times each tick was made, by the spans
    for c in copies:
        made.update(range(c.first_tick, c.last_tick + 1))
    per_copy = Counter((r.copy, r.tick) for r in rs)
    made.update(tick for (_, tick), n in per_copy.items() for _ in range(n - 1))
    first, last = min(made), max(made)
    claimed = {r.prev for r in rs if r.prev}
    lost = tuple(t for t in range(first, last + 1) if not made[t] and t not in claimed)
    edge_dropped = sum(1 for t in claimed if first <= t and not made[t])
    dropped = sum(c.last_tick - c.first_tick + 1 for c in copies) - len(
        {(cp, t) for (cp, t) in per_copy})
    duplicated = tuple(sorted(t for t, n in made.items() if n > 1))
    replayed = tuple(t for t in duplicated if _is_replay(t, copies, per_copy))
    return Verdict(first, last, lost, duplicated, replayed, max(0, dropped), copies, refused,
                   edge_dropped)


def _copies(rs: list[Report]) -> tuple[Copy, ...]:
    by: dict[tuple[str, int, int], list[Report]] = {}
    for r in rs:
        by.setdefault(r.copy, []).append(r)
    # a copy's span starts at the first tick it says it made (its first reports may have
    # been dropped), never after its first report that arrived
    return tuple(Copy(k[0], k[1], k[2], v[-1].gen,
                      min(min(r.tick, r.first or r.tick) for r in v),
                      max(r.tick for r in v), len(v), v[0].received, v[-1].received,
                      v[-1].errs) for k, v in by.items())


def _is_replay(tick: int, copies: tuple[Copy, ...],
               per_copy: Counter[tuple[tuple[str, int, int], int]]) -> bool:
    """Every copy whose span holds ``tick`` made it once and started (its first report
    arrived) after every earlier one had sent its last report: the work was redone after
    a copy ended, never by two at once."""
    holders = [c for c in copies if c.first_tick <= tick <= c.last_tick]
    if any(per_copy[((c.source, c.start, c.pid), tick)] > 1 for c in holders):
        return False  # one copy reported it twice
    spans = sorted((c.first_seen, c.last_seen) for c in holders)
    return all(later[0] > earlier[1] for earlier, later in pairwise(spans))


@dataclass
class Collector:
    """A UDP server on ``host`` (port chosen by the kernel) recording reports until
    stopped. Bounded: datagrams longer than MAX_DATAGRAM or past MAX_RECORDS are refused
    and counted, never stored."""

    host: str
    records: list[Report] = field(default_factory=list)
    refused: int = 0
    _sock: socket.socket | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _attributed: list[tuple[str, float, str, str]] = field(default_factory=list)

    @property
    def address(self) -> str:
        """``<ip>:<port>``, the value of HERMIT_LEDGER."""
        assert self._sock is not None, "the collector is not started"
        ip, port = self._sock.getsockname()[:2]
        return f"{ip}:{port}"

    def start(self) -> Collector:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
        sock.bind((self.host, 0))
        sock.settimeout(0.2)  # how soon stop() is noticed
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name="tick-ledger", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data, (source, _port) = self._sock.recvfrom(MAX_DATAGRAM + 1)
            except TimeoutError:
                continue
            except OSError:
                return
            self.add(data, source, time.monotonic())

    def add(self, data: bytes, source: str, received: float) -> None:
        report = parse(data, source, received)
        with self._lock:
            if report is None or len(self.records) >= MAX_RECORDS:
                self.refused += 1
            else:
                self.records.append(report)

    def reports(self, host: str) -> list[Report]:
        """Every report of sandbox ``host`` (its UTS name, or as ``attribute`` says) so far."""
        with self._lock:
            return [r for r in self.records if self._host_of(r) == host]

    def attribute(self, host: str, *, source: str, since: float, reported_as: str) -> None:
        """Reports from ``source`` that arrived from ``since`` (time.monotonic()) on and
        name ``reported_as`` are sandbox ``host``'s: a fork restored from another
        sandbox's checkpoint may keep the hostname the image was dumped with (CRIU
        restores a UTS namespace it dumped), so its pod's IP tells it apart."""
        with self._lock:
            self._attributed.append((source, since, reported_as, host))

    def _host_of(self, r: Report) -> str:
        for source, since, reported_as, host in self._attributed:
            if r.source == source and r.received >= since and r.host == reported_as:
                return host
        return r.host

    def verdict(self, host: str) -> Verdict:
        with self._lock:
            refused = self.refused
        return judge(self.reports(host), refused)

    def last_tick(self, host: str) -> int:
        """The highest tick sandbox ``host`` reported so far (0: none)."""
        return max((r.tick for r in self.reports(host)), default=0)

    def newest_tick(self, host: str) -> int:
        """The last tick reported by sandbox ``host``'s newest copy (the one whose first
        report arrived last; 0: none)."""
        copies = _copies(sorted(self.reports(host), key=lambda r: r.received))
        return copies[-1].last_tick if copies else 0


@contextmanager
def collecting(host: str) -> Iterator[Collector]:
    collector = Collector(host).start()
    try:
        yield collector
    finally:
        collector.stop()


_current: Collector | None = None


def use(collector: Collector | None) -> None:
    """Makes ``collector`` the one the test helpers' sandbox specs report to."""
    global _current
    _current = collector


def current() -> Collector | None:
    return _current
