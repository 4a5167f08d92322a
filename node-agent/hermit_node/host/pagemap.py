"""Where to cut CRIU's page images into chunks so memory shared by two processes is stored once.

CRIU writes each process's memory as ``pagemap-<pid>.img`` (which virtual pages, in
address order) plus ``pages-<id>.img`` (the pages' bytes, back to back). A child
shares its parent's private anonymous memory copy-on-write after ``fork``, and CRIU
dumps those pages once per process (it deduplicates only against a pre-dump's parent
images; the restore maps them shared again after comparing contents). The store's
chunks are content-addressed, but fixed-size chunks of two page images line up only
by luck: the same region sits at a different offset in each file.

So a page image is cut where the memory it holds crosses a ``chunk_size``-aligned
virtual address: a window of memory that the pagemap covers entirely becomes one
chunk with the same bytes in the parent's and the child's image, stored (and, within
one upload, compressed and sent) once. Between those cuts no chunk grows past
``chunk_size``. The cut lengths go into the manifest (``Entry.chunk_lengths``); any
image this module cannot read, or whose pagemap does not account for its size
exactly, keeps fixed-size chunks (only deduplication is lost, never correctness).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

from hermit_common.errors import Permanent
from hermit_node.host import protowire

PAGEMAP_MAGIC: Final = 0x56084025
PAGE_SIZE: Final = 4096
# pagemap_entry.flags
PE_PARENT: Final = 1 << 0
PE_LAZY: Final = 1 << 1
PE_PRESENT: Final = 1 << 2
# The largest pagemap image read (the dump side keeps fixed-size chunks past it; a
# restore refuses the checkpoint). An entry is about 18 bytes per run of pages present
# back to back, so this is 3.7 million runs: a process would need that many separate
# islands of touched memory (the kernel's default max_map_count is 65530 mappings).
MAX_PAGEMAP_BYTES: Final = 64 << 20
_PAGEMAP_RE: Final = re.compile(r"^pagemap-[A-Za-z0-9_-]+\.img$")

Run = tuple[int, int]  # (virtual address, bytes) of pages held back to back in pages-*.img


class PagemapError(Permanent, ValueError):
    """A pagemap image this module cannot read (the caller keeps fixed-size chunks).
    Permanent: the same bytes never parse; still a ValueError for the callers that catch it."""


def _fields(message: bytes) -> dict[int, int]:
    try:
        return protowire.varint_fields(message)
    except protowire.WireError as exc:
        raise PagemapError(str(exc)) from None


def _messages(raw: bytes, partial: bool) -> Iterator[bytes]:
    try:
        yield from protowire.entries(raw, PAGEMAP_MAGIC, "pagemap", partial=partial)
    except protowire.WireError as exc:
        raise PagemapError(str(exc)) from None


def parse_pagemap(raw: bytes, *, partial: bool = False) -> tuple[int, list[Run]]:
    """The pages image id of a pagemap image and the runs of pages that image holds.
    ``partial``: the image is still being written (its complete entries are read).

    pagemap_head: pages_id = 1. pagemap_entry: vaddr = 1, compat_nr_pages = 2 (the page
    count of images before CRIU 3.17; 0 since), in_parent = 3, flags = 4, nr_pages = 5;
    an entry's pages are in the pages image when it is present and not in a parent
    image (images without flags: when not in_parent).
    """
    messages = _messages(raw, partial)
    head = _fields(next(messages, b""))
    if 1 not in head:
        raise PagemapError("pagemap head has no pages_id")
    runs: list[Run] = []
    for message in messages:
        entry = _fields(message)
        pages = entry.get(5) or entry.get(2)
        if 1 not in entry or pages is None:
            raise PagemapError("pagemap entry without vaddr or nr_pages")
        flags = entry.get(4)
        held = (flags & PE_PRESENT and not flags & PE_PARENT) if flags is not None \
            else not entry.get(3, 0)
        if held and pages:
            runs.append((entry[1], pages * PAGE_SIZE))
    return head[1], runs


def pagemap_entries(raw: bytes) -> tuple[int, list[tuple[int, int, int]]]:
    """The pages image id of a complete pagemap image and its entries in file order, as
    (vaddr, nr_pages, flags); flags 0 where the image has none (before CRIU 3.17).
    A lean reader (3 ints an entry) for the restore side, instead of pycriu's dicts."""
    messages = _messages(raw, False)
    head = _fields(next(messages, b""))
    if 1 not in head:
        raise PagemapError("pagemap head has no pages_id")
    entries = []
    for message in messages:
        entry = _fields(message)
        pages = entry.get(5) or entry.get(2)
        if 1 not in entry or pages is None:
            raise PagemapError("pagemap entry without vaddr or nr_pages")
        entries.append((entry[1], pages, entry.get(4, 0)))
    return head[1], entries


def chunk_lengths(runs: Iterable[Run], chunk_size: int) -> list[int]:
    """Cut the bytes of ``runs`` (back to back) at every ``chunk_size``-aligned address
    inside a run and wherever a chunk would grow past ``chunk_size``; the lengths."""
    lengths: list[int] = []
    current = 0
    for vaddr, size in runs:
        address, end = vaddr, vaddr + size
        while address < end:
            boundary = (address // chunk_size + 1) * chunk_size
            if address % chunk_size == 0 and current:
                lengths.append(current)  # an aligned window starts: a chunk of its own
                current = 0
            step = min(end, boundary) - address
            if current + step > chunk_size:
                step = chunk_size - current  # only across runs: cut at the size limit
            current += step
            address += step
            if current == chunk_size:
                lengths.append(current)
                current = 0
    if current:
        lengths.append(current)
    return lengths


def image_layout(images: Path, chunk_size: int) -> dict[str, tuple[int, ...]]:
    """pages image name -> chunk lengths, for every page image of the dump in ``images``
    that its pagemap accounts for exactly (the others keep fixed-size chunks)."""
    layout: dict[str, tuple[int, ...]] = {}
    try:
        names = os.listdir(images)
    except OSError:
        return layout
    for name in names:
        if not _PAGEMAP_RE.match(name):
            continue
        try:
            with open(images / name, "rb") as f:
                raw = f.read(MAX_PAGEMAP_BYTES + 1)
            if len(raw) > MAX_PAGEMAP_BYTES:
                continue
            pages_id, runs = parse_pagemap(raw)
            pages = f"pages-{pages_id}.img"
            size = os.lstat(images / pages).st_size
        except (OSError, PagemapError):
            continue
        lengths = chunk_lengths(runs, chunk_size)
        if lengths and sum(lengths) == size:
            layout[pages] = tuple(lengths)
    return layout
