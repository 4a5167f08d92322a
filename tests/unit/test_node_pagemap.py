"""pagemap: reading CRIU pagemap images and cutting page images at aligned memory."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from hermit_node.host.pagemap import (
    PAGE_SIZE,
    PAGEMAP_MAGIC,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    PagemapError,
    chunk_lengths,
    image_layout,
    parse_pagemap,
)
from hermit_node.host.protowire import IMG_COMMON_MAGIC
from tests.support.pagemap import pb_msg

P = PAGE_SIZE
MIB4 = 4 << 20


def _image(pages_id: int, *entries: bytes) -> bytes:
    body = [pb_msg((1, pages_id)), *entries]
    return struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + b"".join(
        struct.pack("<I", len(m)) + m for m in body)


def test_parse_keeps_the_pages_the_image_holds() -> None:
    raw = _image(
        7,
        pb_msg((1, 0x400000), (2, 3), (4, PE_PRESENT)),
        pb_msg((1, 0x500000), (2, 2), (4, PE_PARENT)),  # in a parent image
        pb_msg((1, 0x600000), (2, 1), (4, PE_LAZY)),  # lazy, not here
        pb_msg((1, 0x700000), (2, 1)),  # old images: no flags, not in_parent
        pb_msg((1, 0x800000), (2, 1), (3, 1)),  # old images: in_parent
        pb_msg((1, 0x900000), (2, 0), (4, PE_PRESENT), (5, 4)),  # CRIU >= 3.17: nr_pages = 5
    )
    assert parse_pagemap(raw) == (7, [(0x400000, 3 * P), (0x700000, P), (0x900000, 4 * P)])


@pytest.mark.parametrize("raw", [b"", b"\x00" * 8, _image(1)[:-1],
                                 _image(1, pb_msg((1, 0x1000)))])
def test_unreadable_images_are_refused(raw: bytes) -> None:
    with pytest.raises(PagemapError):
        parse_pagemap(raw)


def test_cuts_at_aligned_addresses_inside_runs() -> None:
    # 1 page, then a run from 2 pages before a 4 MiB boundary through 4 MiB + 1 page
    runs = [(0x1000, P), (MIB4 - 2 * P, 2 * P + MIB4 + P)]
    assert chunk_lengths(runs, MIB4) == [3 * P, MIB4, P]


def test_the_same_region_makes_the_same_chunks_wherever_it_sits_in_the_image() -> None:
    region = (0x7F0000000000, 3 * MIB4)  # an aligned 12 MiB block
    parent = chunk_lengths([(0x1000, 5 * P), region, (0x7FFF00000000, 2 * P)], MIB4)
    child = chunk_lengths([(0x2000, 9 * P), region], MIB4)
    assert parent == [5 * P, MIB4, MIB4, MIB4, 2 * P]
    assert child == [9 * P, MIB4, MIB4, MIB4]


def test_no_chunk_grows_past_the_chunk_size() -> None:
    runs = [(i * MIB4 + MIB4 // 2, MIB4 // 4) for i in range(10)]  # never crosses a boundary
    lengths = chunk_lengths(runs, MIB4)
    assert max(lengths) <= MIB4 and sum(lengths) == 10 * MIB4 // 4
    assert chunk_lengths([], MIB4) == []


def test_image_layout_reads_the_dump_and_skips_what_does_not_add_up(tmp_path: Path) -> None:
    (tmp_path / "pagemap-1.img").write_bytes(
        _image(1, pb_msg((1, MIB4 - P), (2, 2 + 1024), (4, PE_PRESENT))))
    (tmp_path / "pages-1.img").write_bytes(b"\0" * (P * (2 + 1024)))
    (tmp_path / "pagemap-2.img").write_bytes(_image(2, pb_msg((1, 0), (2, 2), (4, PE_PRESENT))))
    (tmp_path / "pages-2.img").write_bytes(b"\0" * P)  # shorter than its pagemap says
    (tmp_path / "pagemap-3.img").write_bytes(b"junk")
    assert image_layout(tmp_path, MIB4) == {"pages-1.img": (P, MIB4, P)}
    assert image_layout(tmp_path / "missing", MIB4) == {}
