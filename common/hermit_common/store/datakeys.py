"""A store's data keys and the opening of its manifests: the sandbox key records a sealed
store keeps under ``keys/`` (made, re-wrapped, inherited by a fork), and a stored
manifest read, pinned to its digest, unsealed (or refused) and bound to the checkpoint
it is read for."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from hermit_common import bounded
from hermit_common.errors import CheckpointRefused
from hermit_common.manifest import Manifest, digest_bytes
from hermit_common.pin import Pin
from hermit_common.s3errors import CheckpointNotFound, StoreNotFound
from hermit_common.seal import (
    MAX_LINEAGE,
    ChunkCipher,
    Context,
    Sealing,
    Wrapped,
    check_lineage,
    is_sealed,
    new_dek,
    open_manifest,
)
from hermit_common.store.objects import Objects

log = logging.getLogger("hermit_common.store")


@dataclass(frozen=True)
class DataKey:
    """A sandbox's data key as an upload uses it: the key, its record (wrapped under the
    current KEK), the lineage it is bound to and the sandbox whose chunks may be copied."""

    dek: bytes = dataclasses.field(repr=False)
    wrapped: Wrapped
    lineage: tuple[str, ...]
    source: str = ""


@dataclass(frozen=True)
class Opened:
    """A manifest read from the store: parsed, with its stored digest, the cipher of its
    chunks (None: plain) and, sealed, its data key and signed context."""

    manifest: Manifest
    digest: str
    cipher: ChunkCipher | None
    dek: bytes | None = dataclasses.field(default=None, repr=False)
    context: Context | None = None


def check_binding(manifest: Manifest, namespace: str, sandbox: str, checkpoint: str,
                  expect_uid: str) -> None:
    """A manifest must name the checkpoint, sandbox and sandbox uid it is read for."""
    b = manifest.binding
    if (b.namespace, b.sandbox, b.sandbox_uid, b.checkpoint) != \
            (namespace, sandbox, expect_uid, checkpoint):
        raise CheckpointRefused(
            f"checkpoint {namespace}/{checkpoint} belongs to sandbox {b.namespace}/{b.sandbox} "
            f"(uid {b.sandbox_uid}, checkpoint {b.checkpoint}), not {namespace}/{sandbox} "
            f"(uid {expect_uid})")


class DataKeys:
    """The data keys and manifests of one store; ``sealing`` None: a plain store."""

    def __init__(self, objects: Objects, sealing: Sealing | None) -> None:
        self.objects = objects
        self.sealing = sealing

    def sandbox_dek(self, context: Context, deadline: float | None) -> DataKey:
        """The sandbox's data key, wrapped under the current KEK (made, or re-wrapped after
        a rotation or from the first record format, and stored when needed: a rotation
        keeps the key, so dedup goes on), with the lineage it is bound to."""
        assert self.sealing is not None
        wrapper = self.sealing.wrapper
        key = self.objects.sandbox_key_key(context.namespace, context.sandbox,
                                           context.sandbox_uid)
        stored = self.read_sandbox_key(key)
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
                    return DataKey(dek, stored, lineage, stored.source)
        dek = dek if dek is not None else new_dek()
        wrapped = self.write_sandbox_key(dataclasses.replace(context, lineage=lineage),
                                         dek, source, deadline)
        return DataKey(dek, wrapped, lineage, source)

    def write_sandbox_key(self, context: Context, dek: bytes, source: str,
                          deadline: float | None) -> Wrapped:
        """Stores ``dek`` as the sandbox's key record, bound to its lineage."""
        assert self.sealing is not None
        wrapped = self.sealing.wrapper.wrap(dek, context.sandbox_bytes())
        wrapped = dataclasses.replace(wrapped, lineage=context.lineage, source=source)
        key = self.objects.sandbox_key_key(context.namespace, context.sandbox,
                                           context.sandbox_uid)
        self.objects.put(key, wrapped.to_bytes(), "application/json", "write sandbox key",
                         deadline=deadline)
        return wrapped

    def read_sandbox_key(self, key: str) -> Wrapped | None:
        try:
            return Wrapped.from_bytes(self.objects.get(key, "read sandbox key",
                                                       bounded.KEY_RECORD_MAX_BYTES))
        except CheckpointRefused as exc:
            log.warning("the sandbox key record %s is unusable (%s): a new one replaces it",
                        key, exc)
            return None  # malformed or oversized: replaced by a new key
        except StoreNotFound:
            return None

    def inherit(self, source: Pin, heir: DataKeys, namespace: str, sandbox: str,
                sandbox_uid: str) -> bool:
        """``CheckpointStore.inherit_data_key``: gives a fork in ``heir``'s store the data
        key of the sealed checkpoint ``source``; False when nothing was inherited."""
        if self.sealing is None or heir.sealing is None:
            return False
        opened = self.open_manifest(source)
        if opened.dek is None or opened.context is None:
            return False
        lineage = (*(opened.context.lineage or (opened.context.sandbox_uid,)), sandbox_uid)
        if len(lineage) > MAX_LINEAGE or sandbox_uid in lineage[:-1]:
            return False
        key = heir.objects.sandbox_key_key(namespace, sandbox, sandbox_uid)
        if heir.read_sandbox_key(key) is not None:
            return False
        mine, theirs = self.objects.settings, heir.objects.settings
        same_store = (theirs.bucket, theirs.endpoint_url, theirs.prefix) \
            == (mine.bucket, mine.endpoint_url, mine.prefix)
        heir.write_sandbox_key(Context(namespace, sandbox, sandbox_uid, lineage=lineage),
                               opened.dek, source.sandbox if same_store else "", None)
        log.info("sandbox %s/%s inherits the data key of %s/%s (lineage of %d)", namespace,
                 sandbox, source.namespace, source.sandbox, len(lineage))
        return True

    # -- manifests --------------------------------------------------------------

    def unseal(self, raw: bytes, expect: Pin) -> tuple[bytes, bytes | None, Context | None]:
        """The manifest JSON in stored bytes ``raw``, and (sealed) its data key and signed
        context. Refuses what this store may not read or what does not verify."""
        where = f"checkpoint {expect.namespace}/{expect.checkpoint}"
        if not is_sealed(raw):
            if self.sealing is not None and not self.sealing.accept_plain:
                raise CheckpointRefused(
                    f"{where} is refused: it is not sealed; this node-agent reads only sealed "
                    "checkpoints (HERMIT_SEAL_ACCEPT_PLAIN=true reads plain ones, for a "
                    "migration)")
            return raw, None, None
        if self.sealing is None:
            raise CheckpointRefused(
                f"{where} is refused: it is sealed, and this node-agent has no sealing keys "
                "(HERMIT_SEAL_KEYS_DIR)")
        try:
            opened = open_manifest(self.sealing.wrapper, raw, expect)
        except CheckpointRefused as exc:
            raise CheckpointRefused(f"{where} is refused: {exc}") from None
        return opened.plain, opened.dek, opened.context

    def read_manifest_bytes(self, namespace: str, sandbox: str, checkpoint: str) -> bytes:
        key = self.objects.manifest_key(namespace, sandbox, checkpoint)
        try:
            return self.objects.get(key, "read manifest", bounded.STORED_MANIFEST_MAX_BYTES)
        except StoreNotFound:
            raise CheckpointNotFound(
                f"checkpoint {namespace}/{checkpoint} of sandbox {namespace}/{sandbox} "
                f"not found at {self.objects.uri(key)}") from None

    def open_manifest(self, expect: Pin) -> Opened:
        """Fetches a manifest (at most bounded.STORED_MANIFEST_MAX_BYTES, refused on its
        Content-Length before its body is read), checks its stored bytes against
        ``expect.digest`` (when set) before anything is parsed or decrypted, then unseals
        (the envelope's few fields parsed, its signature checked) and parses it."""
        namespace, checkpoint, expect_digest = expect.namespace, expect.checkpoint, expect.digest
        raw = self.read_manifest_bytes(namespace, expect.sandbox, checkpoint)
        actual = digest_bytes(raw)
        if expect_digest is not None and actual != expect_digest:
            raise CheckpointRefused(
                f"checkpoint {namespace}/{checkpoint} is refused: manifest digest "
                f"{actual} does not match the expected {expect_digest} (changed in the bucket "
                "since it was taken)")
        plain, dek, context = self.unseal(raw, expect)
        return Opened(Manifest.from_json(plain), actual,
                      ChunkCipher(dek) if dek is not None else None, dek, context)
