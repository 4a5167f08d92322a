"""Azure Key Vault as the key service's ``seal.KeyWrapper`` (docs/security.md#a-cloud-kms).

HERMIT_SEAL_KMS_KEY_ID names a Key Vault (or Managed HSM) key by its URL,
``https://VAULT.vault.azure.net/keys/NAME[/VERSION]``; without a version the key's
current version is asked once at start. The key's version (32 hex digits) is the KEK id a
key record names, so a record made before Key Vault rotated the key still opens with
the version that wrapped it.

Key Vault's wrapKey takes no associated data, so the DEK's context is bound twice:

- what is wrapped is the 32-byte DEK followed by the SHA-256 of its context, and unwrap
  checks that digest: a record moved to another sandbox unwraps to a digest that differs;
- with RSA-OAEP-256, anyone holding the public key can wrap a DEK of their choosing with
  any digest, and a format-3 manifest trusts a DEK that its KEK wrapped (seal.py). So the
  wrapped bytes, the version and the context digest are also signed (PS256) by the same
  key version, in Key Vault, and the signature is verified there before unwrapping: a
  blob that Key Vault did not make does not open. RSA-OAEP and RSA-PSS under one RSA key
  are a combination shown jointly secure, and one key keeps the version that wrapped and
  the version that signed the same. With AES key wrap (A256KW, Managed HSM only) the
  wrapped bytes are authenticated by the HSM's own key and no signature is added.

The blob is ``u16 length of the wrapped bytes | wrapped bytes | signature (RSA only)``.
What Key Vault refuses (401, 403, an unknown or disabled key, a blob that does not
unwrap) is ``CheckpointRefused`` naming the key; what it does not answer (the network,
429, its own errors, an oversized or garbled answer) is ``KmsUnavailable``, 503.
Requests go over ``requests`` (REST api-version 7.4) with a Microsoft Entra token from
the pod's workload identity, or a token file (HERMIT_SEAL_KMS_TOKEN_FILE).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, urlsplit

import requests

from hermit_common.errors import CheckpointRefused, SettingsError
from hermit_common.seal import Wrapped
from hermit_common.settings import KeyServiceSettings
from hermit_operator import kmshttp
from hermit_operator.kmshttp import KmsUnavailable

API_VERSION: Final = "7.4"
RSA_WRAP: Final = "RSA-OAEP-256"
AES_WRAP: Final = "A256KW"
WRAP_ALGORITHMS: Final = (RSA_WRAP, AES_WRAP)
SIGN_ALGORITHM: Final = "PS256"
DEK_BYTES: Final = 32
DIGEST_BYTES: Final = 32
# An RSA-4096 block is 512 bytes; AES key wrap of 64 bytes is 72.
MAX_PART_BYTES: Final = 512
MAX_WRAPPED_BYTES: Final = 2 + 2 * MAX_PART_BYTES
_WRAP_INFO: Final = b"hermit/keyvault/wrapped-dek/v1\0"
_MAC_INFO: Final = b"hermit/keyvault/manifest-signature/v1\0"
_VERSION_RE: Final = re.compile(r"^[0-9A-Fa-f]{32}$")
_NAME_RE: Final = re.compile(r"^[0-9A-Za-z-]{1,127}$")
_RSA_TYPES: Final = frozenset({"RSA", "RSA-HSM"})
_AES_TYPES: Final = frozenset({"oct", "oct-HSM"})
# Key Vault's error codes that a retry will not change.
_REFUSED_CODES: Final = frozenset({
    "Unauthorized", "Forbidden", "KeyNotFound", "NotFound", "BadParameter",
    "KeyDisabled", "Conflict", "ForbiddenByPolicy", "AccessDenied"})


class Refused(CheckpointRefused):
    """Key Vault said no; ``code`` is its error code (BadParameter: does not unwrap)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class KeyUrl:
    """A Key Vault key's URL, split: ``vault`` is ``https://HOST[:PORT]``."""

    vault: str
    name: str
    version: str | None

    @classmethod
    def parse(cls, url: str) -> KeyUrl:
        parts = urlsplit(url)
        segments = parts.path.strip("/").split("/")
        if parts.scheme != "https" or not parts.hostname or parts.query or parts.fragment \
                or parts.username or len(segments) not in (2, 3) or segments[0] != "keys" \
                or not _NAME_RE.match(segments[1]) \
                or (len(segments) == 3 and not _VERSION_RE.match(segments[2])):
            raise SettingsError(f"{url!r:.200} is not a Key Vault key URL "
                                "(https://VAULT.vault.azure.net/keys/NAME[/VERSION])")
        return cls(f"https://{parts.netloc}", segments[1],
                   segments[2] if len(segments) == 3 else None)

    def op(self, version: str, operation: str) -> str:
        return (f"{self.vault}/keys/{quote(self.name)}/{quote(version)}/{operation}"
                f"?api-version={API_VERSION}")

    def scope(self) -> str:
        """The Entra scope of the vault's host: VAULT.vault.azure.net asks for
        https://vault.azure.net/.default, a Managed HSM for https://managedhsm.azure.net."""
        host = urlsplit(self.vault).hostname or ""
        return f"https://{host.partition('.')[2] or host}/.default"


