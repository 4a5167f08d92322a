"""Sealed checkpoints: client-side encryption and signing of chunks and manifests.

Pure functions and small classes over the ``cryptography`` library; the store
(the store package) decides what goes where on S3. See docs/security.md, "Sealed checkpoints".

- Each sandbox (namespace, name, uid) has a random 32-byte data key (DEK), kept on S3
  only wrapped by a key-encryption key (KEK) through a ``KeyWrapper``. The shipped
  wrapper, ``KeyringWrapper``, holds KEKs from a Kubernetes Secret (``current: <id>``
  and ``<id>: <base64 of 32 bytes>``); the operator's key service can use AWS KMS
  instead (hermit_operator.kms).
- A chunk is zstd-compressed, then encrypted with AES-256-GCM under the DEK. Its
  object name is HMAC(DEK, plaintext digest): the same chunk of the same sandbox is
  the same object (dedup) and names reveal nothing about the plaintext. Its nonce is
  HMAC(DEK, name, sha256 of the bytes encrypted): deterministic, and a different
  input can never reuse a nonce.
- A manifest is encrypted under the DEK and signed with HMAC-SHA256 under a key
  derived from the DEK (format 3; format 2 signed under the KEK and is still read),
  over the namespace, sandbox, uid, checkpoint name, parent checkpoint and uid lineage
  it is bound to, and the wrapped DEK. ``open_manifest`` checks that binding, opens the
  wrapped DEK for exactly that context and verifies the signature before it decrypts
  anything; a failure is a ``CheckpointRefused``.
- A fork inherits its source's DEK (the lineage grows by the fork's uid), so the
  chunks of a fork and of its source have the same names; a DEK record is bound to
  its sandbox and lineage and opens for no other.

Key bytes never appear in messages, reprs or logs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from hermit_common import bounded
from hermit_common.errors import CheckpointRefused, SettingsError
from hermit_common.pin import Pin
from hermit_common.settings import SealSettings

__all__ = ["CURRENT_KEY", "Bound", "ChunkCipher", "Context", "KeyWrapper", "Keyring",
           "KeyringWrapper", "Opened", "Sealing", "Wrapped", "b64", "bound_of_context",
           "bound_of_signed", "check_lineage", "is_sealed",
           "new_dek", "open_manifest", "seal_manifest", "sealing_from", "unb64"]

KEY_BYTES: Final = 32
NONCE_BYTES: Final = 12
CURRENT_KEY: Final = "current"  # the Secret's key that names the KEK new checkpoints use
SEALED_FORMAT_V1: Final = 1  # binds namespace, sandbox, uid, checkpoint (still read)
SEALED_FORMAT_V2: Final = 2  # also the parent checkpoint and the uid lineage (still read)
# Signed under a key derived from the sandbox's data key, not the KEK: a node-agent that
# holds a sandbox's data key seals its checkpoints without asking anyone (with the key
# service, an operator outage cannot fail a preemption checkpoint).
SEALED_FORMAT: Final = 3
SEALED_FORMATS: Final = (SEALED_FORMAT_V1, SEALED_FORMAT_V2, SEALED_FORMAT)
_DEK_SIGN_INFO: Final = b"hermit/dek/manifest-signature/v1"
MAX_LINEAGE: Final = 64  # a fork of a fork of ...: beyond, a fork starts a new lineage
_UID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_KEY_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_CHUNK_MAGIC: Final = b"HSC1"
_WRAP_INFO: Final = b"hermit/kek/wrap/v1"
_SIGN_INFO: Final = b"hermit/kek/manifest-signature/v1"
_ENVELOPE_FIELDS: Final = frozenset(
    {"sealed", "context", "kek", "dek", "nonce", "ciphertext", "signature"})


def _canonical(data: object) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object, what: str, where: str = "sealed manifest field") -> bytes:
    if not isinstance(text, str):
        raise CheckpointRefused(f"{where} {what} is not a string")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise CheckpointRefused(f"{where} {what} is not base64") from None
    # Only the one canonical encoding: a changed padding bit decodes to the same bytes,
    # and a sealed manifest must not take any change without being refused.
    if b64(data) != text:
        raise CheckpointRefused(f"{where} {what} is not canonical base64")
    return data


def new_dek() -> bytes:
    """A fresh random data key."""
    return os.urandom(KEY_BYTES)


@dataclass(frozen=True)
class Context:
    """What sealed data is bound to: a sandbox (its uid and lineage) and, for a manifest,
    a checkpoint and its parent.

    ``lineage`` is the chain of sandbox uids that share the sandbox's data key, the
    first sandbox first and ``sandbox_uid`` last (a fork inherits its source's key and
    appends its own uid). ``parent`` is the checkpoint the sandbox was restored from
    ("": started from scratch). An empty lineage is the first sealed format, which
    bound neither (``SEALED_FORMAT_V1``).
    """

    namespace: str
    sandbox: str
    sandbox_uid: str
    checkpoint: str = ""
    parent: str = ""
    lineage: tuple[str, ...] = ()

    def sandbox_bytes(self) -> bytes:
        """The DEK's context: the sandbox and its lineage, whichever checkpoint."""
        data: dict[str, Any] = {"namespace": self.namespace, "sandbox": self.sandbox,
                                "sandbox_uid": self.sandbox_uid}
        if self.lineage:
            data["lineage"] = list(self.lineage)
        return _canonical(data)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"namespace": self.namespace, "sandbox": self.sandbox,
                                "sandbox_uid": self.sandbox_uid, "checkpoint": self.checkpoint}
        if self.lineage:
            data.update(parent=self.parent, lineage=list(self.lineage))
        return data

    def describe(self) -> str:
        return f"{self.namespace}/{self.checkpoint} of sandbox {self.sandbox} " \
               f"(uid {self.sandbox_uid})"


