"""Google Cloud KMS as the key service's ``seal.KeyWrapper`` (docs/security.md#a-cloud-kms).

HERMIT_SEAL_KMS_KEY_ID names a symmetric CryptoKey
(``projects/P/locations/L/keyRings/R/cryptoKeys/K``, purpose ENCRYPT_DECRYPT). wrap is
``encrypt`` of the 32-byte DEK under the key's primary version, with the SHA-256 of the
DEK's context as ``additionalAuthenticatedData`` (Cloud KMS's AAD is authenticated by the
key: a record moved to another sandbox does not decrypt); unwrap is ``decrypt`` with the
same AAD, and Cloud KMS finds the version in the ciphertext, so records made before a
rotation still open. A key record names its KEK in at most 63 characters, which a
CryptoKey's name is not: the KEK id is ``gcp-`` and 32 hex digits of its SHA-256, and a
record naming another id is refused without asking Cloud KMS. sign and verify
(manifests of formats 1 and 2) are ``macSign``/``macVerify`` with an HMAC key version
(HERMIT_SEAL_KMS_MAC_KEY_ID, ``.../cryptoKeys/K/cryptoKeyVersions/N``).

Errors as with AWS KMS: what Cloud KMS refuses (401, 403, 404, a disabled key, a
ciphertext that does not decrypt) is ``CheckpointRefused`` naming the key; what it does
not answer (the network, 429, 5xx, an oversized or garbled answer) is ``KmsUnavailable``.
REST over ``requests`` with a token from the GKE metadata server (workload identity) or a
token file (HERMIT_SEAL_KMS_TOKEN_FILE).

Not tested against Cloud KMS or an emulator (none could be installed here): only its
pure parts are, with recorded answers (tests/unit/test_cloudkms.py).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from typing import Any, Final

import requests

from hermit_common.errors import CheckpointRefused
from hermit_common.seal import Wrapped
from hermit_common.settings import KeyServiceSettings
from hermit_operator import kmshttp
from hermit_operator.kmshttp import KmsUnavailable

DEFAULT_ENDPOINT: Final = "https://cloudkms.googleapis.com"
METADATA_TOKEN_URL: Final = ("http://169.254.169.254/computeMetadata/v1/instance/"
                             "service-accounts/default/token")
DEK_BYTES: Final = 32
# A Cloud KMS ciphertext of a 32-byte plaintext is under 200 bytes; its own ceiling for
# any ciphertext is 64 KiB + overhead, which no wrapped DEK comes near.
MAX_WRAPPED_BYTES: Final = 4096
MAX_MAC_BYTES: Final = 64  # HMAC_SHA512
_MAC_INFO: Final = b"hermit/cloudkms/manifest-signature/v1\0"
_SEG: Final = r"[A-Za-z0-9_-]{1,63}"
KEY_RE: Final = re.compile(rf"^projects/[a-z][a-z0-9.:-]{{0,62}}/locations/[a-z0-9-]{{1,63}}"
                           rf"/keyRings/{_SEG}/cryptoKeys/{_SEG}$")
MAC_KEY_RE: Final = re.compile(KEY_RE.pattern[:-1] + r"/cryptoKeyVersions/[0-9]{1,10}$")
# Cloud KMS statuses a retry will not change.
_REFUSED_STATUS: Final = frozenset({400, 401, 403, 404, 409})


def kek_id(key: str) -> str:
    """The KEK id of a CryptoKey name, as a key record's ``kek`` field takes it."""
    return "gcp-" + hashlib.sha256(key.encode()).hexdigest()[:32]


def aad(context: bytes) -> bytes:
    return hashlib.sha256(context).digest()


def mac_message(key_id: str, data: bytes) -> bytes:
    return _MAC_INFO + key_id.encode() + b"\0" + hashlib.sha256(data).digest()


def error_status(body: dict[str, Any]) -> str:
    err = body.get("error")
    status = err.get("status") if isinstance(err, dict) else None
    return status[:40] if isinstance(status, str) else ""