def context_digest(context: bytes) -> bytes:
    return hashlib.sha256(context).digest()


def wrap_signed_digest(version: str, context: bytes, wrapped: bytes) -> bytes:
    """The SHA-256 that the wrapping key signs for ``wrapped`` (PS256 takes a digest)."""
    return hashlib.sha256(_WRAP_INFO + version.encode() + b"\0" + context_digest(context) +
                          wrapped).digest()


def mac_digest(key_id: str, data: bytes) -> bytes:
    """What a manifest signature under the KEK ``key_id`` signs."""
    return hashlib.sha256(_MAC_INFO + key_id.encode() + b"\0" +
                          hashlib.sha256(data).digest()).digest()


def pack(wrapped: bytes, signature: bytes) -> bytes:
    return struct.pack(">H", len(wrapped)) + wrapped + signature


def unpack(blob: bytes, key_id: str, signed: bool) -> tuple[bytes, bytes]:
    """(wrapped, signature) of a blob, refused by its sizes before Key Vault is asked."""
    if not 2 < len(blob) <= MAX_WRAPPED_BYTES:
        raise CheckpointRefused(f"the data key wrapped by Key Vault key version {key_id!r} "
                                f"has {len(blob)} bytes: no Key Vault blob (3 to "
                                f"{MAX_WRAPPED_BYTES})")
    (size,) = struct.unpack(">H", blob[:2])
    wrapped, signature = blob[2:2 + size], blob[2 + size:]
    if not 0 < size <= MAX_PART_BYTES or len(wrapped) != size or \
            (signed and not 0 < len(signature) <= MAX_PART_BYTES) or \
            (not signed and signature):
        raise CheckpointRefused(f"the data key wrapped by Key Vault key version {key_id!r} "
                                "is malformed (its parts' sizes)")
    return wrapped, signature


def error_code(body: dict[str, Any]) -> str:
    err = body.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    return code[:80] if isinstance(code, str) else ""


