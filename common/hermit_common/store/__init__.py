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

``CheckpointStore`` is a facade over the package's modules: objects.py (the S3 client,
key layout, requests and retries), chunks.py (a chunk's stored form), datakeys.py (data
keys and the opening of manifests), upload.py and download.py (with the chunk cache).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from hermit_common import bounded, gc
from hermit_common.chunkcache import CacheTally, ChunkCache
from hermit_common.gc import CollectResult
from hermit_common.manifest import Binding, Manifest
from hermit_common.pin import Pin
from hermit_common.s3errors import CheckpointNotFound, ObjectExists
from hermit_common.seal import Sealing, Wrapped
from hermit_common.settings import StoreSettings
from hermit_common.store.chunks import Codec, object_name
from hermit_common.store.datakeys import DataKeys
from hermit_common.store.download import Defer, Deferred, Downloader, Landed
from hermit_common.store.objects import (
    Objects,
    Pace,
    ScopedClients,
    check_name,
    make_s3_client,
)
from hermit_common.store.upload import (
    Layouts,
    ProgressCallback,
    Uploader,
    UploadProgress,
    UploadResult,
    UploadSession,
)

__all__ = ["CheckpointNotFound", "CheckpointStore", "CollectResult", "Defer", "Deferred",
           "Landed", "Layouts", "ObjectExists", "Pace", "ProgressCallback", "ScopedClients",
           "UploadProgress", "UploadResult", "UploadSession", "check_name", "make_s3_client"]

log = logging.getLogger(__name__)


