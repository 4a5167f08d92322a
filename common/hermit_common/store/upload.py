"""Uploads: section trees scanned and cut into chunk tasks, chunks PUT in parallel (or
staged while their file is still written, or copied from a fork's source), then the
manifest, written last and never over another writer's."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from hermit_common import bounded
from hermit_common.errors import CheckpointFailed, CheckpointRefused
from hermit_common.manifest import (
    MAX_MANIFEST_BYTES,
    Binding,
    Manifest,
    Totals,
    check_section_name,
    digest_bytes,
    utc_now,
)
from hermit_common.s3errors import ObjectExists
from hermit_common.seal import ChunkCipher, Context, seal_manifest
from hermit_common.store.chunks import (
    Codec,
    is_zero,
    object_name,
    run_parallel,
    zero_body,
    zero_digest,
)
from hermit_common.store.datakeys import DataKey, DataKeys
from hermit_common.store.objects import Objects, Pace
from hermit_common.tree import KIND_FILE, Entry, scan_tree

log = logging.getLogger("hermit_common.store")


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
Layouts = Mapping[str, Mapping[str, tuple[int, ...]]]  # section -> file path -> chunk lengths


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


def _settle_staged(state: _UploadState) -> None:
    """Before ``finish`` uploads the rest (staging is over): only chunks the store holds
    count as there. A staged PUT that failed left its name claimed, and a chunk staged
    meanwhile with the same content took it for uploaded: both are uploaded again."""
    with state.lock:
        state.claimed = set(state.sizes)
        state.staged = {key: digest for key, digest in state.staged.items()
                        if object_name(state.cipher, digest) in state.sizes}


class _SessionOwner(Protocol):
    """What an UploadSession calls (CheckpointStore, or a subclass that uploads its own
    way: bench/turnbench/contenders.py)."""

    def _stage(self, session: UploadSession, path: str, offset: int, length: int) -> None:
        ...

    def _finish(self, session: UploadSession, sections: Mapping[str, Path],
                restore: Mapping[str, Any], on_progress: ProgressCallback | None,
                layouts: Layouts | None) -> UploadResult:
        ...


class UploadSession:
    """One upload under way (``CheckpointStore.begin_upload``): chunks of files still being
    written may be PUT ahead (``stage``) while their writer goes on; ``finish`` uploads
    everything else, then the manifest, exactly as ``upload`` does. Until ``finish``
    has written the manifest nothing is a checkpoint: staged chunks are just chunks."""

    def __init__(self, store: _SessionOwner, binding: Binding, context: Context,
                 keys: DataKey | None, state: _UploadState, deadline: float | None,
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


class Uploader:
    """The upload side of a CheckpointStore."""

    def __init__(self, objects: Objects, keys: DataKeys, codec: Codec) -> None:
        self.objects, self.keys, self.codec = objects, keys, codec

    def begin(self, owner: _SessionOwner, binding: Binding, *, deadline: float | None,
              parent: str, pace: Pace | None) -> UploadSession:
        """``CheckpointStore.begin_upload``: the data key, the chunks there already."""
        started = time.monotonic()
        context = Context(binding.namespace, binding.sandbox, binding.sandbox_uid,
                          binding.checkpoint, parent)
        keys = self.keys.sandbox_dek(context, deadline) if self.keys.sealing is not None \
            else None
        state = self._upload_state(binding.namespace, binding.sandbox, keys)
        state.pace = pace
        return UploadSession(owner, binding, context, keys, state, deadline, started)

    def stage(self, session: UploadSession, path: str, offset: int, length: int) -> None:
        """PUTs one chunk of a file ahead of ``finish`` (see ``UploadSession.stage``)."""
        b, state = session.binding, session.state
        task = _ChunkTask("", 0, 0, path, offset, length)
        done = self._upload_chunk(task, state, b.namespace, b.sandbox, session.deadline)
        with state.lock:
            state.staged[(path, offset, length)] = done.digest
            if done.uploaded_bytes:
                state.staged_new += 1
                state.staged_uploaded += done.uploaded_bytes

    def finish(self, session: UploadSession, sections: Mapping[str, Path],
               restore: Mapping[str, Any], on_progress: ProgressCallback | None,
               layouts: Layouts | None) -> UploadResult:
        """Uploads what was not staged, then the manifest (``CheckpointStore.upload``)."""
        binding, state, keys, deadline = (session.binding, session.state, session.keys,
                                          session.deadline)
        ns, sandbox = binding.namespace, binding.sandbox
        manifest_key = self.objects.manifest_key(ns, sandbox, binding.checkpoint)
        chunk_size = self.objects.settings.chunk_size_bytes
        scanned = _scan_sections(sections)
        cuts = _layouts_used(scanned, layouts, chunk_size)
        tasks, image_bytes = _chunk_tasks(sections, scanned, chunk_size, cuts)
        tally = _Tally(len(tasks), image_bytes, on_progress)
        _settle_staged(state)
        self._run_upload(tasks, state, ns, sandbox, deadline, tally.record)

        final, referenced, files = _with_chunks(scanned, tally.digests, cuts)
        stored_bytes = sum(state.sizes[object_name(state.cipher, d)] for d in referenced)
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
            assert self.keys.sealing is not None
            raw = seal_manifest(keys.dek, keys.wrapped,
                                dataclasses.replace(session.context, lineage=lineage), raw)
        self.put_manifest(manifest_key, raw, deadline)
        with state.lock:
            new, uploaded = tally.new + state.staged_new, tally.uploaded + state.staged_uploaded
        result = UploadResult(
            manifest_uri=self.objects.uri(manifest_key),
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

    def put_manifest(self, key: str, raw: bytes, deadline: float | None) -> None:
        """Writes a manifest that must not exist yet: two writers of one checkpoint never
        replace each other's. The same bytes already there are ours (a retried PUT whose
        first answer was lost); anything else is another writer's and fails this upload."""
        try:
            self.objects.put(key, raw, "application/json", "write manifest",
                             deadline=deadline, exclusive=True)
        except ObjectExists as exc:
            try:
                stored = self.objects.get(key, "read manifest",
                                          bounded.STORED_MANIFEST_MAX_BYTES)
            except Exception:
                stored = b""
            if stored != raw:
                raise CheckpointFailed(str(exc)) from None

    def _upload_state(self, ns: str, sandbox: str, keys: DataKey | None) -> _UploadState:
        """Which chunks the sandbox has; for a fork with none yet, which ones its source
        has (same data key, so the same names)."""
        existing = self.objects.list_chunks(ns, sandbox)
        cipher = ChunkCipher(keys.dek) if keys is not None else None
        if keys is None or not keys.source or keys.source == sandbox or existing:
            return _UploadState(existing, cipher)
        return _UploadState(existing, cipher, keys.source,
                            self.objects.list_chunks(ns, keys.source))

    def _run_upload(self, tasks: list[_ChunkTask], state: _UploadState, ns: str, sandbox: str,
                    deadline: float | None, on_done: Callable[[_ChunkDone], None]) -> None:
        """Runs the chunk tasks in the pool; the first failure stops the rest and is raised."""
        jobs = [partial(self._upload_chunk, t, state, ns, sandbox, deadline) for t in tasks]
        run_parallel(self.objects.settings.transfer_concurrency, "hermit-upload", jobs,
                     on_done, state.stop)

    def _upload_chunk(self, task: _ChunkTask, state: _UploadState, ns: str, sandbox: str,
                      deadline: float | None) -> _ChunkDone:
        if state.stop.is_set():
            raise CheckpointFailed("upload aborted")
        with state.lock:
            staged = state.staged.get((task.path, task.offset, task.length))
        if staged is not None:  # PUT (or found present) while the file was written
            return _ChunkDone(task, staged, 0)
        data = _read_exact(task.path, task.offset, task.length)
        zero = is_zero(data)
        digest = zero_digest(len(data)) if zero else hashlib.sha256(data).hexdigest()
        name = object_name(state.cipher, digest)
        with state.lock:
            if name in state.claimed:
                return _ChunkDone(task, digest, 0)
            state.claimed.add(name)
        if name in state.source_chunks and self._copy_chunk(state, ns, sandbox, name):
            with state.lock:
                state.sizes[name] = state.source_chunks[name]
            return _ChunkDone(task, digest, 0, copied=True)
        body = zero_body(len(data)) if zero else self.codec.compressor().compress(data)
        if state.cipher is not None:
            body = state.cipher.seal(name, body)
        self.objects.put(self.objects.chunk_key(ns, sandbox, name), body,
                         "application/octet-stream" if state.cipher else "application/zstd",
                         "upload chunk", state.stop, deadline, pace=state.pace)
        with state.lock:
            state.sizes[name] = len(body)
        return _ChunkDone(task, digest, len(body))

    def _copy_chunk(self, state: _UploadState, ns: str, sandbox: str, name: str) -> bool:
        """Copies chunk ``name`` from the fork's source inside the store; False when that
        fails (gone meanwhile, or refused): the caller uploads it instead."""
        source_key = self.objects.chunk_key(ns, state.source, name)
        dest_key = self.objects.chunk_key(ns, sandbox, name)
        try:
            self.objects.copy(source_key, dest_key, (state.source,))
        except Exception as exc:
            log.debug("cannot copy %s, uploading it: %s", source_key, type(exc).__name__)
            return False
        return True
