"""The content-addressed checkpoint store on S3.

Layout (``prefix`` may be empty)::

    s3://<bucket>/<prefix>/<namespace>/<sandbox>/chunks/<sha256>
    s3://<bucket>/<prefix>/<namespace>/<sandbox>/checkpoints/<checkpoint>/manifest.json
    s3://<bucket>/<prefix>/<namespace>/<sandbox>/keys/<sandbox uid>   (sealed stores)

Files are cut into fixed-size chunks, each named by the sha256 of its
uncompressed bytes and stored zstd-compressed. Chunks are shared by all
checkpoints of a sandbox, so an unchanged chunk is uploaded once. The manifest
is written last: a manifest that exists describes a complete checkpoint.
``download`` verifies the manifest's binding and every chunk's digest before it
returns, so its output can be handed to CRIU.

``collect_garbage`` must not run concurrently with ``upload`` for the same
sandbox (an upload may reuse a chunk that no manifest references yet); the
caller serialises them per sandbox.

A store built with a ``Sealing`` seals what it writes (seal.py): chunks are
encrypted after compression and named by HMAC(data key, digest) instead of the
digest; the manifest is a signed, encrypted envelope; the sandbox's data key is
kept wrapped under ``keys/``. It reads sealed checkpoints, and plain ones only
with ``accept_plain``; a store without a ``Sealing`` refuses sealed checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar

import zstandard
from botocore.exceptions import ClientError

from hermit_common import bounded, gc
from hermit_common.chunkcache import CacheTally, ChunkCache, entry_name
from hermit_common.errors import CheckpointFailed, CheckpointRefused, HermitError
from hermit_common.gc import CollectResult
from hermit_common.manifest import (
    MAX_MANIFEST_BYTES,
    Binding,
    Manifest,
    Totals,
    check_section_name,
    digest_bytes,
    utc_now,
)
from hermit_common.s3errors import (
    CheckpointNotFound,
    ObjectExists,
    error_code,
    is_not_found,
    is_precondition_failed,
    is_transient,
    to_hermit_error,
)
from hermit_common.seal import (
    MAX_LINEAGE,
    ChunkCipher,
    Context,
    Expected,
    Sealing,
    Wrapped,
    check_lineage,
    is_sealed,
    new_dek,
    open_manifest,
    seal_manifest,
)
from hermit_common.settings import StoreSettings
from hermit_common.tree import (
    KIND_DIR,
    KIND_FIFO,
    KIND_FILE,
    KIND_SYMLINK,
    Entry,
    scan_tree,
)

__all__ = ["CheckpointNotFound", "CheckpointStore", "CollectResult", "ObjectExists", "Pace",
           "UploadProgress", "UploadResult", "UploadSession", "check_name", "make_s3_client"]

log = logging.getLogger(__name__)

_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_DIGEST_RE: Final = re.compile(r"^[0-9a-f]{64}$")
_ZSTD_LEVEL: Final = 3
_PUT_ATTEMPTS: Final = 4  # on top of botocore's own retries
_BACKOFF_BASE_SECONDS: Final = 0.25
_BACKOFF_CAP_SECONDS: Final = 4.0
_DELETE_BATCH: Final = 1000

_T = TypeVar("_T")


@dataclass(frozen=True)
class UploadProgress:
    """Reported after each chunk: how far an upload is."""

    chunks_done: int
    chunks_total: int
    bytes_done: int  # raw bytes read and hashed
    bytes_total: int
    uploaded_bytes: int  # compressed bytes PUT so far


@dataclass(frozen=True)
class UploadResult:
    """What an upload stored; the fields a Checkpoint's status reports."""

    manifest_uri: str
    manifest_digest: str
    manifest: Manifest
    image_bytes: int  # raw bytes of all files
    uploaded_bytes: int  # compressed bytes PUT, manifest included
    stored_bytes: int  # compressed size of all distinct chunks referenced
    chunks_total: int  # chunk references
    chunks_uploaded: int
    duration: float  # seconds
    chunks_copied: int = 0  # copied in the store from a fork's source, not uploaded
    lineage: tuple[str, ...] = ()  # the uid lineage a sealed manifest is signed for
    chunks_staged: int = 0  # hashed (and PUT when new) while their file was being written


ProgressCallback = Callable[[UploadProgress], None]
# Asked before each chunk PUT with its size in bytes, the upload's stop event and deadline:
# waits until the node's upload bandwidth lets it go (bandwidth.Ticket.acquire); False
# when it gave up waiting (stopped, or the deadline passed).
Pace = Callable[[int, threading.Event | None, float | None], bool]


def make_s3_client(settings: StoreSettings) -> Any:
    """A thread-safe boto3 S3 client configured from ``settings``."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": settings.max_attempts},
        connect_timeout=settings.connect_timeout_seconds,
        read_timeout=settings.read_timeout_seconds,
        max_pool_connections=max(10, settings.transfer_concurrency + 4),
        s3={"addressing_style": "path" if settings.endpoint_url else "auto"},
        user_agent_extra="hermit",
    )
    session = boto3.session.Session()
    return session.client(
        "s3",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id=settings.access_key_id,
        aws_secret_access_key=settings.secret_access_key,
        aws_session_token=settings.session_token,
        config=config,
    )


def check_name(value: str, what: str) -> str:
    """``value`` when it is one path segment of letters, digits, ``.``, ``_`` and ``-``
    (no ``/``, no wildcard, not ``.`` or ``..``); CheckpointFailed otherwise. Every key
    and every scoped-credential policy (storecreds.py) is built from checked names."""
    # fullmatch: "$" alone would let a trailing newline through.
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise CheckpointFailed(f"{what} name {value!r:.80} is not a valid object name")
    return value


_check_name = check_name

# Scoped credentials (storecreds.CredentialCache.client): (namespace, sandbox, read-only
# sandboxes of the namespace) -> an S3 client whose credentials reach that prefix only.
ScopedClients = Callable[[str, str, tuple[str, ...]], Any]


@dataclass(frozen=True)
class _ChunkTask:
    section: str
    entry_index: int
    chunk_index: int
    path: str
    offset: int
    length: int


@dataclass(frozen=True)
class _ChunkDone:
    task: _ChunkTask
    digest: str
    uploaded_bytes: int
    copied: bool = False


@dataclass(frozen=True)
class _DataKey:
    """A sandbox's data key as an upload uses it: the key, its record (wrapped under the
    current KEK), the lineage it is bound to and the sandbox whose chunks may be copied."""

    dek: bytes = dataclasses.field(repr=False)
    wrapped: Wrapped
    lineage: tuple[str, ...]
    source: str = ""


@dataclass(frozen=True)
class _Opened:
    """A manifest read from the store: parsed, with its stored digest, the cipher of its
    chunks (None: plain) and, sealed, its data key and signed context."""

    manifest: Manifest
    digest: str
    cipher: ChunkCipher | None
    dek: bytes | None = dataclasses.field(default=None, repr=False)
    context: Context | None = None


class _UploadState:
    """Shared between upload workers: which chunks exist, which are claimed."""

    def __init__(self, existing: Mapping[str, int], cipher: ChunkCipher | None,
                 source: str = "", source_chunks: Mapping[str, int] | None = None) -> None:
        self.cipher = cipher  # None: plain chunks, named by their digest
        self.pace: Pace | None = None  # None: chunk PUTs never wait for bandwidth
        self.lock = threading.Lock()
        self.sizes: dict[str, int] = dict(existing)  # object name -> stored size
        self.claimed: set[str] = set(existing)
        self.stop = threading.Event()
        # A fork's first upload: the source sandbox's chunks (same data key, same names),
        # copied inside the store instead of uploaded.
        self.source = source
        self.source_chunks: Mapping[str, int] = source_chunks or {}
        # Chunks PUT by UploadSession.stage: (path, offset, length) -> digest, and counts.
        self.staged: dict[tuple[str, int, int], str] = {}
        self.staged_new = self.staged_uploaded = 0


class _Tally:
    """Collects finished chunks (the file each belongs to, the counters) and reports progress."""

    def __init__(self, chunks_total: int, bytes_total: int,
                 on_progress: ProgressCallback | None) -> None:
        self.digests: dict[tuple[str, int], list[str]] = {}  # (section, entry) -> chunks
        self.chunks_total, self.bytes_total = chunks_total, bytes_total
        self.done = self.bytes = self.uploaded = self.new = self.copied = 0
        self._on_progress = on_progress

    def record(self, done: _ChunkDone) -> None:
        t = done.task
        slot = self.digests.setdefault((t.section, t.entry_index), [])
        slot.extend([""] * (t.chunk_index + 1 - len(slot)))
        slot[t.chunk_index] = done.digest
        self.done += 1
        self.bytes += t.length
        if done.copied:
            self.copied += 1
        elif done.uploaded_bytes:
            self.uploaded += done.uploaded_bytes
            self.new += 1
        if self._on_progress is not None:
            self._on_progress(UploadProgress(self.done, self.chunks_total, self.bytes,
                                             self.bytes_total, self.uploaded))


def _scan_sections(sections: Mapping[str, Path]) -> dict[str, list[Entry]]:
    """Every section's tree, scanned; a bad section name fails the checkpoint."""
    scanned: dict[str, list[Entry]] = {}
    for name, root in sections.items():
        try:
            check_section_name(name)
        except CheckpointRefused as exc:
            raise CheckpointFailed(str(exc)) from None
        scanned[name] = scan_tree(Path(root))
    return scanned


