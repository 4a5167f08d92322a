"""AWS KMS as the key service's ``seal.KeyWrapper`` (docs/security.md#a-cloud-kms).

The key-encryption key never leaves KMS: wrap and unwrap are KMS ``Encrypt`` and
``Decrypt`` of the 32-byte data key under a symmetric key (HERMIT_SEAL_KMS_KEY_ID), with
the SHA-256 of the DEK's context as encryption context, so a wrapped key opens for
that sandbox and lineage only. sign and verify are ``GenerateMac`` and ``VerifyMac``
under an HMAC key (HERMIT_SEAL_KMS_MAC_KEY_ID; a KMS key either encrypts or MACs, never
both), over a digest of the signed bytes (KMS takes at most 4096 bytes of message).

Hermit names the KEK by the KMS key's id (a UUID, or ``mrk-...``), which fits a key
record's ``kek`` field; ``Decrypt`` is given that id, so a blob made under another key
is refused. What KMS refuses (access, an unknown or disabled key, a ciphertext that does
not open) is ``CheckpointRefused`` naming the key; what it does not answer (throttling,
the network, its own errors) is ``KmsUnavailable``, which the key service answers 503
and the caller tries again: a KMS outage must not look like a key that is gone (the
store replaces a data key it is refused).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from typing import Any, Final

from hermit_common.errors import CheckpointRefused, HermitError, SettingsError
from hermit_common.seal import KeyWrapper, Wrapped
from hermit_common.settings import KeyServiceSettings
from hermit_operator.kmshttp import KmsUnavailable

__all__ = ["AwsKmsWrapper", "KmsUnavailable", "wrapper_from"]

log = logging.getLogger("hermit.operator.keys")

# KMS's own ceiling for a CiphertextBlob: anything larger is no KMS ciphertext.
MAX_WRAPPED_BYTES: Final = 6144
CONTEXT_KEY: Final = "hermit:context-sha256"
MAC_ALGORITHM: Final = "HMAC_SHA_256"
_MAC_INFO: Final = b"hermit/kms/manifest-signature/v1\0"
# A key id as a key record's "kek" field takes it (seal.py's rule).
_KEY_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# KMS's answers that mean "not with this key, not for this context": another try will
# not change them.
_REFUSED_CODES: Final = frozenset({
    "AccessDeniedException", "NotFoundException", "InvalidCiphertextException",
    "IncorrectKeyException", "DisabledException", "KMSInvalidStateException",
    "InvalidKeyUsageException", "InvalidGrantTokenException", "UnsupportedOperationException",
    "AccessDenied"})


def _code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str((response.get("Error") or {}).get("Code") or "")
    return ""


def _failure(exc: Exception, op: str, key_id: str) -> HermitError:
    code = _code(exc)
    if code in _REFUSED_CODES:
        return CheckpointRefused(f"KMS refused {op} with key {key_id!r}: {code}")
    return KmsUnavailable(f"KMS {op} with key {key_id!r} failed: {code or type(exc).__name__}")


def encryption_context(context: bytes) -> dict[str, str]:
    """The KMS encryption context of a DEK context: its SHA-256 (a lineage of 64 uids
    is longer than KMS takes; the digest binds the same bytes)."""
    return {CONTEXT_KEY: hashlib.sha256(context).hexdigest()}


def mac_message(key_id: str, data: bytes) -> bytes:
    """What GenerateMac sees for ``data`` signed under the KEK ``key_id``."""
    return _MAC_INFO + key_id.encode() + b"\0" + hashlib.sha256(data).digest()


class AwsKmsWrapper:
    """A ``seal.KeyWrapper`` over a boto3 ``kms`` client. ``key`` and ``mac_key`` are key
    ids, ARNs or aliases; the current key id is ``key``'s KeyId (DescribeKey, once)."""

    def __init__(self, client: Any, key: str, mac_key: str | None = None) -> None:
        self._client, self._key, self._mac_key = client, key, mac_key
        self._key_id: str | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AwsKmsWrapper(key={self._key!r}, mac_key={self._mac_key!r})"

    def current_key_id(self) -> str:
        with self._lock:
            if self._key_id is None:
                try:
                    meta = self._client.describe_key(KeyId=self._key)["KeyMetadata"]
                except Exception as exc:
                    raise _failure(exc, "DescribeKey", self._key) from None
                key_id = str(meta.get("KeyId") or "")
                if not _KEY_ID_RE.match(key_id) or meta.get("KeyUsage") != "ENCRYPT_DECRYPT":
                    raise CheckpointRefused(f"KMS key {self._key!r} is not a symmetric "
                                            f"encryption key with a usable id ({key_id!r:.80})")
                self._key_id = key_id
            return self._key_id

    def wrap(self, dek: bytes, context: bytes) -> Wrapped:
        key_id = self.current_key_id()
        try:
            out = self._client.encrypt(KeyId=key_id, Plaintext=dek,
                                       EncryptionContext=encryption_context(context))
        except Exception as exc:
            raise _failure(exc, "Encrypt", key_id) from None
        return Wrapped(key_id, bytes(out["CiphertextBlob"]))

    def unwrap(self, wrapped: Wrapped, context: bytes) -> bytes:
        if not wrapped.blob or len(wrapped.blob) > MAX_WRAPPED_BYTES:
            raise CheckpointRefused(f"the data key wrapped by KMS key {wrapped.key_id!r} has "
                                    f"{len(wrapped.blob)} bytes: no KMS ciphertext (1 to "
                                    f"{MAX_WRAPPED_BYTES})")
        try:
            out = self._client.decrypt(KeyId=wrapped.key_id, CiphertextBlob=wrapped.blob,
                                       EncryptionContext=encryption_context(context))
        except Exception as exc:
            if _code(exc) == "InvalidCiphertextException":
                raise CheckpointRefused(
                    f"the data key wrapped by KMS key {wrapped.key_id!r} does not open for "
                    "this sandbox (tampered, or bound to another sandbox)") from None
            raise _failure(exc, "Decrypt", wrapped.key_id) from None
        return bytes(out["Plaintext"])

    def _mac_key_for(self, key_id: str) -> str:
        if self._mac_key is None:
            raise CheckpointRefused(f"sealing key {key_id!r}: no KMS MAC key to sign or verify "
                                    "with (HERMIT_SEAL_KMS_MAC_KEY_ID)")
        if key_id != self.current_key_id():
            raise CheckpointRefused(f"sealing key {key_id!r} is not this key service's KMS "
                                    f"key ({self.current_key_id()!r}): it signs with no other")
        return self._mac_key

    def sign(self, key_id: str, data: bytes) -> bytes:
        mac_key = self._mac_key_for(key_id)
        try:
            out = self._client.generate_mac(KeyId=mac_key, MacAlgorithm=MAC_ALGORITHM,
                                            Message=mac_message(key_id, data))
        except Exception as exc:
            raise _failure(exc, "GenerateMac", mac_key) from None
        return bytes(out["Mac"])

    def verify(self, key_id: str, data: bytes, signature: bytes) -> bool:
        mac_key = self._mac_key_for(key_id)
        if not 0 < len(signature) <= 64:  # HMAC_SHA_512 at most
            return False
        try:
            out = self._client.verify_mac(KeyId=mac_key, MacAlgorithm=MAC_ALGORITHM,
                                          Message=mac_message(key_id, data), Mac=signature)
        except Exception as exc:
            if _code(exc) == "KMSInvalidMacException":
                return False
            raise _failure(exc, "VerifyMac", mac_key) from None
        return bool(out.get("MacValid"))


