"""Protobuf records as CRIU writes them in pagemap images (varints and messages)."""

from __future__ import annotations


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def pb_msg(*fields: tuple[int, int]) -> bytes:
    return b"".join(varint(num << 3) + varint(value) for num, value in fields)