def check_lineage(lineage: object, sandbox_uid: str) -> tuple[str, ...]:
    """``lineage`` as a tuple when it is well formed for ``sandbox_uid``: 1 to
    ``MAX_LINEAGE`` distinct uids ending with it. CheckpointRefused otherwise."""
    if not isinstance(lineage, (list, tuple)) or not 0 < len(lineage) <= MAX_LINEAGE or \
            not all(isinstance(u, str) and _UID_RE.match(u) for u in lineage) or \
            len(set(lineage)) != len(lineage) or lineage[-1] != sandbox_uid:
        raise CheckpointRefused(f"its sealed lineage is not 1 to {MAX_LINEAGE} distinct "
                                f"sandbox uids ending with {sandbox_uid!r:.80}")
    return tuple(lineage)


@dataclass(frozen=True)
class Wrapped:
    """A DEK wrapped by the KEK ``key_id``; as a sandbox's key record (``keys/<uid>``) it
    also names the lineage the DEK is bound to (empty: the first format, bound to the
    sandbox alone) and ``source``, the sandbox (same namespace) whose chunks a fork may
    copy instead of uploading them again ("": none)."""

    key_id: str
    blob: bytes = field(repr=False)
    lineage: tuple[str, ...] = ()
    source: str = ""

    def to_bytes(self) -> bytes:
        """As stored next to the sandbox's chunks."""
        data: dict[str, Any] = {"kek": self.key_id, "dek": b64(self.blob)}
        if self.lineage:
            data["lineage"] = list(self.lineage)
        if self.source:
            data["source"] = self.source
        return _canonical(data)

    @classmethod
    def from_bytes(cls, raw: bytes) -> Wrapped:
        """A key record's bytes, parsed within bounded.KEY_RECORD_MAX_BYTES."""
        try:
            data = bounded.load_json(raw, limit=bounded.KEY_RECORD_MAX_BYTES,
                                     what="the wrapped data key",
                                     max_containers=bounded.ENVELOPE_MAX_CONTAINERS)
        except bounded.TooLarge:
            raise
        except CheckpointRefused:
            raise CheckpointRefused("the wrapped data key is not JSON") from None
        if not isinstance(data, dict) or not {"kek", "dek"} <= set(data) <= \
                {"kek", "dek", "lineage", "source"} or \
                not isinstance(data["kek"], str) or not _KEY_ID_RE.match(data["kek"]):
            raise CheckpointRefused("the wrapped data key is malformed")
        lineage = data.get("lineage", [])
        source = data.get("source", "")
        if not isinstance(lineage, list) or not all(isinstance(u, str) for u in lineage) or \
                not isinstance(source, str) or (source and not _UID_RE.match(source)):
            raise CheckpointRefused("the wrapped data key is malformed")
        return cls(data["kek"], unb64(data["dek"], "dek"), tuple(lineage), source)