def make_kms_client(settings: KeyServiceSettings) -> Any:
    """A ``kms`` client with the SDK's credential chain (IRSA, instance profile)."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import NoRegionError

    # Within the key service's 10 s per request: the node-agent tries again itself.
    try:
        return boto3.session.Session().client(
            "kms", region_name=settings.kms_region, endpoint_url=settings.kms_endpoint,
            config=Config(retries={"mode": "standard", "max_attempts": 2},
                          connect_timeout=2, read_timeout=3))
    except NoRegionError:
        raise SettingsError("HERMIT_SEAL_KMS_REGION is needed: the SDK finds no region "
                            "(AWS_REGION) for KMS") from None


def wrapper_from(settings: KeyServiceSettings, client: Any = None) -> KeyWrapper:
    """The KMS wrapper of ``settings`` (HERMIT_SEAL_KMS_PROVIDER): SettingsError naming the
    setting when KMS refuses the key at start; a KMS that does not answer yet is asked
    again at the first use."""
    assert settings.kms_key_id
    if settings.kms_provider == "azure":
        from hermit_operator import keyvault

        return keyvault.wrapper_from(settings, client)
    if settings.kms_provider == "gcp":
        from hermit_operator import cloudkms

        return cloudkms.wrapper_from(settings, client)
    wrapper = AwsKmsWrapper(client if client is not None else make_kms_client(settings),
                            settings.kms_key_id, settings.kms_mac_key_id)
    try:
        wrapper.current_key_id()
    except CheckpointRefused as exc:
        raise SettingsError(f"HERMIT_SEAL_KMS_KEY_ID={settings.kms_key_id}: {exc}") from None
    except KmsUnavailable as exc:
        log.warning("key service: %s (asked again at the first request)", exc)
    return wrapper
