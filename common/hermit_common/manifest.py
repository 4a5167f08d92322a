"""The checkpoint manifest: what a checkpoint contains and which sandbox it belongs to.

A manifest is canonical JSON (sorted keys, no whitespace, ASCII only), so the
same checkpoint always serializes to the same bytes and ``digest()`` is stable.
Parsing is strict: manifests come from S3 and are untrusted; anything
unexpected raises ``ManifestError`` (a ``CheckpointRefused``) with one line.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from hermit_common import bounded
from hermit_common.errors import CheckpointRefused
from hermit_common.tree import KIND_FILE, Entry, ManifestError, check_entries

FORMAT_VERSION: Final = 1
MAX_MANIFEST_BYTES: Final = bounded.MANIFEST_MAX_BYTES  # measured: bounded.py
MAX_CHUNK_SIZE: Final = 256 * 1024 * 1024
_SECTION_RE: Final = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,62}$")

__all__ = ["FORMAT_VERSION", "Binding", "Manifest", "ManifestError", "Totals",
           "check_section_name", "digest_bytes", "utc_now"]


def check_section_name(name: object) -> str:
    """Returns ``name`` if it is a valid section name (one safe path component)."""
    if not isinstance(name, str) or not _SECTION_RE.match(name):
        raise ManifestError(f"section name {name!r:.80} is invalid (use [A-Za-z0-9._-])")
    return name


def utc_now() -> str:
    """The current time as RFC 3339 UTC with a Z, as manifests record it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _obj(data: object, what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ManifestError(f"manifest {what} is not an object")
    return data


def _fields(data: Mapping[str, Any], what: str, required: set[str],
            optional: frozenset[str] = frozenset()) -> None:
    missing = sorted(required - set(data))
    if missing:
        raise ManifestError(f"manifest {what} is missing fields {missing}")
    unknown = sorted(set(data) - required - optional)
    if unknown:
        raise ManifestError(f"manifest {what} has unexpected fields {unknown}")


def _str(data: Mapping[str, Any], key: str, what: str) -> str:
    value = data[key]
    if not isinstance(value, str) or value == "":
        raise ManifestError(f"manifest {what}.{key} is not a non-empty string")
    return value


def _int(data: Mapping[str, Any], key: str, what: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ManifestError(f"manifest {what}.{key} is not a non-negative integer")
    return value


@dataclass(frozen=True)
class Binding:
    """Ties a checkpoint to its sandbox and to what restoring it requires."""

    namespace: str
    sandbox: str
    sandbox_uid: str
    checkpoint: str
    criu_version: str
    kernel: str
    cpu_flags: tuple[str, ...] = ()
    image_digest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace, "sandbox": self.sandbox,
            "sandbox_uid": self.sandbox_uid, "checkpoint": self.checkpoint,
            "criu_version": self.criu_version, "kernel": self.kernel,
            "cpu_flags": list(self.cpu_flags), "image_digest": self.image_digest,
        }

    @classmethod
    def from_dict(cls, data: object) -> Binding:
        d = _obj(data, "binding")
        names = {"namespace", "sandbox", "sandbox_uid", "checkpoint", "criu_version",
                 "kernel", "cpu_flags", "image_digest"}
        _fields(d, "binding", names)
        flags = d["cpu_flags"]
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            raise ManifestError("manifest binding.cpu_flags is not a list of strings")
        image = d["image_digest"]
        if image is not None and not isinstance(image, str):
            raise ManifestError("manifest binding.image_digest is not a string or null")
        return cls(
            namespace=_str(d, "namespace", "binding"), sandbox=_str(d, "sandbox", "binding"),
            sandbox_uid=_str(d, "sandbox_uid", "binding"),
            checkpoint=_str(d, "checkpoint", "binding"),
            criu_version=_str(d, "criu_version", "binding"), kernel=_str(d, "kernel", "binding"),
            cpu_flags=tuple(flags), image_digest=image,
        )


@dataclass(frozen=True)
class Totals:
    """Sizes of a checkpoint: raw bytes of all files, chunk references, compressed bytes."""

    files: int = 0
    image_bytes: int = 0
    chunks: int = 0  # chunk references, counting repeats
    unique_chunks: int = 0
    stored_bytes: int = 0  # compressed size of the distinct chunks referenced

    def to_dict(self) -> dict[str, int]:
        return {"files": self.files, "image_bytes": self.image_bytes, "chunks": self.chunks,
                "unique_chunks": self.unique_chunks, "stored_bytes": self.stored_bytes}

    @classmethod
    def from_dict(cls, data: object) -> Totals:
        d = _obj(data, "totals")
        names = {"files", "image_bytes", "chunks", "unique_chunks", "stored_bytes"}
        _fields(d, "totals", names)
        return cls(**{n: _int(d, n, "totals") for n in names})


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: its binding, every file of every section, restore data."""

    binding: Binding
    created_at: str
    chunk_size: int
    sections: Mapping[str, tuple[Entry, ...]]
    restore: Mapping[str, Any]
    totals: Totals
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise ManifestError(
                f"manifest chunk_size {self.chunk_size} is not in 1..{MAX_CHUNK_SIZE}")
        for name, entries in self.sections.items():
            check_section_name(name)
            check_entries(entries, self.chunk_size, name)
        try:
            json.dumps(self.restore, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ManifestError(f"manifest restore data is not plain JSON: {exc}") from None

    def files(self) -> list[tuple[str, Entry]]:
        """Every regular file as (section, entry)."""
        return [(s, e) for s, entries in self.sections.items() for e in entries
                if e.kind == KIND_FILE]

    def chunk_digests(self) -> set[str]:
        """The distinct chunk digests the manifest references."""
        return {d for _, e in self.files() for d in e.chunks}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "binding": self.binding.to_dict(),
            "created_at": self.created_at,
            "chunk_size": self.chunk_size,
            "sections": {name: [e.to_dict() for e in entries]
                         for name, entries in self.sections.items()},
            "restore": dict(self.restore),
            "totals": self.totals.to_dict(),
        }

    def to_json(self) -> bytes:
        """Canonical bytes: sorted keys, compact, ASCII (non-UTF-8 names stay escaped)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=True, allow_nan=False).encode("ascii")

    def digest(self) -> str:
        """``sha256:<hex>`` of ``to_json()``."""
        return digest_bytes(self.to_json())

    @classmethod
    def from_dict(cls, data: object) -> Manifest:
        d = _obj(data, "document")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise ManifestError(
                f"manifest format_version {version!r} is not supported (expected {FORMAT_VERSION})")
        _fields(d, "document", {"format_version", "binding", "created_at", "chunk_size",
                                "sections", "restore", "totals"})
        raw_sections = _obj(d["sections"], "sections")
        sections: dict[str, tuple[Entry, ...]] = {}
        for name, raw_entries in raw_sections.items():
            check_section_name(name)
            if not isinstance(raw_entries, list):
                raise ManifestError(f"manifest section {name!r} is not a list")
            sections[name] = tuple(Entry.from_dict(e) for e in raw_entries)
        restore = _obj(d["restore"], "restore")
        chunk_size = _int(d, "chunk_size", "document")
        return cls(
            binding=Binding.from_dict(d["binding"]),
            created_at=_str(d, "created_at", "document"),
            chunk_size=chunk_size,
            sections=sections,
            restore=dict(restore),
            totals=Totals.from_dict(d["totals"]),
            format_version=FORMAT_VERSION,
        )

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parses manifest bytes strictly, within bounded.MANIFEST_MAX_BYTES and its bound
        on JSON containers; raises ManifestError with one line."""
        try:
            data = bounded.load_json(raw, limit=MAX_MANIFEST_BYTES, what="manifest",
                                     parse_constant=_reject_constant)
        except CheckpointRefused as exc:
            raise ManifestError(str(exc)) from None
        return cls.from_dict(data)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def digest_bytes(raw: bytes) -> str:
    """``sha256:<hex>`` of ``raw``: the digest format used for manifests."""
    return "sha256:" + hashlib.sha256(raw).hexdigest()