class KeyWrapper(Protocol):
    """Wraps data keys under a key-encryption key and signs manifests with it.

    The interface a cloud KMS implements (wrap/unwrap: KMS Encrypt/Decrypt with
    ``context`` as encryption context; sign/verify: KMS GenerateMac/VerifyMac), as
    hermit_operator.kms.AwsKmsWrapper does. Every
    method raises ``CheckpointRefused`` naming the key id when that key is unknown.
    """

    def current_key_id(self) -> str:
        """The key new checkpoints are sealed with."""
        ...

    def wrap(self, dek: bytes, context: bytes) -> Wrapped: ...

    def unwrap(self, wrapped: Wrapped, context: bytes) -> bytes: ...

    def sign(self, key_id: str, data: bytes) -> bytes: ...

    def verify(self, key_id: str, data: bytes, signature: bytes) -> bool: ...


def _check_key_id(key_id: str, where: str) -> str:
    if key_id == CURRENT_KEY or not _KEY_ID_RE.match(key_id):
        raise SettingsError(f"{where}: key id {key_id!r:.70} is invalid (use [A-Za-z0-9._-], "
                            f"not {CURRENT_KEY!r})")
    return key_id


@dataclass(frozen=True)
class Keyring:
    """KEKs by id and the id of the current one (the sealing Secret's content)."""

    current: str
    keys: Mapping[str, bytes] = field(repr=False)

    @classmethod
    def from_mapping(cls, data: Mapping[str, str], where: str) -> Keyring:
        """From the Secret's data: ``current`` names a key; other entries are base64 KEKs."""
        current = data.get(CURRENT_KEY, "").strip()
        if not current:
            raise SettingsError(f"{where}: no {CURRENT_KEY!r} entry naming the current key")
        keys: dict[str, bytes] = {}
        for key_id, text in data.items():
            if key_id == CURRENT_KEY:
                continue
            _check_key_id(key_id, where)
            try:
                raw = base64.b64decode(text.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise SettingsError(f"{where}: key {key_id!r} is not base64") from None
            if len(raw) != KEY_BYTES:
                raise SettingsError(f"{where}: key {key_id!r} has {len(raw)} bytes, "
                                    f"not {KEY_BYTES}")
            keys[key_id] = raw
        if current not in keys:
            raise SettingsError(f"{where}: the current key {current!r} is not in it")
        return cls(current=current, keys=keys)

    @classmethod
    def from_dir(cls, path: Path) -> Keyring:
        """From a mounted Secret volume: one file per entry (dot files are the volume's own)."""
        try:
            names = sorted(n for n in os.listdir(path) if not n.startswith("."))
            data = {n: (path / n).read_text() for n in names if (path / n).is_file()}
        except OSError as exc:
            raise SettingsError(f"cannot read the sealing keys in {path}: "
                                f"{exc.strerror or exc}") from None
        return cls.from_mapping(data, f"sealing keys in {path}")


class KeyringWrapper:
    """The shipped ``KeyWrapper``: KEKs from a Kubernetes Secret.

    ``load`` returns the keyring; it is called on each use, so a Secret volume that
    the kubelet updated (a rotation) takes effect without a restart. Wrapping is
    AES-256-GCM under a key derived from the KEK (HKDF-SHA256), the context as
    associated data; signing is HMAC-SHA256 under another derived key.
    """

    def __init__(self, load: Callable[[], Keyring]) -> None:
        self._load = load

    @classmethod
    def from_dir(cls, path: Path) -> KeyringWrapper:
        path = Path(path)
        Keyring.from_dir(path)  # fail at start-up, not at the first checkpoint
        return cls(lambda: Keyring.from_dir(path))

    def __repr__(self) -> str:
        return "KeyringWrapper()"

    def _kek(self, key_id: str, info: bytes) -> bytes:
        kek = self._load().keys.get(key_id)
        if kek is None:
            raise CheckpointRefused(
                f"sealing key {key_id!r} is not in the sealing Secret (removed by a rotation?)")
        return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                    info=info).derive(kek)

    def current_key_id(self) -> str:
        return self._load().current

    def wrap(self, dek: bytes, context: bytes) -> Wrapped:
        key_id = self.current_key_id()
        nonce = os.urandom(NONCE_BYTES)
        blob = nonce + AESGCM(self._kek(key_id, _WRAP_INFO)).encrypt(nonce, dek, context)
        return Wrapped(key_id, blob)

    def unwrap(self, wrapped: Wrapped, context: bytes) -> bytes:
        key = AESGCM(self._kek(wrapped.key_id, _WRAP_INFO))
        try:
            return key.decrypt(wrapped.blob[:NONCE_BYTES], wrapped.blob[NONCE_BYTES:], context)
        except (InvalidTag, ValueError):
            raise CheckpointRefused(
                f"the data key wrapped by sealing key {wrapped.key_id!r} does not open for "
                "this sandbox (tampered, or bound to another sandbox)") from None

    def sign(self, key_id: str, data: bytes) -> bytes:
        return hmac.new(self._kek(key_id, _SIGN_INFO), data, hashlib.sha256).digest()

    def verify(self, key_id: str, data: bytes, signature: bytes) -> bool:
        return hmac.compare_digest(self.sign(key_id, data), signature)