class CheckpointStore:
    """Checkpoints of sandboxes as manifests plus shared, content-addressed chunks: the
    facade over the store's objects (objects.py), data keys and manifests (datakeys.py),
    uploads (upload.py) and downloads (download.py)."""

    def __init__(self, settings: StoreSettings, client: Any | None = None, *,
                 sealing: Sealing | None = None, cache: ChunkCache | None = None,
                 scoped: ScopedClients | None = None) -> None:
        self.settings = settings
        self._objects = Objects(settings, client, scoped=scoped)
        self._keys = DataKeys(self._objects, sealing)
        codec = Codec()
        self._uploader = Uploader(self._objects, self._keys, codec)
        self._downloader = Downloader(self._objects, self._keys, codec, cache)

    @property
    def client(self) -> Any:
        """The S3 client (thread-safe; stores of other buckets may share it); None with
        scoped credentials."""
        return self._objects.client

    _client = client  # the name tests and older callers read

    @property
    def scoped(self) -> bool:
        return self._objects.scoped is not None

    @property
    def cache(self) -> ChunkCache | None:
        """Downloads read chunk objects from it first (chunkcache.py)."""
        return self._downloader.cache

    def _cache_name(self, key: str) -> str:
        """The chunk cache's entry name of the object at ``key`` (``Downloader.cache_name``)."""
        return self._downloader.cache_name(key)

    def _s3(self, key: str, reads: tuple[str, ...] = ()) -> Any:
        """The client for a request on ``key`` (``Objects.s3``)."""
        return self._objects.s3(key, reads)

    # -- keys ---------------------------------------------------------------

    def chunk_key(self, namespace: str, sandbox: str, digest: str) -> str:
        return self._objects.chunk_key(namespace, sandbox, digest)

    def manifest_key(self, namespace: str, sandbox: str, checkpoint: str) -> str:
        return self._objects.manifest_key(namespace, sandbox, checkpoint)

    def sandbox_key_key(self, namespace: str, sandbox: str, sandbox_uid: str) -> str:
        """Where a sealed store keeps the sandbox's wrapped data key."""
        return self._objects.sandbox_key_key(namespace, sandbox, sandbox_uid)

    def manifest_uri(self, namespace: str, sandbox: str, checkpoint: str) -> str:
        return self._objects.uri(self.manifest_key(namespace, sandbox, checkpoint))

    # -- sealing ----------------------------------------------------------------

    def _read_sandbox_key(self, key: str) -> Wrapped | None:
        """The sandbox key record at ``key`` (seal.Wrapped); None when there is none or
        it is unusable."""
        return self._keys.read_sandbox_key(key)

    def inherit_data_key(self, source: Pin, heir: CheckpointStore, namespace: str,
                         sandbox: str, sandbox_uid: str) -> bool:
        """Gives a fork (``sandbox``, ``sandbox_uid`` in ``heir``) the data key of the sealed
        checkpoint ``source`` it was restored from, bound to the source's lineage plus the
        fork's uid, unless the fork has a key already. Its chunks then get the same names
        as the source's (and, in the same store, are copied rather than uploaded by its
        first checkpoint). The source is verified exactly as a restore verifies it.
        False when nothing was inherited (plain, a lineage too long, a key already there)."""
        return self._keys.inherit(source, heir._keys, namespace, sandbox, sandbox_uid)

    # -- listing, reading, deleting ----------------------------------------------

    def ensure_bucket(self) -> None:
        """Creates the bucket if it does not exist (for tests and demos)."""
        self._objects.ensure_bucket()

    def list_chunks(self, namespace: str, sandbox: str) -> dict[str, int]:
        """The sandbox's stored chunks: object name (the digest, unless sealed) -> size."""
        return self._objects.list_chunks(namespace, sandbox)

    def list_checkpoints(self, namespace: str, sandbox: str) -> list[str]:
        """Names of the sandbox's complete checkpoints (those with a manifest), sorted."""
        return self._objects.list_checkpoints(namespace, sandbox)

    def delete_checkpoint(self, namespace: str, sandbox: str, checkpoint: str) -> None:
        """Deletes a checkpoint's manifest; its chunks go with ``collect_garbage``."""
        self._objects.delete(self.manifest_key(namespace, sandbox, checkpoint),
                             "delete checkpoint")

    def read_manifest(self, pin: Pin) -> tuple[Manifest, str]:
        """Fetches, verifies (when sealed) and parses the manifest ``pin`` names; returns
        it with the digest of its stored bytes. ``pin.uid``, ``.parent`` and
        ``.lineage``: what a sealed manifest must be signed for, when set; ``pin.digest``
        (a Checkpoint's status.manifestDigest): the stored bytes must have it, checked
        before anything is parsed."""
        opened = self._keys.open_manifest(pin)
        return opened.manifest, opened.digest

    # -- garbage collection ------------------------------------------------------

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
        objects = self._objects
        checkpoints = f"{objects.sandbox_prefix(namespace, sandbox)}checkpoints/"
        manifests = {name: age for name, age in objects.ages(checkpoints, "list checkpoints")
                     if name.endswith("/manifest.json")}
        stored = {name.removesuffix("/manifest.json"): age for name, age in manifests.items()}
        gone = [] if keep is None else gc.doomed(stored, keep, min_age_seconds)
        if not objects.delete_many([f"{checkpoints}{n}/manifest.json" for n in gone],
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
        prefix = f"{objects.sandbox_prefix(namespace, sandbox)}chunks/"
        chunks = gc.doomed(dict(objects.ages(prefix, "list chunks")), referenced,
                           min_age_seconds)
        if not objects.delete_many([f"{prefix}{c}" for c in chunks], "delete chunks",
                                   may_delete):
            return CollectResult(manifests=tuple(gone), aborted=True)
        if gone or chunks:
            log.info("collected %s/%s: %d manifests and %d chunks deleted", namespace, sandbox,
                     len(gone), len(chunks))
        return CollectResult(manifests=tuple(gone), chunks=tuple(chunks))

    def referenced_chunks(self, namespace: str, sandbox: str, checkpoint: str) -> set[str]:
        """The object names (under ``chunks/``) of the chunks a checkpoint references."""
        opened = self._keys.open_manifest(Pin(namespace, sandbox, checkpoint))
        return {object_name(opened.cipher, d) for d in opened.manifest.chunk_digests()}

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
        return self._uploader.begin(self, binding, deadline=deadline, parent=parent,
                                    pace=pace)

    # What an UploadSession calls; a subclass may upload its own way (bench/turnbench).
    def _stage(self, session: UploadSession, path: str, offset: int, length: int) -> None:
        """PUTs one chunk of a file ahead of ``finish`` (see ``UploadSession.stage``)."""
        self._uploader.stage(session, path, offset, length)

    def _finish(self, session: UploadSession, sections: Mapping[str, Path],
                restore: Mapping[str, Any], on_progress: ProgressCallback | None,
                layouts: Layouts | None) -> UploadResult:
        """Uploads the rest and writes the manifest (``Uploader.finish``)."""
        return self._uploader.finish(session, sections, restore, on_progress, layouts)

    # -- download ---------------------------------------------------------------

    def download(self, pin: Pin, dest: Path) -> Manifest:
        """Fetches, verifies and writes checkpoint ``pin`` into ``dest/<section>/``; its
        manifest must be bound to ``pin.uid`` (required) and match the rest of ``pin``.

        Raises CheckpointRefused (foreign, tampered, malformed or unsafe
        checkpoint), CheckpointNotFound, or StoreUnavailable. On failure nothing
        is left under ``dest``; on success every byte has been verified.
        """
        return self.download_deferred(pin, dest)[0]

    def download_deferred(self, pin: Pin, dest: Path, *, defer: Defer | None = None,
                          tally: CacheTally | None = None) -> tuple[Manifest, Deferred]:
        """``download``, except that the chunks of the files ``defer`` picks are left to the
        returned Deferred: those files exist with their size and metadata, and their
        bytes (each chunk verified) land when it fetches them. ``tally`` counts the chunks
        found in the cache and those fetched from S3."""
        return self._downloader.download_deferred(pin, dest, defer=defer, tally=tally)

    def prefetch(self, pin: Pin, *, stop: threading.Event, tally: CacheTally | None = None,
                 workers: int = 2) -> int:
        """Fetches the chunks of a checkpoint the cache lacks into the cache, each verified
        as a download verifies it, the manifest opened and bound as for a download. Stops
        when ``stop`` is set or once it stored as many bytes as the cache holds. Returns
        the bytes it stored (0 without a cache)."""
        return self._downloader.prefetch(pin, stop=stop, tally=tally, workers=workers)