class CloudKmsWrapper:
    """A ``seal.KeyWrapper`` over Cloud KMS's REST API (v1)."""

    def __init__(self, key: str, token: Callable[[], str], *, mac_key: str | None = None,
                 endpoint: str = DEFAULT_ENDPOINT, http: requests.Session | None = None,
                 token_setting: str = "the GKE workload identity") -> None:
        self._key, self._mac_key, self._token = key, mac_key, token
        self._endpoint = endpoint.rstrip("/")
        self._http = http if http is not None else kmshttp.session()
        self._token_setting = token_setting
        self._id = kek_id(key)
        self._checked = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CloudKmsWrapper(key={self._key!r}, mac_key={self._mac_key!r})"

    def _request(self, op: str, resource: str, body: dict[str, Any] | None = None
                 ) -> tuple[int, str, dict[str, Any]]:
        """(status, Cloud KMS's error status, body); raises what is no answer."""
        url = f"{self._endpoint}/v1/{resource}" + (f":{op}" if body is not None else "")
        answer = kmshttp.bearer_call(self._http, self._token, url, body,
                                     f"Cloud KMS {op} with key {resource!r}")
        status = error_status(answer.body)
        if answer.status == 200:
            return 200, "", answer.body
        if answer.status == 401:
            raise CheckpointRefused(f"Cloud KMS refused {op} with key {resource!r}: "
                                    f"UNAUTHENTICATED: its token ({self._token_setting}) "
                                    "is not accepted")
        if answer.status not in _REFUSED_STATUS:
            raise KmsUnavailable(f"Cloud KMS {op} with key {resource!r} failed: "
                                 f"{status or f'HTTP {answer.status}'}")
        return answer.status, status or f"HTTP {answer.status}", answer.body

    def _ok(self, op: str, resource: str, body: dict[str, Any] | None = None
            ) -> dict[str, Any]:
        status, code, out = self._request(op, resource, body)
        if status != 200:
            raise CheckpointRefused(f"Cloud KMS refused {op} with key {resource!r}: {code}")
        return out

    def current_key_id(self) -> str:
        with self._lock:
            if not self._checked:
                meta = self._ok("get", self._key)
                primary = meta.get("primary")
                state = primary.get("state") if isinstance(primary, dict) else None
                if meta.get("purpose") != "ENCRYPT_DECRYPT" or state != "ENABLED":
                    raise CheckpointRefused(
                        f"Cloud KMS key {self._key!r} is not a symmetric ENCRYPT_DECRYPT "
                        f"key with an enabled primary version (purpose "
                        f"{meta.get('purpose')!r:.40}, primary {state!r:.40})")
                self._checked = True
            return self._id

    def wrap(self, dek: bytes, context: bytes) -> Wrapped:
        key_id = self.current_key_id()
        out = self._ok("encrypt", self._key, {"plaintext": kmshttp.b64(dek),
                                              "additionalAuthenticatedData":
                                                  kmshttp.b64(aad(context))})
        return Wrapped(key_id, kmshttp.b64decode_field(out, "ciphertext", urlsafe=False,
                                                       limit=MAX_WRAPPED_BYTES))

    def unwrap(self, wrapped: Wrapped, context: bytes) -> bytes:
        if wrapped.key_id != self._id:
            raise CheckpointRefused(f"sealing key {wrapped.key_id!r} is not this key "
                                    f"service's Cloud KMS key ({self._id!r}, {self._key!r})")
        if not 0 < len(wrapped.blob) <= MAX_WRAPPED_BYTES:
            raise CheckpointRefused(f"the data key wrapped by Cloud KMS key {self._id!r} has "
                                    f"{len(wrapped.blob)} bytes: no Cloud KMS ciphertext "
                                    f"(1 to {MAX_WRAPPED_BYTES})")
        status, code, out = self._request("decrypt", self._key, {
            "ciphertext": kmshttp.b64(wrapped.blob),
            "additionalAuthenticatedData": kmshttp.b64(aad(context))})
        not_this = CheckpointRefused(
            f"the data key wrapped by Cloud KMS key {self._id!r} does not open for this "
            "sandbox (tampered, or bound to another sandbox)")
        if status == 400 and code == "INVALID_ARGUMENT":  # "the ciphertext is invalid"
            raise not_this
        if status != 200:
            raise CheckpointRefused(f"Cloud KMS refused decrypt with key {self._key!r}: "
                                    f"{code}")
        plain = kmshttp.b64decode_field(out, "plaintext", urlsafe=False, limit=DEK_BYTES)
        if len(plain) != DEK_BYTES:
            raise not_this
        return plain

    def _mac_key_for(self, key_id: str) -> str:
        if self._mac_key is None:
            raise CheckpointRefused(f"sealing key {key_id!r}: no Cloud KMS MAC key to sign "
                                    "or verify with (HERMIT_SEAL_KMS_MAC_KEY_ID)")
        if key_id != self._id:
            raise CheckpointRefused(f"sealing key {key_id!r} is not this key service's "
                                    f"Cloud KMS key ({self._id!r}): it signs with no other")
        return self._mac_key

    def sign(self, key_id: str, data: bytes) -> bytes:
        mac_key = self._mac_key_for(key_id)
        out = self._ok("macSign", mac_key, {"data": kmshttp.b64(mac_message(key_id, data))})
        return kmshttp.b64decode_field(out, "mac", urlsafe=False, limit=MAX_MAC_BYTES)

    def verify(self, key_id: str, data: bytes, signature: bytes) -> bool:
        mac_key = self._mac_key_for(key_id)
        if not 0 < len(signature) <= MAX_MAC_BYTES:
            return False
        out = self._ok("macVerify", mac_key, {"data": kmshttp.b64(mac_message(key_id, data)),
                                              "mac": kmshttp.b64(signature)})
        success = out.get("success")
        if not isinstance(success, bool):
            raise KmsUnavailable(f"Cloud KMS macVerify with key {mac_key!r} answered no "
                                 "boolean 'success'")
        return success