class ChunkCipher:
    """Names, seals and opens the chunks of one sandbox under its DEK."""

    def __init__(self, dek: bytes) -> None:
        if len(dek) != KEY_BYTES:
            raise ValueError("a data key has 32 bytes")
        self._mac_key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
                             info=b"hermit/dek/chunk-names/v1").derive(dek)
        self._aead = AESGCM(dek)

    def __repr__(self) -> str:
        return "ChunkCipher()"

    def name(self, digest: str) -> str:
        """The object name of the chunk whose plaintext has sha256 ``digest`` (hex)."""
        return hmac.new(self._mac_key, b"name\0" + bytes.fromhex(digest),
                        hashlib.sha256).hexdigest()

    def seal(self, name: str, data: bytes) -> bytes:
        """The stored bytes of chunk ``name``: magic, nonce, AES-GCM(data), deterministic."""
        inner = hashlib.sha256(data).digest()
        nonce = hmac.new(self._mac_key, b"nonce\0" + name.encode() + b"\0" + inner,
                         hashlib.sha256).digest()[:NONCE_BYTES]
        return _CHUNK_MAGIC + nonce + self._aead.encrypt(nonce, data, _chunk_aad(name))

    def open(self, name: str, body: bytes) -> bytes:
        """The bytes sealed as chunk ``name``; CheckpointRefused when they do not verify."""
        head = len(_CHUNK_MAGIC) + NONCE_BYTES
        if len(body) < head or not body.startswith(_CHUNK_MAGIC):
            raise CheckpointRefused("it is not a sealed chunk")
        try:
            return self._aead.decrypt(body[len(_CHUNK_MAGIC):head], body[head:],
                                      _chunk_aad(name))
        except InvalidTag:
            raise CheckpointRefused("it does not decrypt (tampered or swapped)") from None