Layouts = Mapping[str, Mapping[str, tuple[int, ...]]]  # section -> file path -> chunk lengths


def _layouts_used(scanned: Mapping[str, list[Entry]], layouts: Layouts | None,
                  chunk_size: int) -> dict[tuple[str, int], tuple[int, ...]]:
    """(section, entry index) -> chosen chunk lengths, for the files ``layouts`` cuts
    into chunks of 1 to ``chunk_size`` bytes covering their size (never a hardlink or a
    file with hardlinks: those share their chunks with another entry)."""
    used: dict[tuple[str, int], tuple[int, ...]] = {}
    for name, entries in scanned.items():
        wanted = (layouts or {}).get(name) or {}
        if not wanted:
            continue
        linked = {e.link for e in entries if e.link is not None}
        for index, entry in enumerate(entries):
            lengths = wanted.get(entry.path)
            if lengths and entry.kind == KIND_FILE and entry.link is None \
                    and entry.path not in linked and sum(lengths) == entry.size \
                    and min(lengths) > 0 and max(lengths) <= chunk_size:
                used[(name, index)] = tuple(lengths)
    return used


def _chunk_tasks(sections: Mapping[str, Path], scanned: Mapping[str, list[Entry]],
                 chunk_size: int, cuts: Mapping[tuple[str, int], tuple[int, ...]],
                 ) -> tuple[list[_ChunkTask], int]:
    """One task per chunk of every regular file, and the files' total size in bytes."""
    tasks: list[_ChunkTask] = []
    image_bytes = 0
    for name, entries in scanned.items():
        top = os.fspath(sections[name])
        for index, entry in enumerate(entries):
            if entry.kind != KIND_FILE:
                continue
            image_bytes += entry.size
            path = os.path.join(top, entry.path)
            cut = dataclasses.replace(entry, chunk_lengths=cuts.get((name, index), ()))
            for ci, (offset, length) in enumerate(cut.chunk_spans(chunk_size)):
                tasks.append(_ChunkTask(name, index, ci, path, offset, length))
    return tasks, image_bytes


def _with_chunks(scanned: Mapping[str, list[Entry]],
                 digests: Mapping[tuple[str, int], list[str]],
                 cuts: Mapping[tuple[str, int], tuple[int, ...]],
                 ) -> tuple[dict[str, tuple[Entry, ...]], set[str], int]:
    """The manifest's sections: each file entry with its chunk digests (and lengths,
    when the file was cut at chosen places).

    Also returns the distinct digests referenced and the number of files.
    """
    final: dict[str, tuple[Entry, ...]] = {}
    referenced: set[str] = set()
    files = 0
    for name, entries in scanned.items():
        out = []
        for index, entry in enumerate(entries):
            if entry.kind == KIND_FILE:
                files += 1
                chunks = tuple(digests.get((name, index), []))
                referenced.update(chunks)
                entry = dataclasses.replace(entry, chunks=chunks,
                                            chunk_lengths=cuts.get((name, index), ()))
            out.append(entry)
        final[name] = tuple(out)
    return final, referenced, files


def _run_parallel(max_workers: int, thread_name: str, jobs: Sequence[Callable[[], _T]],
                  on_done: Callable[[_T], None], stop: threading.Event) -> None:
    """Runs ``jobs`` on up to ``max_workers`` threads, each result to ``on_done`` as it comes.

    The first failure (of a job or of ``on_done``) sets ``stop``, cancels the jobs
    not started yet and is raised once the running ones have finished.
    """
    if not jobs:
        return
    workers = max(1, min(max_workers, len(jobs)))
    with ThreadPoolExecutor(workers, thread_name_prefix=thread_name) as pool:
        pending: set[Future[_T]] = {pool.submit(job) for job in jobs}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    on_done(future.result())
        except BaseException:
            stop.set()
            for future in pending:
                future.cancel()
            raise


def _ignore(_result: object) -> None:
    pass


class _Location:
    __slots__ = ("label", "length", "offset", "path")

    def __init__(self, path: str, offset: int, length: int, label: str) -> None:
        self.path, self.offset, self.length, self.label = path, offset, length, label