class KeyVaultWrapper:
    """A ``seal.KeyWrapper`` over Key Vault's REST API. ``token`` returns a bearer token
    for the vault (``forget`` is called on it after a 401, when it has one)."""

    def __init__(self, key: KeyUrl, token: Callable[[], str], *,
                 algorithm: str = RSA_WRAP, http: requests.Session | None = None,
                 token_setting: str = "the workload identity") -> None:
        assert algorithm in WRAP_ALGORITHMS
        self._key, self._token, self._algorithm = key, token, algorithm
        self._http = http if http is not None else kmshttp.session()
        self._token_setting = token_setting
        self._version: str | None = key.version
        self._checked = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"KeyVaultWrapper(key={self._key!r}, algorithm={self._algorithm!r})"

    @property
    def _signed(self) -> bool:
        return self._algorithm == RSA_WRAP

    def _request(self, op: str, url: str, body: dict[str, Any] | None = None
                 ) -> dict[str, Any]:
        answer = kmshttp.bearer_call(self._http, self._token, url, body,
                                     f"Key Vault {op} of {self._key.name!r}")
        if answer.status == 200:
            return answer.body
        code = error_code(answer.body) or f"HTTP {answer.status}"
        if answer.status == 401:
            raise Refused(f"Key Vault refused {op} with key {self._key.name!r}: {code}: its "
                          f"token ({self._token_setting}) is not accepted", code)
        if kmshttp.unavailable_status(answer.status) or (code not in _REFUSED_CODES and \
                answer.status not in (400, 403, 404, 409)):
            raise KmsUnavailable(f"Key Vault {op} with key {self._key.name!r} failed: {code}")
        raise Refused(f"Key Vault refused {op} with key {self._key.name!r}: {code}", code)

    def current_key_id(self) -> str:
        with self._lock:
            if not self._checked:
                version = self._version or "current"
                url = (f"{self._key.vault}/keys/{quote(self._key.name)}"
                       f"{'/' + self._version if self._version else ''}"
                       f"?api-version={API_VERSION}")
                body = self._request("GetKey", url)
                self._version = self._check_key(body, version)
                self._checked = True
            assert self._version
            return self._version

    def _check_key(self, body: dict[str, Any], asked: str) -> str:
        key = body.get("key") if isinstance(body.get("key"), dict) else {}
        assert isinstance(key, dict)
        kid, kty, ops = key.get("kid"), key.get("kty"), key.get("key_ops")
        version = kid.rstrip("/").rsplit("/", 1)[-1] if isinstance(kid, str) else ""
        types = _RSA_TYPES if self._signed else _AES_TYPES
        needed = {"wrapKey", "unwrapKey"} | ({"sign", "verify"} if self._signed else set())
        attributes = body.get("attributes")
        if not _VERSION_RE.match(version) or kty not in types or \
                not isinstance(ops, list) or not needed <= set(ops) or \
                (isinstance(attributes, dict) and attributes.get("enabled") is False):
            raise CheckpointRefused(
                f"Key Vault key {self._key.name!r} ({asked}) is not an enabled "
                f"{'/'.join(sorted(types))} key with {', '.join(sorted(needed))} for "
                f"{self._algorithm} (kty {kty!r:.20}, version {version!r:.40})")
        return version

    def wrap(self, dek: bytes, context: bytes) -> Wrapped:
        version = self.current_key_id()
        out = self._request("wrapKey", self._key.op(version, "wrapkey"), {
            "alg": self._algorithm, "value": kmshttp.b64url(dek + context_digest(context))})
        wrapped = kmshttp.b64decode_field(out, "value", urlsafe=True, limit=MAX_PART_BYTES)
        signature = b""
        if self._signed:
            signature = self._sign(version, wrap_signed_digest(version, context, wrapped))
        return Wrapped(version, pack(wrapped, signature))

    def unwrap(self, wrapped: Wrapped, context: bytes) -> bytes:
        version = wrapped.key_id
        if not _VERSION_RE.match(version):
            raise CheckpointRefused(f"sealing key {version!r} is not a Key Vault key version "
                                    f"(of {self._key.name!r})")
        inner, signature = unpack(wrapped.blob, version, self._signed)
        not_this = CheckpointRefused(
            f"the data key wrapped by Key Vault key version {version!r} does not open for "
            "this sandbox (tampered, or bound to another sandbox)")
        if self._signed and not self._verify(version, wrap_signed_digest(version, context,
                                                                          inner), signature):
            raise not_this
        try:
            out = self._request("unwrapKey", self._key.op(version, "unwrapkey"),
                                {"alg": self._algorithm, "value": kmshttp.b64url(inner)})
        except Refused as exc:
            if exc.code == "BadParameter":  # the blob does not unwrap under this version
                raise not_this from None
            raise
        plain = kmshttp.b64decode_field(out, "value", urlsafe=True, limit=MAX_PART_BYTES)
        if len(plain) != DEK_BYTES + DIGEST_BYTES or \
                not hmac.compare_digest(plain[DEK_BYTES:], context_digest(context)):
            raise not_this
        return plain[:DEK_BYTES]

    def _sign(self, version: str, digest: bytes) -> bytes:
        out = self._request("sign", self._key.op(version, "sign"),
                            {"alg": SIGN_ALGORITHM, "value": kmshttp.b64url(digest)})
        return kmshttp.b64decode_field(out, "value", urlsafe=True, limit=MAX_PART_BYTES)

    def _verify(self, version: str, digest: bytes, signature: bytes) -> bool:
        out = self._request("verify", self._key.op(version, "verify"), {
            "alg": SIGN_ALGORITHM, "digest": kmshttp.b64url(digest),
            "value": kmshttp.b64url(signature)})
        valid = out.get("value")
        if not isinstance(valid, bool):
            raise KmsUnavailable(f"Key Vault verify of {self._key.name!r} answered no "
                                 "boolean 'value'")
        return valid

    def _signing_version(self, key_id: str) -> str:
        if not self._signed:
            raise CheckpointRefused(f"sealing key {key_id!r}: a Key Vault {AES_WRAP} key "
                                    "does not sign (manifests of format 3 are signed with "
                                    "their data key)")
        if not _VERSION_RE.match(key_id):
            raise CheckpointRefused(f"sealing key {key_id!r} is not a Key Vault key version "
                                    f"(of {self._key.name!r})")
        return key_id

    def sign(self, key_id: str, data: bytes) -> bytes:
        if key_id != self.current_key_id():
            raise CheckpointRefused(f"sealing key {key_id!r} is not this key service's Key "
                                    f"Vault key version ({self.current_key_id()!r}): it "
                                    "signs with no other")
        return self._sign(self._signing_version(key_id), mac_digest(key_id, data))

    def verify(self, key_id: str, data: bytes, signature: bytes) -> bool:
        version = self._signing_version(key_id)
        if not 0 < len(signature) <= MAX_PART_BYTES:
            return False
        # An older version of the same key verifies what it signed.
        return self._verify(version, mac_digest(key_id, data), signature)