def _chunk_aad(name: str) -> bytes:
    return b"hermit/chunk/v1\0" + name.encode()


def is_sealed(raw: bytes) -> bool:
    """Whether stored manifest bytes are a sealed envelope (else: a plain manifest).
    Bytes with more JSON containers than an envelope has are not one, and are not parsed
    here (a plain manifest is parsed once, by Manifest.from_json, within its bounds)."""
    try:
        data = bounded.load_json(raw, limit=bounded.STORED_MANIFEST_MAX_BYTES,
                                 what="the manifest",
                                 max_containers=bounded.ENVELOPE_MAX_CONTAINERS)
    except CheckpointRefused:
        return False
    return isinstance(data, dict) and "sealed" in data


def _signed_bytes(envelope: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in envelope.items() if k != "signature"}
    return _SIGNED_TAGS[SEALED_FORMATS.index(envelope["sealed"])] + _canonical(body)


def _dek_signature(dek: bytes, signed: bytes) -> bytes:
    """A format-3 manifest's signature: HMAC-SHA256 under a key derived from the DEK."""
    key = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None,
               info=_DEK_SIGN_INFO).derive(dek)
    return hmac.new(key, signed, hashlib.sha256).digest()


@dataclass(frozen=True)
class Bound:
    """The sandbox a wrap/unwrap context or signed manifest bytes are bound to: what a
    key service authorises a caller for (hermit_operator.keyaccess)."""

    namespace: str
    sandbox: str
    sandbox_uid: str

    def describe(self) -> str:
        return f"sandbox {self.namespace}/{self.sandbox} (uid {self.sandbox_uid})"


_SIGNED_TAGS: Final = (b"hermit/manifest/v1\0", b"hermit/manifest/v2\0",
                       b"hermit/manifest/v3\0")  # by SEALED_FORMATS


def _bound_of(data: object, what: str) -> Bound:
    if not isinstance(data, dict):
        raise CheckpointRefused(f"{what} is not a JSON object")
    names = [data.get(k) for k in ("namespace", "sandbox", "sandbox_uid")]
    if not all(isinstance(n, str) and n for n in names):
        raise CheckpointRefused(f"{what} names no namespace, sandbox and sandbox_uid")
    return Bound(*(str(n) for n in names))


def bound_of_context(context: bytes) -> Bound:
    """The sandbox a data key's context (``Context.sandbox_bytes``) names, parsed within
    bounds; CheckpointRefused when it is not one."""
    data = bounded.load_json(context, limit=bounded.KEY_RECORD_MAX_BYTES,
                             what="the key context",
                             max_containers=bounded.ENVELOPE_MAX_CONTAINERS)
    return _bound_of(data, "the key context")


def bound_of_signed(data: bytes) -> Bound:
    """The sandbox the signed bytes of a manifest (``_signed_bytes``) are bound to: its
    envelope's context, parsed within the stored manifest's bounds; CheckpointRefused
    when the bytes are not a manifest's."""
    tag = next((t for t in _SIGNED_TAGS if data.startswith(t)), None)
    if tag is None:
        raise CheckpointRefused("the signed bytes are not a sealed manifest's")
    body = bounded.load_json(data[len(tag):], limit=bounded.STORED_MANIFEST_MAX_BYTES,
                             what="the signed manifest",
                             max_containers=bounded.ENVELOPE_MAX_CONTAINERS)
    if not isinstance(body, dict):
        raise CheckpointRefused("the signed manifest is not a JSON object")
    return _bound_of(body.get("context"), "the signed manifest's context")