def metadata_token(http: requests.Session) -> Callable[[], tuple[str, float]]:
    """The GKE metadata server's token for the pod's Kubernetes service account (workload
    identity)."""
    def fetch() -> tuple[str, float]:
        try:
            answer = kmshttp.call(http, "GET", METADATA_TOKEN_URL,
                                  headers={"Metadata-Flavor": "Google"},
                                  limit=kmshttp.MAX_TOKEN_BYTES)
        except KmsUnavailable as exc:
            raise KmsUnavailable(f"the GKE metadata server: {exc}") from None
        if answer.status == 200:
            return kmshttp.token_answer(answer, "the GKE metadata server")
        if kmshttp.unavailable_status(answer.status):
            raise KmsUnavailable(f"the GKE metadata server answered HTTP {answer.status}")
        raise CheckpointRefused(f"the GKE metadata server gave no token (HTTP "
                                f"{answer.status}): is workload identity on for the "
                                "operator's service account? (or set "
                                "HERMIT_SEAL_KMS_TOKEN_FILE)")
    return fetch


def wrapper_from(settings: KeyServiceSettings, http: Any = None) -> CloudKmsWrapper:
    """The Cloud KMS wrapper of ``settings``: SettingsError naming the setting when Cloud
    KMS refuses the key at start; one that does not answer yet is asked again later."""
    assert settings.kms_key_id
    session = http if http is not None else kmshttp.session()
    token: Callable[[], str]
    if settings.kms_token_file:
        path = settings.kms_token_file
        token = lambda: kmshttp.read_token_file(path, "HERMIT_SEAL_KMS_TOKEN_FILE")  # noqa: E731
        token_setting = "HERMIT_SEAL_KMS_TOKEN_FILE"
    else:
        token, token_setting = (kmshttp.CachedToken(metadata_token(session)),
                                "the GKE workload identity")
    wrapper = CloudKmsWrapper(settings.kms_key_id, token, mac_key=settings.kms_mac_key_id,
                              endpoint=settings.kms_endpoint or DEFAULT_ENDPOINT,
                              http=session, token_setting=token_setting)
    return kmshttp.probed_at_start(wrapper, settings.kms_key_id)