def _read_exact(path: str, offset: int, length: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointFailed(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        parts: list[bytes] = []
        got = 0
        while got < length:
            data = os.pread(fd, length - got, offset + got)
            if not data:
                raise CheckpointFailed(f"cannot read {path}: file shrank while it was captured")
            parts.append(data)
            got += len(data)
        return b"".join(parts)
    except OSError as exc:
        raise CheckpointFailed(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _not_found(key: str) -> ClientError:
    """What a GET of a missing object raises (is_not_found), for a refusal found to be one."""
    return ClientError({"Error": {"Code": "NoSuchKey", "Message": f"{key}: no such key"}},
                       "GetObject")


# Zero chunks (untouched pages CRIU dumps, sparse files) skip hashing and compression:
# their digest and compressed form depend on their length only (a few lengths a run).
def _is_zero(data: bytes) -> bool:
    """All zero bytes: the ends first (most chunks fail there), then one memcmp."""
    return data[:1] == b"\0" and data[-1:] == b"\0" and data == _zeros(len(data))


@functools.lru_cache(maxsize=4)
def _zeros(length: int) -> bytes:
    return bytes(length)


@functools.lru_cache(maxsize=64)
def _zero_digest(length: int) -> str:
    return hashlib.sha256(_zeros(length)).hexdigest()


@functools.lru_cache(maxsize=64)
def _zero_body(length: int) -> bytes:
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(_zeros(length))


def _write_all(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)


class CheckpointStore:
    """Checkpoints of sandboxes as manifests plus shared, content-addressed chunks."""

    def __init__(self, settings: StoreSettings, client: Any | None = None, *,
                 sealing: Sealing | None = None, cache: ChunkCache | None = None,
                 scoped: ScopedClients | None = None) -> None:
        self.settings = settings
        self._sealing = sealing
        self.cache = cache  # downloads read chunk objects from it first (chunkcache.py)
        # With ``scoped``, every request uses the client of the sandbox its key is under,
        # and there is no bucket-wide client at all.
        self._scoped = scoped
        self._client = client if client is not None or scoped is not None \
            else make_s3_client(settings)
        self._endpoint = settings.endpoint_url or "AWS S3"
        self._local = threading.local()

    @property
    def client(self) -> Any:
        """The S3 client (thread-safe; stores of other buckets may share it); None with
        scoped credentials."""
        return self._client

    @property
    def scoped(self) -> bool:
        return self._scoped is not None

    def _s3(self, key: str, reads: tuple[str, ...] = ()) -> Any:
        """The client for a request on ``key`` (an object key or a listing prefix under
        a sandbox's prefix); with scoped credentials, that sandbox's (and ``reads``')."""
        if self._scoped is None:
            return self._client
        prefix = self.settings.prefix.strip("/")
        rest = key[len(prefix) + 1:] if prefix and key.startswith(prefix + "/") else \
            (key if not prefix else "")
        parts = rest.split("/", 2)
        if len(parts) < 3:
            raise CheckpointFailed(f"{key!r:.200} is under no sandbox's prefix: scoped "
                                   "store credentials reach only sandbox prefixes")
        return self._scoped(check_name(parts[0], "namespace"), check_name(parts[1], "sandbox"),
                            reads)

    # -- keys ---------------------------------------------------------------

    def _sandbox_prefix(self, namespace: str, sandbox: str) -> str:
        base = f"{_check_name(namespace, 'namespace')}/{_check_name(sandbox, 'sandbox')}/"
        prefix = self.settings.prefix.strip("/")
        return f"{prefix}/{base}" if prefix else base

    def chunk_key(self, namespace: str, sandbox: str, digest: str) -> str:
        return f"{self._sandbox_prefix(namespace, sandbox)}chunks/{digest}"

    def manifest_key(self, namespace: str, sandbox: str, checkpoint: str) -> str:
        name = _check_name(checkpoint, "checkpoint")
        return f"{self._sandbox_prefix(namespace, sandbox)}checkpoints/{name}/manifest.json"

    def sandbox_key_key(self, namespace: str, sandbox: str, sandbox_uid: str) -> str:
        """Where a sealed store keeps the sandbox's wrapped data key."""
        return f"{self._sandbox_prefix(namespace, sandbox)}keys/{_check_name(sandbox_uid, 'uid')}"

    def manifest_uri(self, namespace: str, sandbox: str, checkpoint: str) -> str:
        return f"s3://{self.settings.bucket}/{self.manifest_key(namespace, sandbox, checkpoint)}"

    # -- S3 primitives ----------------------------------------------------------

    def _error(self, exc: BaseException, key: str, action: str) -> HermitError:
        return to_hermit_error(exc, endpoint=self._endpoint, bucket=self.settings.bucket,
                               key=key, action=action)

    def _list(self, prefix: str, action: str) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.settings.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            try:
                page = self._s3(prefix).list_objects_v2(**kwargs)
            except Exception as exc:
                raise self._error(exc, prefix, action) from None
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def _put(self, key: str, body: bytes, content_type: str, action: str,
             stop: threading.Event | None = None, deadline: float | None = None, *,
             exclusive: bool = False, pace: Pace | None = None) -> None:
        """PUT with extra backoff-and-jitter attempts for errors botocore gave up on.

        ``exclusive``: a conditional PUT (``If-None-Match: *``) that never replaces an
        object; ObjectExists when there is one already. ``pace``: asked before each
        attempt (the node's upload bandwidth, bandwidth.py)."""
        extra: dict[str, str] = {"IfNoneMatch": "*"} if exclusive else {}
        for attempt in range(1, _PUT_ATTEMPTS + 1):
            if stop is not None and stop.is_set():
                raise CheckpointFailed("upload aborted")
            if deadline is not None and time.monotonic() > deadline:
                raise CheckpointFailed(f"cannot {action}: the upload deadline passed")
            if pace is not None and not pace(len(body), stop, deadline):
                raise CheckpointFailed("upload aborted" if stop is not None and stop.is_set()
                                       else f"cannot {action}: the upload deadline passed "
                                       "while it waited for the node's upload bandwidth")
            try:
                self._s3(key).put_object(Bucket=self.settings.bucket, Key=key, Body=body,
                                         ContentType=content_type, **extra)
                return
            except Exception as exc:
                if exclusive and is_precondition_failed(exc):
                    raise ObjectExists(
                        f"cannot {action} s3://{self.settings.bucket}/{key}: an object "
                        "exists there already (written by another writer); it was not "
                        "replaced") from None
                if attempt == _PUT_ATTEMPTS or not is_transient(exc):
                    raise self._error(exc, key, action) from None
                delay = min(_BACKOFF_CAP_SECONDS, _BACKOFF_BASE_SECONDS * 2 ** (attempt - 1))
                delay *= random.uniform(0.5, 1.5)
                log.debug("retrying %s of %s in %.2fs: %s", action, key, delay,
                          type(exc).__name__)
                if stop is not None:
                    stop.wait(delay)
                else:
                    time.sleep(delay)

    def _get(self, key: str, action: str, max_bytes: int) -> bytes:
        """An object's bytes, at most ``max_bytes`` of them (bounded.py): its size is
        checked on the response's Content-Length before any of the body is read (the
        connection is closed unread: one request, like a HEAD first but without its
        race), and no more than ``max_bytes`` + 1 bytes are ever read, whatever the
        header said. bounded.TooLarge when it is larger."""
        try:
            response = self._s3(key).get_object(Bucket=self.settings.bucket, Key=key)
        except Exception as exc:
            if is_not_found(exc):
                raise
            if self._scoped is not None and self._absent(key, exc):
                raise _not_found(key) from None
            raise self._error(exc, key, action) from None
        body = response["Body"]
        try:
            length = int(response.get("ContentLength", 0))
            if length > max_bytes:
                raise bounded.TooLarge(
                    f"cannot {action} s3://{self.settings.bucket}/{key}: object of {length} "
                    f"bytes is larger than the limit of {max_bytes}")
            data: bytes = body.read(max_bytes + 1)
        except HermitError:
            raise
        except Exception as exc:
            raise self._error(exc, key, action) from None
        finally:
            body.close()
        if len(data) > max_bytes:
            raise bounded.TooLarge(
                f"cannot {action} s3://{self.settings.bucket}/{key}: object is larger than "
                f"the limit of {max_bytes} bytes")
        return data

    # -- compression ----------------------------------------------------------

    def _absent(self, key: str, exc: BaseException) -> bool:
        """Whether a refused GET was of a missing object. AWS S3 answers 403, not 404, for
        a missing key unless ListBucket is allowed without a condition, and scoped
        credentials allow it only under the sandbox's prefix (storecreds.py); so a
        refusal is checked with a listing of exactly that key, which they may make."""
        if not isinstance(exc, ClientError) or error_code(exc) not in ("AccessDenied", "403"):
            return False
        try:
            page = self._s3(key).list_objects_v2(Bucket=self.settings.bucket, Prefix=key,
                                                 MaxKeys=1)
        except Exception:
            return False
        return not any(o.get("Key") == key for o in page.get("Contents", []))

    def _compressor(self) -> zstandard.ZstdCompressor:
        comp = getattr(self._local, "compressor", None)
        if comp is None:
            comp = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True)
            self._local.compressor = comp
        return comp

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dec = getattr(self._local, "decompressor", None)
        if dec is None:
            dec = zstandard.ZstdDecompressor()
            self._local.decompressor = dec
        return dec

    # -- sealing ----------------------------------------------------------------

    def _sandbox_dek(self, context: Context, deadline: float | None) -> _DataKey:
        """The sandbox's data key, wrapped under the current KEK (made, or re-wrapped after
        a rotation or from the first record format, and stored when needed: a rotation
        keeps the key, so dedup goes on), with the lineage it is bound to."""
        assert self._sealing is not None
        wrapper = self._sealing.wrapper
        key = self.sandbox_key_key(context.namespace, context.sandbox, context.sandbox_uid)
        stored = self._read_sandbox_key(key)
        dek: bytes | None = None
        lineage: tuple[str, ...] = (context.sandbox_uid,)
        source = ""
        if stored is not None:
            bound = dataclasses.replace(context, lineage=stored.lineage)
            try:
                if stored.lineage:
                    check_lineage(stored.lineage, context.sandbox_uid)
                dek = wrapper.unwrap(stored, bound.sandbox_bytes())
            except CheckpointRefused as exc:  # its KEK is gone, or it was altered
                log.warning("the data key of sandbox %s/%s is unusable, making a new one: %s",
                            context.namespace, context.sandbox, exc)
            else:
                lineage, source = stored.lineage or lineage, stored.source
                if stored.key_id == wrapper.current_key_id() and stored.lineage:
                    return _DataKey(dek, stored, lineage, stored.source)
        dek = dek if dek is not None else new_dek()
        wrapped = self._write_sandbox_key(dataclasses.replace(context, lineage=lineage),
                                          dek, source, deadline)
        return _DataKey(dek, wrapped, lineage, source)

    def _write_sandbox_key(self, context: Context, dek: bytes, source: str,
                           deadline: float | None) -> Wrapped:
        """Stores ``dek`` as the sandbox's key record, bound to its lineage."""
        assert self._sealing is not None
        wrapped = self._sealing.wrapper.wrap(dek, context.sandbox_bytes())
        wrapped = dataclasses.replace(wrapped, lineage=context.lineage, source=source)
        key = self.sandbox_key_key(context.namespace, context.sandbox, context.sandbox_uid)
        self._put(key, wrapped.to_bytes(), "application/json", "write sandbox key",
                  deadline=deadline)
        return wrapped

    def _read_sandbox_key(self, key: str) -> Wrapped | None:
        try:
            return Wrapped.from_bytes(self._get(key, "read sandbox key",
                                                bounded.KEY_RECORD_MAX_BYTES))
        except CheckpointRefused as exc:
            log.warning("the sandbox key record %s is unusable (%s): a new one replaces it",
                        key, exc)
            return None  # malformed or oversized: replaced by a new key
        except Exception as exc:
            if is_not_found(exc):
                return None
            raise

    def _unseal(self, raw: bytes, expect: Expected) -> tuple[bytes, bytes | None,
                                                             Context | None]:
        """The manifest JSON in stored bytes ``raw``, and (sealed) its data key and signed
        context. Refuses what this store may not read or what does not verify."""
        where = f"checkpoint {expect.namespace}/{expect.checkpoint}"
        if not is_sealed(raw):
            if self._sealing is not None and not self._sealing.accept_plain:
                raise CheckpointRefused(
                    f"{where} is refused: it is not sealed; this node-agent reads only sealed "
                    "checkpoints (HERMIT_SEAL_ACCEPT_PLAIN=true reads plain ones, for a "
                    "migration)")
            return raw, None, None
        if self._sealing is None:
            raise CheckpointRefused(
                f"{where} is refused: it is sealed, and this node-agent has no sealing keys "
                "(HERMIT_SEAL_KEYS_DIR)")
        try:
            opened = open_manifest(self._sealing.wrapper, raw, expect)
        except CheckpointRefused as exc:
            raise CheckpointRefused(f"{where} is refused: {exc}") from None
        return opened.plain, opened.dek, opened.context

    def inherit_data_key(self, source: Expected, expect_digest: str | None,
                         heir: CheckpointStore, namespace: str, sandbox: str,
                         sandbox_uid: str) -> bool:
        """Gives a fork (``sandbox``, ``sandbox_uid`` in ``heir``) the data key of the sealed
        checkpoint ``source`` it was restored from, bound to the source's lineage plus the
        fork's uid, unless the fork has a key already. Its chunks then get the same names
        as the source's (and, in the same store, are copied rather than uploaded by its
        first checkpoint). The source is verified exactly as a restore verifies it.
        False when nothing was inherited (plain, a lineage too long, a key already there)."""
        if self._sealing is None or heir._sealing is None:
            return False
        opened = self._open_manifest(source, expect_digest)
        if opened.dek is None or opened.context is None:
            return False
        lineage = (*(opened.context.lineage or (opened.context.sandbox_uid,)), sandbox_uid)
        if len(lineage) > MAX_LINEAGE or sandbox_uid in lineage[:-1]:
            return False
        key = heir.sandbox_key_key(namespace, sandbox, sandbox_uid)
        if heir._read_sandbox_key(key) is not None:
            return False
        same_store = (heir.settings.bucket, heir.settings.endpoint_url, heir.settings.prefix) \
            == (self.settings.bucket, self.settings.endpoint_url, self.settings.prefix)
        heir._write_sandbox_key(Context(namespace, sandbox, sandbox_uid, lineage=lineage),
                                opened.dek, source.sandbox if same_store else "", None)
        log.info("sandbox %s/%s inherits the data key of %s/%s (lineage of %d)", namespace,
                 sandbox, source.namespace, source.sandbox, len(lineage))
        return True

    # -- public API -------------------------------------------------------------

    def ensure_bucket(self) -> None:
        """Creates the bucket if it does not exist (for tests and demos)."""
        bucket = self.settings.bucket
        if self._client is None:
            raise HermitError(f"cannot check or create bucket {bucket} with scoped store "
                              "credentials: they reach sandbox prefixes only")
        try:
            self._client.head_bucket(Bucket=bucket)
            return
        except Exception as exc:
            if not is_not_found(exc) and "NoSuchBucket" not in str(exc):
                raise self._error(exc, "", "check bucket") from None
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if self.settings.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.settings.region}
        try:
            self._client.create_bucket(**kwargs)
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._error(exc, "", "create bucket") from None

    def list_chunks(self, namespace: str, sandbox: str) -> dict[str, int]:
        """The sandbox's stored chunks: object name (the digest, unless sealed) -> size."""
        prefix = f"{self._sandbox_prefix(namespace, sandbox)}chunks/"
        out: dict[str, int] = {}
        for obj in self._list(prefix, "list chunks"):
            digest = obj["Key"][len(prefix):]
            if _DIGEST_RE.match(digest):
                out[digest] = int(obj.get("Size", 0))
        return out

    def list_checkpoints(self, namespace: str, sandbox: str) -> list[str]:
        """Names of the sandbox's complete checkpoints (those with a manifest), sorted."""
        prefix = f"{self._sandbox_prefix(namespace, sandbox)}checkpoints/"
        names = []
        for obj in self._list(prefix, "list checkpoints"):
            rest = obj["Key"][len(prefix):]
            name, sep, leaf = rest.partition("/")
            if sep and leaf == "manifest.json":
                names.append(name)
        return sorted(names)

    def delete_checkpoint(self, namespace: str, sandbox: str, checkpoint: str) -> None:
        """Deletes a checkpoint's manifest; its chunks go with ``collect_garbage``."""
        key = self.manifest_key(namespace, sandbox, checkpoint)
        try:
            self._s3(key).delete_object(Bucket=self.settings.bucket, Key=key)
        except Exception as exc:
            raise self._error(exc, key, "delete checkpoint") from None

    def read_manifest(self, namespace: str, sandbox: str, checkpoint: str, *,
                      expect_uid: str | None = None, expect_parent: str | None = None,
                      expect_lineage: tuple[str, ...] | None = None,
                      expect_digest: str | None = None,
                      ) -> tuple[Manifest, str]:
        """Fetches, verifies (when sealed) and parses a manifest; returns it with the
        digest of its stored bytes. ``expect_uid``, ``expect_parent`` and
        ``expect_lineage``: what a sealed manifest must be signed for, when given;
        ``expect_digest`` (a Checkpoint's status.manifestDigest): the stored bytes must
        have it, checked before anything is parsed."""
        opened = self._open_manifest(Expected(namespace, sandbox, checkpoint, expect_uid,
                                              expect_parent, expect_lineage), expect_digest)
        return opened.manifest, opened.digest

    def _open_manifest(self, expect: Expected, expect_digest: str | None = None) -> _Opened:
        """Fetches a manifest (at most bounded.STORED_MANIFEST_MAX_BYTES, refused on its
        Content-Length before its body is read), checks its stored bytes against
        ``expect_digest`` before anything is parsed or decrypted, then unseals (the
        envelope's few fields parsed, its signature checked) and parses it."""
        namespace, checkpoint = expect.namespace, expect.checkpoint
        raw = self._read_manifest_bytes(namespace, expect.sandbox, checkpoint)
        actual = digest_bytes(raw)
        if expect_digest is not None and actual != expect_digest:
            raise CheckpointRefused(
                f"checkpoint {namespace}/{checkpoint} is refused: manifest digest "
                f"{actual} does not match the expected {expect_digest} (changed in the bucket "
                "since it was taken)")
        plain, dek, context = self._unseal(raw, expect)
        return _Opened(Manifest.from_json(plain), actual,
                       ChunkCipher(dek) if dek is not None else None, dek, context)

    def collect_garbage(self, namespace: str, sandbox: str, *,
                        min_age_seconds: float = 0.0) -> int:
        """Deletes the sandbox's chunks no remaining manifest references; returns how many.

        Chunks younger than ``min_age_seconds`` are kept (they may belong to an
        upload whose manifest is not written yet).
        """
        return len(self.collect(namespace, sandbox, keep=None,
                                min_age_seconds=min_age_seconds).chunks)

    def collect(self, namespace: str, sandbox: str, *, keep: Collection[str] | None,
                min_age_seconds: float = 0.0,
                may_delete: Callable[[], bool] | None = None) -> CollectResult:
        """Garbage collection of one sandbox's prefix (gc.py decides, this lists and deletes).

        Manifests of checkpoints not in ``keep`` (None: keep every manifest) are deleted,
        then the chunks no remaining manifest references. Nothing younger than
        ``min_age_seconds`` goes. ``may_delete`` is asked before every delete request;
        False stops the collection there (``aborted``). Must not run concurrently with an
        upload of the same sandbox: the caller serialises them (docs/storage.md).
        """
        checkpoints = f"{self._sandbox_prefix(namespace, sandbox)}checkpoints/"
        manifests = {name: age for name, age in self._ages(checkpoints, "list checkpoints")
                     if name.endswith("/manifest.json")}
        stored = {name.removesuffix("/manifest.json"): age for name, age in manifests.items()}
        gone = [] if keep is None else gc.doomed(stored, keep, min_age_seconds)
        if not self._delete([f"{checkpoints}{n}/manifest.json" for n in gone],
                            "delete manifests", may_delete):
            return CollectResult(aborted=True)
        referenced: set[str] = set()  # object names
        for name in sorted(set(stored) - set(gone)):
            try:
                # A manifest that does not open (e.g. its KEK is gone) raises: nothing is
                # deleted while what it references is unknown.
                referenced |= self.referenced_chunks(namespace, sandbox, name)
            except CheckpointNotFound:
                continue  # deleted meanwhile
            except bounded.TooLarge as exc:
                # Larger than any manifest Hermit writes (or restores): planted, or
                # unreadable anyway. Skipped unread, so it can neither exhaust the
                # agent's memory nor stop the collection; its chunks count for nothing.
                log.warning("garbage collection of %s/%s: manifest of %s skipped: %s",
                            namespace, sandbox, name, exc)
                continue
        prefix = f"{self._sandbox_prefix(namespace, sandbox)}chunks/"
        chunks = gc.doomed(dict(self._ages(prefix, "list chunks")), referenced, min_age_seconds)
        if not self._delete([f"{prefix}{c}" for c in chunks], "delete chunks", may_delete):
            return CollectResult(manifests=tuple(gone), aborted=True)
        if gone or chunks:
            log.info("collected %s/%s: %d manifests and %d chunks deleted", namespace, sandbox,
                     len(gone), len(chunks))
        return CollectResult(manifests=tuple(gone), chunks=tuple(chunks))

    def referenced_chunks(self, namespace: str, sandbox: str, checkpoint: str) -> set[str]:
        """The object names (under ``chunks/``) of the chunks a checkpoint references."""
        opened = self._open_manifest(Expected(namespace, sandbox, checkpoint))
        return {_object_name(opened.cipher, d) for d in opened.manifest.chunk_digests()}

    def _ages(self, prefix: str, action: str) -> Iterator[tuple[str, float | None]]:
        """(name under ``prefix``, age in seconds or None) of every object there."""
        now = time.time()
        for obj in self._list(prefix, action):
            modified = obj.get("LastModified")
            yield obj["Key"][len(prefix):], (
                None if modified is None else now - modified.timestamp())

    def _delete(self, keys: Sequence[str], action: str,
                may_delete: Callable[[], bool] | None) -> bool:
        """Deletes ``keys`` in batches; False when ``may_delete`` stopped it first."""
        for start in range(0, len(keys), _DELETE_BATCH):
            if may_delete is not None and not may_delete():
                log.info("garbage collection stopped before it could %s", action)
                return False
            batch = keys[start:start + _DELETE_BATCH]
            try:
                response = self._s3(batch[0]).delete_objects(
                    Bucket=self.settings.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            except Exception as exc:
                raise self._error(exc, batch[0], action) from None
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise self._error(
                    RuntimeError(f"{first.get('Code')}: {first.get('Message')}"),
                    str(first.get("Key", batch[0])), action)
        return True

    # -- upload -----------------------------------------------------------------

    def upload(self, binding: Binding, sections: Mapping[str, Path],
               restore: Mapping[str, Any], *, on_progress: ProgressCallback | None = None,
               deadline: float | None = None, parent: str = "",
               layouts: Layouts | None = None, pace: Pace | None = None) -> UploadResult:
        """Uploads the directory trees ``sections`` as checkpoint ``binding.checkpoint``.

        ``layouts``: where to cut some files into chunks (section -> path -> chunk
        lengths, each at most the chunk size), e.g. CRIU page images cut so memory
        shared by two processes makes the same chunks; other files get fixed-size ones.

        ``parent``: the checkpoint the sandbox was restored from ("": none), which a
        sealed manifest is signed for. ``deadline`` is a ``time.monotonic()`` value after
        which the upload gives up. Any failure raises StoreUnavailable or CheckpointFailed
        and leaves no manifest (chunks already PUT stay for reuse or garbage collection).
        ``pace``: asked before each chunk PUT (the node's upload bandwidth, bandwidth.py);
        the manifest never waits for it (small, and it makes the checkpoint durable).
        """
        return self.begin_upload(binding, deadline=deadline, parent=parent,
                                 pace=pace).finish(
            sections, restore, on_progress=on_progress, layouts=layouts)

    def begin_upload(self, binding: Binding, *, deadline: float | None = None,
                     parent: str = "", pace: Pace | None = None) -> UploadSession:
        """An upload of checkpoint ``binding.checkpoint`` that may PUT chunks of files
        still being written (``UploadSession.stage``) before ``finish`` writes the rest
        and the manifest. Same arguments and failures as ``upload``."""
        started = time.monotonic()
        context = Context(binding.namespace, binding.sandbox, binding.sandbox_uid,
                          binding.checkpoint, parent)
        keys = self._sandbox_dek(context, deadline) if self._sealing is not None else None
        state = self._upload_state(binding.namespace, binding.sandbox, keys)
        state.pace = pace
        return UploadSession(self, binding, context, keys, state, deadline, started)

    def _stage(self, session: UploadSession, path: str, offset: int, length: int) -> None:
        """PUTs one chunk of a file ahead of ``finish`` (see ``UploadSession.stage``)."""
        b, state = session.binding, session.state
        task = _ChunkTask("", 0, 0, path, offset, length)
        done = self._upload_chunk(task, state, b.namespace, b.sandbox, session.deadline)
        with state.lock:
            state.staged[(path, offset, length)] = done.digest
            if done.uploaded_bytes:
                state.staged_new += 1
                state.staged_uploaded += done.uploaded_bytes

    def _finish(self, session: UploadSession, sections: Mapping[str, Path],
                restore: Mapping[str, Any], on_progress: ProgressCallback | None,
                layouts: Layouts | None) -> UploadResult:
        binding, state, keys, deadline = (session.binding, session.state, session.keys,
                                          session.deadline)
        ns, sandbox = binding.namespace, binding.sandbox
        manifest_key = self.manifest_key(ns, sandbox, binding.checkpoint)
        chunk_size = self.settings.chunk_size_bytes
        scanned = _scan_sections(sections)
        cuts = _layouts_used(scanned, layouts, chunk_size)
        tasks, image_bytes = _chunk_tasks(sections, scanned, chunk_size, cuts)
        tally = _Tally(len(tasks), image_bytes, on_progress)
        _settle_staged(state)
        self._run_upload(tasks, state, ns, sandbox, deadline, tally.record)

        final, referenced, files = _with_chunks(scanned, tally.digests, cuts)
        stored_bytes = sum(state.sizes[_object_name(state.cipher, d)] for d in referenced)
        lineage = keys.lineage if keys is not None else ()
        manifest = Manifest(
            binding=binding, created_at=utc_now(), chunk_size=chunk_size, sections=final,
            restore=dict(restore),
            totals=Totals(files=files, image_bytes=image_bytes, chunks=len(tasks),
                          unique_chunks=len(referenced), stored_bytes=stored_bytes),
        )
        raw = manifest.to_json()
        if len(raw) > MAX_MANIFEST_BYTES:  # it could never be read back: fail now
            raise CheckpointFailed(
                f"the manifest of checkpoint {ns}/{binding.checkpoint} would be {len(raw)} "
                f"bytes ({sum(len(e) for e in final.values())} entries), over the limit of "
                f"{MAX_MANIFEST_BYTES} (about 300 000 entries; docs/storage.md#bounded-"
                "parsing): the sandbox has too many files to checkpoint")
        if keys is not None:
            assert self._sealing is not None
            raw = seal_manifest(keys.dek, keys.wrapped,
                                dataclasses.replace(session.context, lineage=lineage), raw)
        self._put_manifest(manifest_key, raw, deadline)
        with state.lock:
            new, uploaded = tally.new + state.staged_new, tally.uploaded + state.staged_uploaded
        result = UploadResult(
            manifest_uri=f"s3://{self.settings.bucket}/{manifest_key}",
            manifest_digest=digest_bytes(raw), manifest=manifest, image_bytes=image_bytes,
            uploaded_bytes=uploaded + len(raw), stored_bytes=stored_bytes,
            chunks_total=len(tasks), chunks_uploaded=new,
            duration=time.monotonic() - session.started, chunks_copied=tally.copied,
            lineage=lineage, chunks_staged=len(state.staged),
        )
        log.info("checkpoint %s/%s/%s uploaded: %d bytes, %d/%d chunks new (%d staged while "
                 "written), %d copied, %.2fs", ns, sandbox, binding.checkpoint, image_bytes,
                 new, len(tasks), len(state.staged), tally.copied, result.duration)
        return result

    def _put_manifest(self, key: str, raw: bytes, deadline: float | None) -> None:
        """Writes a manifest that must not exist yet: two writers of one checkpoint never
        replace each other's. The same bytes already there are ours (a retried PUT whose
        first answer was lost); anything else is another writer's and fails this upload."""
        try:
            self._put(key, raw, "application/json", "write manifest", deadline=deadline,
                      exclusive=True)
        except ObjectExists as exc:
            try:
                stored = self._get(key, "read manifest", bounded.STORED_MANIFEST_MAX_BYTES)
            except Exception:
                stored = b""
            if stored != raw:
                raise CheckpointFailed(str(exc)) from None

    def _upload_state(self, ns: str, sandbox: str, keys: _DataKey | None) -> _UploadState:
        """Which chunks the sandbox has; for a fork with none yet, which ones its source
        has (same data key, so the same names)."""
        existing = self.list_chunks(ns, sandbox)
        cipher = ChunkCipher(keys.dek) if keys is not None else None
        if keys is None or not keys.source or keys.source == sandbox or existing:
            return _UploadState(existing, cipher)
        return _UploadState(existing, cipher, keys.source, self.list_chunks(ns, keys.source))

    def _run_upload(self, tasks: list[_ChunkTask], state: _UploadState, ns: str, sandbox: str,
                    deadline: float | None, on_done: Callable[[_ChunkDone], None]) -> None:
        """Runs the chunk tasks in the pool; the first failure stops the rest and is raised."""
        jobs = [partial(self._upload_chunk, t, state, ns, sandbox, deadline) for t in tasks]
        _run_parallel(self.settings.transfer_concurrency, "hermit-upload", jobs, on_done,
                      state.stop)

    def _upload_chunk(self, task: _ChunkTask, state: _UploadState, ns: str, sandbox: str,
                      deadline: float | None) -> _ChunkDone:
        if state.stop.is_set():
            raise CheckpointFailed("upload aborted")
        with state.lock:
            staged = state.staged.get((task.path, task.offset, task.length))
        if staged is not None:  # PUT (or found present) while the file was written
            return _ChunkDone(task, staged, 0)
        data = _read_exact(task.path, task.offset, task.length)
        zero = _is_zero(data)
        digest = _zero_digest(len(data)) if zero else hashlib.sha256(data).hexdigest()
        name = _object_name(state.cipher, digest)
        with state.lock:
            if name in state.claimed:
                return _ChunkDone(task, digest, 0)
            state.claimed.add(name)
        if name in state.source_chunks and self._copy_chunk(state, ns, sandbox, name):
            with state.lock:
                state.sizes[name] = state.source_chunks[name]
            return _ChunkDone(task, digest, 0, copied=True)
        body = _zero_body(len(data)) if zero else self._compressor().compress(data)
        if state.cipher is not None:
            body = state.cipher.seal(name, body)
        self._put(self.chunk_key(ns, sandbox, name), body,
                  "application/octet-stream" if state.cipher else "application/zstd",
                  "upload chunk", state.stop, deadline, pace=state.pace)
        with state.lock:
            state.sizes[name] = len(body)
        return _ChunkDone(task, digest, len(body))

    def _copy_chunk(self, state: _UploadState, ns: str, sandbox: str, name: str) -> bool:
        """Copies chunk ``name`` from the fork's source inside the store; False when that
        fails (gone meanwhile, or refused): the caller uploads it instead."""
        source_key = self.chunk_key(ns, state.source, name)
        dest_key = self.chunk_key(ns, sandbox, name)
        try:
            self._s3(dest_key, (state.source,)).copy_object(
                Bucket=self.settings.bucket, Key=dest_key,
                CopySource={"Bucket": self.settings.bucket, "Key": source_key})
        except Exception as exc:
            log.debug("cannot copy %s, uploading it: %s", source_key, type(exc).__name__)
            return False
        return True

    # -- download ---------------------------------------------------------------

    def _read_manifest_bytes(self, namespace: str, sandbox: str, checkpoint: str) -> bytes:
        key = self.manifest_key(namespace, sandbox, checkpoint)
        try:
            return self._get(key, "read manifest", bounded.STORED_MANIFEST_MAX_BYTES)
        except Exception as exc:
            if is_not_found(exc):
                raise CheckpointNotFound(
                    f"checkpoint {namespace}/{checkpoint} of sandbox {namespace}/{sandbox} "
                    f"not found at s3://{self.settings.bucket}/{key}") from None
            raise

    def download(self, namespace: str, sandbox: str, checkpoint: str, dest: Path, *,
                 expect_uid: str, expect_digest: str | None = None,
                 expect_parent: str | None = None,
                 expect_lineage: tuple[str, ...] | None = None) -> Manifest:
        """Fetches, verifies and writes a checkpoint into ``dest/<section>/``.

        Raises CheckpointRefused (foreign, tampered, malformed or unsafe
        checkpoint), CheckpointNotFound, or StoreUnavailable. On failure nothing
        is left under ``dest``; on success every byte has been verified.
        """
        return self.download_deferred(
            namespace, sandbox, checkpoint, dest, expect_uid=expect_uid,
            expect_digest=expect_digest, expect_parent=expect_parent,
            expect_lineage=expect_lineage)[0]

    def download_deferred(self, namespace: str, sandbox: str, checkpoint: str, dest: Path, *,
                          expect_uid: str, expect_digest: str | None = None,
                          expect_parent: str | None = None,
                          expect_lineage: tuple[str, ...] | None = None,
                          defer: Defer | None = None, tally: CacheTally | None = None,
                          ) -> tuple[Manifest, Deferred]:
        """``download``, except that the chunks of the files ``defer`` picks are left to the
        returned Deferred: those files exist with their size and metadata, and their
        bytes (each chunk verified) land when it fetches them. ``tally`` counts the chunks
        found in the cache and those fetched from S3."""
        opened = self._open_manifest(Expected(namespace, sandbox, checkpoint, expect_uid,
                                              expect_parent, expect_lineage), expect_digest)
        manifest, cipher = opened.manifest, opened.cipher
        _check_binding(manifest, namespace, sandbox, checkpoint, expect_uid)
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        created: list[Path] = []
        try:
            for name in manifest.sections:
                section_root = dest / name
                try:
                    section_root.mkdir(mode=0o700)
                except FileExistsError:
                    raise CheckpointFailed(
                        f"cannot restore into {section_root}: it already exists") from None
                created.append(section_root)
            where = _Where(namespace, sandbox, checkpoint, cipher, tally)
            later = self._materialize(manifest, dest, where, defer)
        except BaseException:
            for path in created:
                shutil.rmtree(path, ignore_errors=True)
            raise
        return manifest, Deferred(
            partial(self._fetch_chunk, chunk_size=manifest.chunk_size, at=where), later,
            self.settings.transfer_concurrency)

    def _materialize(self, manifest: Manifest, dest: Path, where: _Where,
                     defer: Defer | None = None) -> dict[str, list[_Location]]:
        """Writes the checkpoint under ``dest``; returns the chunks left for later."""
        locations: dict[str, list[_Location]] = {}
        later: dict[str, list[_Location]] = {}
        chunk_size = manifest.chunk_size
        for name, entries in manifest.sections.items():
            root = os.fspath(dest / name)
            for entry in entries:
                full = os.path.join(root, entry.path)
                if entry.kind == KIND_DIR:
                    os.mkdir(full, 0o700)
                elif entry.kind == KIND_FILE:
                    fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600)
                    try:
                        os.ftruncate(fd, entry.size)
                    finally:
                        os.close(fd)
                    into = later if defer is not None and defer(name, entry.path) \
                        else locations
                    for digest, (offset, length) in zip(entry.chunks,
                                                        entry.chunk_spans(chunk_size),
                                                        strict=True):
                        into.setdefault(digest, []).append(
                            _Location(full, offset, length, f"{name}/{entry.path}"))
        self._fetch_chunks(locations, chunk_size, where)
        is_root = os.geteuid() == 0
        dirs: list[tuple[str, Entry]] = []
        for name, entries in manifest.sections.items():
            root = os.fspath(dest / name)
            for entry in entries:
                full = os.path.join(root, entry.path)
                if entry.kind == KIND_SYMLINK:
                    assert entry.target is not None
                    os.symlink(entry.target, full)
                elif entry.kind == KIND_FIFO:
                    os.mkfifo(full, 0o600)
                elif entry.kind == KIND_DIR:
                    dirs.append((full, entry))
                    continue
                elif entry.kind != KIND_FILE:
                    continue  # whiteouts stay manifest entries
                _apply_metadata(full, entry, is_root)
        for full, entry in sorted(dirs, key=lambda d: d[0].count("/"), reverse=True):
            _apply_metadata(full, entry, is_root)
        return later

    def _fetch_chunks(self, locations: Mapping[str, list[_Location]], chunk_size: int,
                      where: _Where) -> None:
        stop = threading.Event()
        jobs = [partial(self._fetch_chunk, digest, locs, stop, chunk_size=chunk_size, at=where)
                for digest, locs in locations.items()]
        _run_parallel(self.settings.transfer_concurrency, "hermit-download", jobs, _ignore, stop)

    def _fetch_chunk(self, digest: str, locs: list[_Location], stop: threading.Event, *,
                     chunk_size: int, at: _Where) -> None:
        if stop.is_set():
            return
        name = _object_name(at.cipher, digest)
        key = self.chunk_key(at.namespace, at.sandbox, name)
        where = f"checkpoint {at.namespace}/{at.checkpoint}: chunk {digest} of {locs[0].label}"
        data = self._cached_chunk(key, name, digest, chunk_size, at, where)
        if data is None:
            compressed = self._get_chunk(key, where, chunk_size)
            data = self._open_chunk(compressed, name, digest, chunk_size, at.cipher, where)
            self._cache_put(key, compressed, at.tally)
            if at.tally is not None:
                at.tally.miss()
        for loc in locs:
            if len(data) != loc.length:
                raise CheckpointRefused(
                    f"checkpoint {at.namespace}/{at.checkpoint}: chunk {digest} of {loc.label} "
                    f"has {len(data)} bytes, the manifest expects {loc.length}")
            _write_all(loc.path, loc.offset, data)

    def _get_chunk(self, key: str, where: str, chunk_size: int) -> bytes:
        """A chunk's stored object, from S3."""
        try:
            return self._get(key, "download chunk", 2 * chunk_size + (1 << 20))
        except CheckpointRefused as exc:
            raise CheckpointRefused(f"{where} is too large: {exc}") from None
        except Exception as exc:
            if is_not_found(exc):
                raise CheckpointRefused(f"{where} is missing from the store") from None
            raise

    def _open_chunk(self, compressed: bytes, name: str, digest: str, chunk_size: int,
                    cipher: ChunkCipher | None, where: str) -> bytes:
        """A chunk's bytes from its stored object: unsealed, decompressed and checked
        against ``digest``; CheckpointRefused when any of that fails."""
        if cipher is not None:
            try:
                compressed = cipher.open(name, compressed)
            except CheckpointRefused as exc:
                raise CheckpointRefused(f"{where} is refused: {exc}") from None
        try:
            data = self._decompressor().decompress(compressed, max_output_size=chunk_size)
        except zstandard.ZstdError as exc:
            raise CheckpointRefused(f"{where} is corrupt: cannot decompress ({exc})") from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise CheckpointRefused(f"{where} is corrupt: its content has sha256 {actual}")
        return data

    # -- the node-local chunk cache (chunkcache.py) ------------------------------------

    def _cache_name(self, key: str) -> str:
        return entry_name(f"{self._endpoint}\n{self.settings.bucket}", key)

    def _cached_chunk(self, key: str, name: str, digest: str, chunk_size: int, at: _Where,
                      where: str) -> bytes | None:
        """The chunk's bytes from the cache, verified exactly as from S3; None when it is
        not there or fails (a failed entry is deleted: the caller fetches it from S3)."""
        if self.cache is None:
            return None
        entry = self._cache_name(key)
        compressed = self.cache.get(entry)
        if compressed is None:
            return None
        try:
            data = self._open_chunk(compressed, name, digest, chunk_size, at.cipher, where)
        except CheckpointRefused as exc:
            log.warning("chunk cache: dropping a bad entry (%s); fetching it from S3", exc)
            self.cache.discard(entry)
            return None
        if at.tally is not None:
            at.tally.hit()
        return data

    def _cache_put(self, key: str, compressed: bytes, tally: CacheTally | None) -> bool:
        """Keeps a verified chunk object in the cache (when there is one)."""
        if self.cache is None or not self.cache.put(self._cache_name(key), compressed):
            return False
        if tally is not None:
            tally.stored(len(compressed))
        return True

    def prefetch(self, namespace: str, sandbox: str, checkpoint: str, *, expect_uid: str,
                 stop: threading.Event, expect_digest: str | None = None,
                 expect_parent: str | None = None,
                 expect_lineage: tuple[str, ...] | None = None,
                 tally: CacheTally | None = None, workers: int = 2) -> int:
        """Fetches the chunks of a checkpoint the cache lacks into the cache, each verified
        as a download verifies it, the manifest opened and bound as for a download. Stops
        when ``stop`` is set or once it stored as many bytes as the cache holds. Returns
        the bytes it stored (0 without a cache)."""
        if self.cache is None:
            return 0
        cache = self.cache
        opened = self._open_manifest(Expected(namespace, sandbox, checkpoint, expect_uid,
                                              expect_parent, expect_lineage), expect_digest)
        manifest = opened.manifest
        _check_binding(manifest, namespace, sandbox, checkpoint, expect_uid)
        tally = tally if tally is not None else CacheTally()
        at = _Where(namespace, sandbox, checkpoint, opened.cipher, tally)

        def one(digest: str) -> None:
            if stop.is_set() or tally.stored_bytes >= cache.max_bytes:
                return
            name = _object_name(at.cipher, digest)
            key = self.chunk_key(namespace, sandbox, name)
            if self._cache_name(key) in cache:
                return
            where = f"checkpoint {namespace}/{checkpoint}: chunk {digest}"
            try:
                compressed = self._get_chunk(key, where, manifest.chunk_size)
                self._open_chunk(compressed, name, digest, manifest.chunk_size, at.cipher,
                                 where)
            except CheckpointRefused as exc:  # missing or bad: not cached, the rest goes on
                log.warning("prefetch: %s", exc)
                return
            self._cache_put(key, compressed, tally)

        jobs = [partial(one, d) for d in sorted(manifest.chunk_digests())]
        _run_parallel(workers, "hermit-prefetch", jobs, _ignore, threading.Event())
        return tally.stored_bytes


# (section, path inside it) -> True: a download leaves that file's chunks to a Deferred.
Defer = Callable[[str, str], bool]
# (file path, offset, length) of bytes that landed, verified.
Landed = Callable[[str, int, int], None]


class Deferred:
    """Chunks a download left for later (``download_deferred``), fetched while their files
    are already in use: the chunks under given ranges first (``fetch_ranges``), then the
    rest (``fetch_rest``), each as soon as someone waits for it."""

    def __init__(self, fetch_one: Callable[[str, list[_Location], threading.Event], None],
                 locations: dict[str, list[_Location]], workers: int) -> None:
        self._fetch_one = fetch_one
        self._locations = locations
        self._workers = workers
        self._order = list(locations)
        self._taken: set[str] = set()
        self._lock = threading.Lock()
        self.stop = threading.Event()

    @property
    def bytes_total(self) -> int:
        return sum(loc.length for locs in self._locations.values() for loc in locs)

    def _under(self, path: str, offset: int, length: int) -> list[str]:
        return [d for d, locs in self._locations.items() for loc in locs
                if loc.path == path and loc.offset < offset + length
                and offset < loc.offset + loc.length]

    def _fetch(self, digest: str, landed: Landed) -> None:
        locs = self._locations[digest]
        self._fetch_one(digest, locs, self.stop)
        if self.stop.is_set():
            raise CheckpointFailed("the download was stopped")
        for loc in locs:
            landed(loc.path, loc.offset, loc.length)

    def _take(self, digests: Iterable[str]) -> str | None:
        with self._lock:
            for digest in digests:
                if digest not in self._taken:
                    self._taken.add(digest)
                    return digest
        return None

    def fetch_ranges(self, ranges: Iterable[tuple[str, int, int]], landed: Landed) -> None:
        """Fetches (now, in parallel) the chunks under ``ranges`` (path, offset, length)."""
        wanted = list(dict.fromkeys(d for r in ranges for d in self._under(*r)))
        jobs = [partial(self._fetch, d, landed) for d in wanted if self._take([d])]
        _run_parallel(self._workers, "hermit-download", jobs, _ignore, self.stop)

    def fetch_rest(self, landed: Landed, wanted: Callable[[], tuple[str, int, int] | None], *,
                   bulk: threading.Event | None = None,
                   idle: Callable[[], None] = lambda: time.sleep(0.01)) -> None:
        """Fetches every chunk not fetched yet, a chunk under ``wanted()`` first, the others
        only once ``bulk`` is set (None: at once); ``idle()`` waits a little for either.
        Raises the first failure once the other workers stopped."""
        errors: list[BaseException] = []

        def work() -> None:
            try:
                while not self.stop.is_set():
                    want = wanted()
                    digest = want and self._take(self._under(*want))
                    if not digest and (bulk is None or bulk.is_set()):
                        digest = self._take(self._order)
                        if digest is None:
                            return
                    if digest:
                        self._fetch(digest, landed)
                    elif len(self._taken) == len(self._order):
                        return
                    else:
                        idle()
            except BaseException as exc:
                errors.append(exc)
                self.stop.set()

        threads = [threading.Thread(target=work, name=f"hermit-deferred-{i}", daemon=True)
                   for i in range(max(1, min(self._workers, len(self._order))))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]


def _settle_staged(state: _UploadState) -> None:
    """Before ``finish`` uploads the rest (staging is over): only chunks the store holds
    count as there. A staged PUT that failed left its name claimed, and a chunk staged
    meanwhile with the same content took it for uploaded: both are uploaded again."""
    with state.lock:
        state.claimed = set(state.sizes)
        state.staged = {key: digest for key, digest in state.staged.items()
                        if _object_name(state.cipher, digest) in state.sizes}


class UploadSession:
    """One upload under way (``CheckpointStore.begin_upload``): chunks of files still being
    written may be PUT ahead (``stage``) while their writer goes on; ``finish`` uploads
    everything else, then the manifest, exactly as ``upload`` does. Until ``finish``
    has written the manifest nothing is a checkpoint: staged chunks are just chunks."""

    def __init__(self, store: CheckpointStore, binding: Binding, context: Context,
                 keys: _DataKey | None, state: _UploadState, deadline: float | None,
                 started: float) -> None:
        self.store, self.binding, self.context = store, binding, context
        self.keys, self.state, self.deadline, self.started = keys, state, deadline, started

    def stage(self, path: str, offset: int, length: int) -> None:
        """Hashes and (unless the store has it) PUTs bytes ``offset..offset+length`` of
        the file at ``path`` as one chunk; thread-safe. The caller promises those bytes
        are final (an append-only file written past them): ``finish`` uses the digest
        for a chunk with that path, offset and length without reading it again. Every
        ``stage`` call must have returned before ``finish``; a failed one only means
        ``finish`` uploads that chunk itself."""
        self.store._stage(self, path, offset, length)

    def finish(self, sections: Mapping[str, Path], restore: Mapping[str, Any], *,
               on_progress: ProgressCallback | None = None,
               layouts: Layouts | None = None) -> UploadResult:
        """Uploads the rest of ``sections`` and writes the manifest (``upload``)."""
        return self.store._finish(self, sections, restore, on_progress, layouts)


@dataclass(frozen=True)
class _Where:
    """The checkpoint a download fetches chunks for, and their cipher (None: plain)."""

    namespace: str
    sandbox: str
    checkpoint: str
    cipher: ChunkCipher | None
    tally: CacheTally | None = None  # chunks found in the cache, and fetched


def _check_binding(manifest: Manifest, namespace: str, sandbox: str, checkpoint: str,
                   expect_uid: str) -> None:
    """A manifest must name the checkpoint, sandbox and sandbox uid it is read for."""
    b = manifest.binding
    if (b.namespace, b.sandbox, b.sandbox_uid, b.checkpoint) != \
            (namespace, sandbox, expect_uid, checkpoint):
        raise CheckpointRefused(
            f"checkpoint {namespace}/{checkpoint} belongs to sandbox {b.namespace}/{b.sandbox} "
            f"(uid {b.sandbox_uid}, checkpoint {b.checkpoint}), not {namespace}/{sandbox} "
            f"(uid {expect_uid})")


def _object_name(cipher: ChunkCipher | None, digest: str) -> str:
    """The object name of the chunk with plaintext digest ``digest``."""
    return digest if cipher is None else cipher.name(digest)


def _apply_metadata(path: str, entry: Entry, is_root: bool) -> None:
    if is_root:
        os.chown(path, entry.uid, entry.gid, follow_symlinks=False)
    if entry.kind != KIND_SYMLINK:
        os.chmod(path, entry.mode)
    os.utime(path, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