def seal_manifest(dek: bytes, wrapped: Wrapped, context: Context,
                  manifest_json: bytes) -> bytes:
    """The stored bytes of a sealed manifest: an envelope with ``wrapped`` (the DEK under
    the KEK, bound to the sandbox), signed under a key derived from ``dek`` over
    ``context``: its namespace, sandbox, uid, checkpoint, parent and lineage (which must
    be set, and ``wrapped`` bound to it). Only the DEK's holder can sign; only the KEK's
    can make a wrapped DEK that opens for that sandbox."""
    check_lineage(context.lineage, context.sandbox_uid)
    nonce = os.urandom(NONCE_BYTES)
    ciphertext = AESGCM(dek).encrypt(nonce, manifest_json, _canonical(context.to_dict()))
    envelope: dict[str, Any] = {
        "sealed": SEALED_FORMAT, "context": context.to_dict(), "kek": wrapped.key_id,
        "dek": b64(wrapped.blob), "nonce": b64(nonce), "ciphertext": b64(ciphertext),
    }
    envelope["signature"] = b64(_dek_signature(dek, _signed_bytes(envelope)))
    return _canonical(envelope)


def _parse_envelope(raw: bytes) -> dict[str, Any]:
    """The envelope's fields, parsed within bounded.STORED_MANIFEST_MAX_BYTES and the few
    JSON containers an envelope has (its bulk is one base64 string): cheap, before the
    signature is checked."""
    try:
        data = bounded.load_json(raw, limit=bounded.STORED_MANIFEST_MAX_BYTES,
                                 what="its sealed manifest",
                                 max_containers=bounded.ENVELOPE_MAX_CONTAINERS)
    except bounded.TooLarge:
        raise
    except CheckpointRefused:
        raise CheckpointRefused("its sealed manifest is not JSON") from None
    if not isinstance(data, dict) or set(data) != _ENVELOPE_FIELDS:
        raise CheckpointRefused("its sealed manifest does not have the envelope's fields")
    if data["sealed"] not in SEALED_FORMATS or isinstance(data["sealed"], bool):
        raise CheckpointRefused(f"its sealed manifest has format {data['sealed']!r:.20}, "
                                f"not one of {', '.join(map(str, SEALED_FORMATS))}")
    if not isinstance(data["kek"], str) or not _KEY_ID_RE.match(data["kek"]):
        raise CheckpointRefused("its sealed manifest names no valid key id")
    return data


def _claimed_context(claimed: object, sealed_format: int) -> Context:
    names = {"namespace", "sandbox", "sandbox_uid", "checkpoint"}
    if sealed_format != SEALED_FORMAT_V1:
        names |= {"parent", "lineage"}
    if not isinstance(claimed, dict) or set(claimed) != names or \
            not all(isinstance(v, str) for k, v in claimed.items() if k != "lineage"):
        raise CheckpointRefused("its sealed manifest has no valid context")
    if sealed_format == SEALED_FORMAT_V1:
        return Context(**claimed)
    lineage = check_lineage(claimed["lineage"], claimed["sandbox_uid"])
    return Context(**{**claimed, "lineage": lineage})


def _check_context(got: Context, expect: Pin) -> None:
    want = (expect.namespace, expect.sandbox, expect.checkpoint,
            expect.uid if expect.uid is not None else got.sandbox_uid)
    if (got.namespace, got.sandbox, got.checkpoint, got.sandbox_uid) != want:
        raise CheckpointRefused(f"it is sealed for checkpoint {got.describe()}, not for "
                                f"{expect.namespace}/{expect.checkpoint} of sandbox "
                                f"{expect.sandbox} (uid {expect.uid or 'any'})")
    if not got.lineage:
        return  # the first format signed no parent and no lineage: nothing to compare
    if expect.parent is not None and got.parent != expect.parent:
        raise CheckpointRefused(
            f"it is sealed with parent checkpoint {got.parent or '(none)'!r}, but the "
            f"Checkpoint records {expect.parent or '(none)'!r}")
    if expect.lineage is not None and got.lineage != expect.lineage:
        raise CheckpointRefused(
            f"it is sealed for sandbox lineage {'/'.join(got.lineage)}, but the "
            f"Checkpoint records {'/'.join(expect.lineage) or '(none)'}")