def entra_token(key: KeyUrl, settings: KeyServiceSettings, http: requests.Session
                ) -> Callable[[], tuple[str, float]]:
    """Fetches a vault token with the pod's workload identity: the federated token file
    (AZURE_FEDERATED_TOKEN_FILE, rotated by the kubelet) as a client assertion for the
    application AZURE_CLIENT_ID in tenant AZURE_TENANT_ID."""
    tenant, client = settings.kms_azure_tenant_id, settings.kms_azure_client_id
    assertion_file = settings.kms_azure_federated_token_file
    assert tenant and client and assertion_file
    url = f"{settings.kms_azure_authority_host}/{quote(tenant)}/oauth2/v2.0/token"
    names = "AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_FEDERATED_TOKEN_FILE"

    def fetch() -> tuple[str, float]:
        form = {"grant_type": "client_credentials", "client_id": client,
                "scope": key.scope(),
                "client_assertion_type":
                    "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
                "client_assertion": kmshttp.read_token_file(assertion_file,
                                                            "AZURE_FEDERATED_TOKEN_FILE")}
        try:
            answer = kmshttp.call(http, "POST", url, form=form,
                                  limit=kmshttp.MAX_TOKEN_BYTES)
        except KmsUnavailable as exc:
            raise KmsUnavailable(f"Microsoft Entra ({url}): {exc}") from None
        if answer.status == 200:
            return kmshttp.token_answer(answer, "Microsoft Entra")
        if kmshttp.unavailable_status(answer.status):
            raise KmsUnavailable(f"Microsoft Entra answered HTTP {answer.status}")
        err = answer.body.get("error")
        raise CheckpointRefused(f"Microsoft Entra refused the workload identity ({names}): "
                                f"{err if isinstance(err, str) else answer.status!s:.80}")
    return fetch


def token_source(key: KeyUrl, settings: KeyServiceSettings, http: requests.Session
                 ) -> tuple[Callable[[], str], str]:
    """The vault's bearer tokens, and the setting they come from."""
    if settings.kms_token_file:
        path = settings.kms_token_file
        return (lambda: kmshttp.read_token_file(path, "HERMIT_SEAL_KMS_TOKEN_FILE"),
                "HERMIT_SEAL_KMS_TOKEN_FILE")
    return (kmshttp.CachedToken(entra_token(key, settings, http)),
            "AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_FEDERATED_TOKEN_FILE")


def wrapper_from(settings: KeyServiceSettings, http: Any = None) -> KeyVaultWrapper:
    """The Key Vault wrapper of ``settings``: SettingsError naming the setting when Key
    Vault refuses the key at start; one that does not answer yet is asked again later."""
    assert settings.kms_key_id
    key = KeyUrl.parse(settings.kms_key_id)
    session = http if http is not None else kmshttp.session()
    token, token_setting = token_source(key, settings, session)
    wrapper = KeyVaultWrapper(key, token, algorithm=settings.kms_azure_wrap_algorithm,
                              http=session, token_setting=token_setting)
    return kmshttp.probed_at_start(wrapper, settings.kms_key_id)
