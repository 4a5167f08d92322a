"""CRIU image entries in protobuf's wire format, read without pycriu: pure and small.

The restore reads a few fields of large images (pagemaps, ``files.img``) of a checkpoint
that is not trusted yet; pycriu would build a dict per entry. These readers keep only
what is asked for and raise ``WireError`` on anything malformed (the caller's size bound
applies before: criu.read_image_bytes).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

IMG_COMMON_MAGIC: Final = 0x54564319


class WireError(ValueError):
    """Bytes that are not the image or message they should be."""


def varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def fields(message: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, varint value or length-delimited bytes) of a protobuf message;
    fixed-size fields are skipped."""
    pos = 0
    while pos < len(message):
        key, pos = varint(message, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = varint(message, pos)
            yield number, value
        elif wire == 2:
            length, pos = varint(message, pos)
            if pos + length > len(message):
                raise WireError("truncated field")
            yield number, message[pos:pos + length]
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise WireError(f"unsupported wire type {wire}")
    if pos != len(message):
        raise WireError("truncated message")


def varint_fields(message: bytes) -> dict[int, int]:
    """The varint fields of a protobuf message (others are skipped): number -> value."""
    return {number: value for number, value in fields(message) if isinstance(value, int)}


def entries(raw: bytes, magic: int, what: str, *, partial: bool = False) -> Iterator[bytes]:
    """The messages of a CRIU protobuf image: two magics, then (u32 size, message)*.
    ``partial``: the image is still being written; a cut-off last entry ends it."""
    if len(raw) < 8 or struct.unpack_from("<II", raw) != (IMG_COMMON_MAGIC, magic):
        raise WireError(f"not a {what} image")
    pos = 8
    while pos < len(raw):
        (size,) = struct.unpack_from("<I", raw, pos) if pos + 4 <= len(raw) else (-1,)
        pos += 4
        if size < 0 or pos + size > len(raw):
            if partial:
                return
            raise WireError("truncated entry")
        yield raw[pos:pos + size]
        pos += size