@dataclass(frozen=True)
class Opened:
    """A verified, decrypted manifest: its JSON, the sandbox's data key and the context
    it was signed for (an empty lineage: the first format)."""

    plain: bytes
    dek: bytes = field(repr=False)
    context: Context


def open_manifest(wrapper: KeyWrapper, raw: bytes, expect: Pin) -> Opened:
    """Verifies and decrypts a sealed manifest read where ``expect`` says.

    Formats 1 and 2 (signed under the KEK): the signature is checked first, then that
    the signed context is the one expected (namespace, sandbox, checkpoint, and uid,
    parent and lineage when given); only then is anything decrypted. A manifest of the
    first format (no parent, no lineage signed) is read under its own, older rules.

    Format 3 (signed under the DEK): the claimed context must be the one expected, then
    the wrapped DEK is opened for exactly that context (authenticated decryption under
    the KEK: no one without the KEK makes one that opens), then the signature over the
    whole envelope is checked with the DEK; only then is the manifest decrypted.

    Raises CheckpointRefused with the reason (without the checkpoint's name: callers add
    it).
    """
    envelope = _parse_envelope(raw)
    key_id = envelope["kek"]
    signature = unb64(envelope["signature"], "signature")
    signed = _signed_bytes(envelope)
    if envelope["sealed"] != SEALED_FORMAT and not wrapper.verify(key_id, signed, signature):
        raise CheckpointRefused(f"its manifest's signature (sealing key {key_id!r}) does "
                                "not verify: the manifest was altered")
    context = _claimed_context(envelope["context"], envelope["sealed"])
    _check_context(context, expect)
    dek = wrapper.unwrap(Wrapped(key_id, unb64(envelope["dek"], "dek")),
                         context.sandbox_bytes())
    if envelope["sealed"] == SEALED_FORMAT and \
            not hmac.compare_digest(_dek_signature(dek, signed), signature):
        raise CheckpointRefused("its manifest's signature does not verify under the "
                                "sandbox's data key: the manifest was altered")
    nonce = unb64(envelope["nonce"], "nonce")
    try:
        plain = AESGCM(dek).decrypt(nonce, unb64(envelope["ciphertext"], "ciphertext"),
                                    _canonical(context.to_dict()))
    except (InvalidTag, ValueError):
        raise CheckpointRefused("its manifest does not decrypt") from None
    return Opened(plain, dek, context)


@dataclass(frozen=True)
class Sealing:
    """How a store seals checkpoints: the KEK wrapper, and whether it still reads the
    plain (unsealed) checkpoints of before (for a migration only)."""

    wrapper: KeyWrapper
    accept_plain: bool = False


def sealing_from(settings: SealSettings) -> Sealing | None:
    """The store's sealing from the settings (None: no keys, checkpoints are plain): the
    key service's (HERMIT_SEAL_KEY_SERVICE_URL) or the mounted keys'. Raises SettingsError
    naming the setting when it cannot be used."""
    if settings.key_service_url is not None:
        from hermit_common.keyclient import RemoteKeyWrapper

        assert settings.key_service_ca_file is not None  # SealSettings.from_env checks it
        if not Path(settings.key_service_ca_file).is_file():
            raise SettingsError(f"HERMIT_SEAL_KEY_SERVICE_CA_FILE="
                                f"{settings.key_service_ca_file}: no such file")
        return Sealing(RemoteKeyWrapper(settings.key_service_url,
                                        ca_file=settings.key_service_ca_file,
                                        token_file=settings.key_service_token_file,
                                        server_name=settings.key_service_server_name),
                       accept_plain=settings.accept_plain)
    if settings.keys_dir is None:
        return None
    try:
        wrapper = KeyringWrapper.from_dir(Path(settings.keys_dir))
    except SettingsError as exc:
        raise SettingsError(f"HERMIT_SEAL_KEYS_DIR={settings.keys_dir}: {exc}") from None
    return Sealing(wrapper, accept_plain=settings.accept_plain)
