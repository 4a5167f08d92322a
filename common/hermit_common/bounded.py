"""Limits on untrusted bytes from the bucket, and the one JSON parser for them.

Anyone who can write to the bucket can plant any object where a manifest or a key
record is read; the node-agent is privileged and reads them on every restore and
garbage-collection pass. So every kind of object has a named size limit, checked on the
object's ContentLength before its body is read and again on what is read (never more than
limit + 1 bytes), and ``load_json`` parses within that limit and a bound on the number of
JSON containers (what makes parsing cost memory), turning a nesting bomb (RecursionError)
into a refusal. docs/storage.md#bounded-parsing has the figures.

Measured (``/usr`` of the CI image scanned as a sandbox, 153 857 entries of which
130 918 files, plus a 16 GiB pages image): a plain manifest of 33.1 MiB (226 bytes per
entry) that ``Manifest.from_json`` parses with a 147 MiB peak (4.4x its bytes). The
limit, 64 MiB, leaves twice that (about 300 000 entries); a checkpoint whose manifest
would be larger fails at upload, so no manifest is written that could not be read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from hermit_common.errors import CheckpointRefused

MIB: Final = 1024 * 1024
# A plain manifest's JSON (manifest.Manifest.to_json / from_json).
MANIFEST_MAX_BYTES: Final = 64 * MIB
# What a manifest object in the bucket may hold: a sealed one is the manifest encrypted
# (16 bytes of tag), in base64 (4/3), in an envelope of a few hundred bytes plus a lineage
# of up to 64 uids: 64 KiB covers the envelope with room.
ENVELOPE_OVERHEAD_BYTES: Final = 64 * 1024
STORED_MANIFEST_MAX_BYTES: Final = 4 * ((MANIFEST_MAX_BYTES + 16 + 2) // 3) \
    + ENVELOPE_OVERHEAD_BYTES
# A sandbox's key record (keys/<uid>): a wrapped key, a lineage of up to 64 uids of up to
# 253 characters, a source name: under 20 KiB.
KEY_RECORD_MAX_BYTES: Final = 64 * 1024
# A sealed envelope has 2 objects and a lineage list; a plain manifest about one object
# or list per 60 bytes (a directory entry is ~85 bytes, a file ~110 with its chunk list;
# /usr: one per 122 bytes). ``[{},{},...]`` would make one per 3 bytes, ~24x its size in
# memory: a bound on containers per byte keeps the parse near a real manifest's cost.
ENVELOPE_MAX_CONTAINERS: Final = 16
BYTES_PER_CONTAINER: Final = 32
MIN_CONTAINERS: Final = 256


class TooLarge(CheckpointRefused):
    """An object (or document) larger than the limit for its kind: refused unread."""


def check_size(raw: bytes, limit: int, what: str) -> None:
    """TooLarge when ``raw`` is larger than ``limit``."""
    if len(raw) > limit:
        raise TooLarge(f"{what} is larger than the limit of {limit} bytes "
                       f"({len(raw)} bytes)")


def containers_allowed(size: int) -> int:
    """How many JSON objects and arrays a document of ``size`` bytes may have."""
    return MIN_CONTAINERS + size // BYTES_PER_CONTAINER


def load_json(raw: bytes, *, limit: int, what: str, max_containers: int | None = None,
              parse_constant: Callable[[str], Any] | None = None) -> Any:
    """``json.loads`` of untrusted ``raw``: at most ``limit`` bytes and ``max_containers``
    objects and arrays (default: ``containers_allowed``); CheckpointRefused otherwise,
    and for what is not JSON (including a nesting too deep to parse)."""
    check_size(raw, limit, what)
    allowed = containers_allowed(len(raw)) if max_containers is None else max_containers
    # Counting brackets over-counts those inside strings: harmless, real documents are far
    # below the bound. bytes.count is a C loop: a 64 MiB document is counted in ~30 ms.
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > allowed:
        raise CheckpointRefused(f"{what} has {containers} JSON objects and arrays for its "
                                f"{len(raw)} bytes (at most {allowed}): refused unparsed")
    try:
        if parse_constant is None:
            return json.loads(raw)
        return json.loads(raw, parse_constant=parse_constant)
    except RecursionError:
        raise CheckpointRefused(f"{what} is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointRefused(f"{what} is not valid JSON: {exc}") from None
