"""The Google Cloud KMS key wrapper (hermit_operator.cloudkms) against Cloud KMS's REST
answers made here (AES-GCM with the AAD, HMAC-SHA256 in ``cryptography``/hmac; no
network): the request bodies, the DEK opening for its own context only, the error
mapping, the bounds checked before Cloud KMS is asked or an answer is parsed, the token
sources and the settings. Not tested against Cloud KMS or an emulator: none could be
installed (docs/security.md#a-cloud-kms)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import os
from pathlib import Path

import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hermit_common.errors import CheckpointRefused, SettingsError
from hermit_common.seal import Context, Wrapped, new_dek
from hermit_common.settings import KeyServiceSettings
from hermit_operator import cloudkms, kms, kmshttp
from hermit_operator.cloudkms import CloudKmsWrapper
from hermit_operator.kmshttp import KmsUnavailable
from tests.support.kmshttp_fakes import FakeHttp, Reply, Sent, refuse_network

KEY = "projects/p-1/locations/europe-west2/keyRings/hermit/cryptoKeys/kek"
MAC = "projects/p-1/locations/europe-west2/keyRings/hermit/cryptoKeys/mac/cryptoKeyVersions/1"
API = "https://cloudkms.googleapis.com/v1/"
CTX = Context("tenants", "box", "uid-box", lineage=("uid-box",))
OTHER = Context("tenants", "box-b", "uid-box-b", lineage=("uid-box-b",))
ENV = {"HERMIT_KEY_SERVICE_PORT": "9443", "HERMIT_KEY_SERVICE_TLS_CERT_FILE": "/tls/tls.crt",
       "HERMIT_KEY_SERVICE_TLS_KEY_FILE": "/tls/tls.key",
       "HERMIT_KEY_SERVICE_CALLERS": "system:serviceaccount:hermit-system:hermit-node-agent",
       "HERMIT_SEAL_KMS_PROVIDER": "gcp", "HERMIT_SEAL_KMS_KEY_ID": KEY,
       "HERMIT_SEAL_KMS_MAC_KEY_ID": MAC}


def _error(status: int, name: str) -> Reply:
    return Reply(status, {"error": {"code": status, "message": "no", "status": name}})


class CloudKms:
    """Cloud KMS's answers for KEY (AES-256-GCM, the version in the ciphertext) and MAC."""

    def __init__(self) -> None:
        self.aes = AESGCM(AESGCM.generate_key(256))
        self.mac = os.urandom(32)
        self.meta = {"name": KEY, "purpose": "ENCRYPT_DECRYPT",
                     "primary": {"name": KEY + "/cryptoKeyVersions/3", "state": "ENABLED"}}
        self.fail: Reply | None = None

    def __call__(self, sent: Sent) -> Reply:
        assert sent.headers["Authorization"] == "Bearer gcp-token"
        resource, _, op = sent.url.removeprefix(API).partition(":")
        if sent.method == "GET":
            return Reply(200, self.meta) if resource == KEY else _error(404, "NOT_FOUND")
        if self.fail is not None:
            return self.fail
        body = {k: base64.b64decode(v) for k, v in sent.json.items()}
        if op == "encrypt":
            assert resource == KEY and set(body) == {"plaintext", "additionalAuthenticatedData"}
            nonce = os.urandom(12)
            ct = b"\x03" + nonce + self.aes.encrypt(nonce, body["plaintext"],
                                                    body["additionalAuthenticatedData"])
            return Reply(200, {"name": KEY + "/cryptoKeyVersions/3",
                               "ciphertext": kmshttp.b64(ct)})
        if op == "decrypt":
            ct = body["ciphertext"]
            try:
                plain = self.aes.decrypt(ct[1:13], ct[13:], body["additionalAuthenticatedData"])
            except (InvalidTag, ValueError):
                return _error(400, "INVALID_ARGUMENT")
            return Reply(200, {"plaintext": kmshttp.b64(plain)})
        assert resource == MAC
        mac = hmac.new(self.mac, body["data"], hashlib.sha256).digest()
        if op == "macSign":
            return Reply(200, {"name": MAC, "mac": kmshttp.b64(mac)})
        assert op == "macVerify"
        return Reply(200, {"name": MAC, "success": hmac.compare_digest(mac, body["mac"])})


@pytest.fixture
def gcp() -> CloudKms:
    return CloudKms()


def wrapper(gcp: CloudKms, **kw: object) -> CloudKmsWrapper:
    return CloudKmsWrapper(KEY, lambda: "gcp-token", mac_key=MAC, http=FakeHttp(gcp),
                           **kw)  # type: ignore[arg-type]


def test_a_data_key_opens_for_its_own_context_only(gcp: CloudKms) -> None:
    kw = wrapper(gcp)
    key_id = kw.current_key_id()
    assert key_id == cloudkms.kek_id(KEY) and len(key_id) == 36
    dek = new_dek()
    wrapped = kw.wrap(dek, CTX.sandbox_bytes())
    assert wrapped.key_id == key_id and dek not in wrapped.blob
    assert kw.unwrap(wrapped, CTX.sandbox_bytes()) == dek
    for other in (OTHER, dataclasses.replace(CTX, lineage=("uid-src", "uid-box"))):
        with pytest.raises(CheckpointRefused, match="does not open for this sandbox"):
            kw.unwrap(wrapped, other.sandbox_bytes())
    tampered = bytearray(wrapped.blob)
    tampered[20] ^= 1
    with pytest.raises(CheckpointRefused, match="does not open for this sandbox"):
        kw.unwrap(dataclasses.replace(wrapped, blob=bytes(tampered)), CTX.sandbox_bytes())


def test_the_request_bodies(gcp: CloudKms) -> None:
    http = FakeHttp(gcp)
    kw = CloudKmsWrapper(KEY, lambda: "gcp-token", mac_key=MAC, http=http)  # type: ignore[arg-type]
    kw.unwrap(kw.wrap(b"k" * 32, b"context"), b"context")
    kw.verify(kw.current_key_id(), b"d", kw.sign(kw.current_key_id(), b"d"))
    assert [(s.method, s.url.removeprefix(API)) for s in http.sent] == [
        ("GET", KEY), ("POST", KEY + ":encrypt"), ("POST", KEY + ":decrypt"),
        ("POST", MAC + ":macSign"), ("POST", MAC + ":macVerify")]
    aad = kmshttp.b64(hashlib.sha256(b"context").digest())
    assert http.sent[1].json == {"plaintext": kmshttp.b64(b"k" * 32),
                                 "additionalAuthenticatedData": aad}
    assert http.sent[2].json["additionalAuthenticatedData"] == aad
    message = cloudkms.mac_message(kw.current_key_id(), b"d")
    assert http.sent[3].json == {"data": kmshttp.b64(message)}
    assert len(cloudkms.mac_message(kw.current_key_id(), b"x" * 10**6)) == len(message) < 200
    assert cloudkms.mac_message("other", b"d") != message


def test_what_cloud_kms_refuses_and_what_it_does_not_answer(gcp: CloudKms) -> None:
    kw = wrapper(gcp)
    wrapped = kw.wrap(new_dek(), CTX.sandbox_bytes())
    for status, name in ((403, "PERMISSION_DENIED"), (404, "NOT_FOUND"),
                         (400, "FAILED_PRECONDITION")):
        gcp.fail = _error(status, name)
        with pytest.raises(CheckpointRefused, match=f"Cloud KMS refused decrypt with key "
                                                    f"'{KEY}': {name}"):
            kw.unwrap(wrapped, CTX.sandbox_bytes())
    gcp.fail = _error(401, "UNAUTHENTICATED")
    with pytest.raises(CheckpointRefused, match=r"its token .* is not accepted"):
        kw.wrap(new_dek(), b"ctx")
    for reply in (_error(429, "RESOURCE_EXHAUSTED"), _error(503, "UNAVAILABLE"),
                  Reply(502, b"<html>bad gateway</html>"), Reply(200, b"[1]"),
                  Reply(200, {"name": KEY}), Reply(200, {"plaintext": "****"}),
                  Reply(200, b"x" * (kmshttp.MAX_ANSWER_BYTES + 1))):
        gcp.fail = reply
        with pytest.raises(KmsUnavailable):
            kw.unwrap(wrapped, CTX.sandbox_bytes())
    gcp.fail = Reply(200, {"plaintext": kmshttp.b64(b"k" * 33)})
    with pytest.raises(KmsUnavailable, match="'plaintext' of 33 bytes"):
        kw.unwrap(wrapped, CTX.sandbox_bytes())
    gone = CloudKmsWrapper(KEY, lambda: "gcp-token", http=FakeHttp(refuse_network))  # type: ignore[arg-type]
    with pytest.raises(KmsUnavailable, match="did not answer: ConnectionError"):
        gone.current_key_id()


def test_bounds_and_key_checks_before_cloud_kms_is_asked(gcp: CloudKms) -> None:
    http = FakeHttp(gcp)
    kw = CloudKmsWrapper(KEY, lambda: "gcp-token", http=http)  # type: ignore[arg-type]
    key_id = cloudkms.kek_id(KEY)
    for blob in (b"", b"x" * (cloudkms.MAX_WRAPPED_BYTES + 1)):
        with pytest.raises(CheckpointRefused, match=f"has {len(blob)} bytes"):
            kw.unwrap(Wrapped(key_id, blob), b"ctx")
    with pytest.raises(CheckpointRefused, match="'gcp-0' is not this key service's Cloud"):
        kw.unwrap(Wrapped("gcp-0", b"blob"), b"ctx")
    with pytest.raises(CheckpointRefused, match="HERMIT_SEAL_KMS_MAC_KEY_ID"):
        kw.sign(key_id, b"data")
    assert http.sent == []
    assert not wrapper(gcp).verify(key_id, b"d", b"x" * 65)
    gcp.meta["purpose"] = "MAC"
    with pytest.raises(CheckpointRefused, match="is not a symmetric ENCRYPT_DECRYPT key"):
        kw.current_key_id()


def test_token_sources(gcp: CloudKms, tmp_path: Path) -> None:
    metadata = [Reply(200, {"access_token": "gcp-token", "expires_in": 3599,
                            "token_type": "Bearer"})]

    def handler(sent: Sent) -> Reply:
        if sent.url == cloudkms.METADATA_TOKEN_URL:
            assert sent.headers == {"Metadata-Flavor": "Google"}
            return metadata.pop(0)
        return gcp(sent)
    http = FakeHttp(handler)
    settings = KeyServiceSettings.from_env(ENV)
    kw = kms.wrapper_from(settings, http)
    assert isinstance(kw, CloudKmsWrapper)
    kw.wrap(new_dek(), b"ctx")
    assert [s.url for s in http.sent].count(cloudkms.METADATA_TOKEN_URL) == 1
    metadata[:] = [Reply(404, b"not found")]
    with pytest.raises(SettingsError, match=r"HERMIT_SEAL_KMS_KEY_ID=.*workload identity"):
        kms.wrapper_from(settings, http)
    metadata[:] = [Reply(500, b"")]
    assert isinstance(kms.wrapper_from(settings, http), CloudKmsWrapper)  # asked again later
    token = tmp_path / "token"
    token.write_text("gcp-token\n")
    kw = kms.wrapper_from(KeyServiceSettings.from_env(
        {**ENV, "HERMIT_SEAL_KMS_TOKEN_FILE": str(token)}), FakeHttp(gcp))
    assert kw.current_key_id() == cloudkms.kek_id(KEY)
    token.write_text("two\ntokens")
    with pytest.raises(CheckpointRefused, match=r"HERMIT_SEAL_KMS_TOKEN_FILE=.*not one token"):
        kw.wrap(new_dek(), b"ctx")


def test_cloud_kms_settings() -> None:
    s = KeyServiceSettings.from_env({**ENV, "HERMIT_SEAL_KMS_ENDPOINT":
                                     "https://europe-west2-cloudkms.googleapis.com/"})
    assert (s.kms_provider, s.kms_key_id, s.kms_mac_key_id, s.kms_endpoint) == (
        "gcp", KEY, MAC, "https://europe-west2-cloudkms.googleapis.com")
    for extra, match in (({"HERMIT_SEAL_KMS_KEY_ID": KEY + "/cryptoKeyVersions/1"},
                          "HERMIT_SEAL_KMS_KEY_ID=.* is not a Cloud KMS CryptoKey"),
                         ({"HERMIT_SEAL_KMS_MAC_KEY_ID": KEY},
                          "HERMIT_SEAL_KMS_MAC_KEY_ID=.* is not a Cloud KMS CryptoKey"),
                         ({"HERMIT_SEAL_KMS_REGION": "eu"}, "HERMIT_SEAL_KMS_REGION is not "
                                                            "used with .*gcp"),
                         ({"HERMIT_SEAL_KMS_ENDPOINT": "kms:443"},
                          "HERMIT_SEAL_KMS_ENDPOINT='kms:443'")):
        with pytest.raises(SettingsError, match=match):
            KeyServiceSettings.from_env({**ENV, **extra})
    aws = {**ENV, "HERMIT_SEAL_KMS_PROVIDER": "aws", "HERMIT_SEAL_KMS_KEY_ID": "alias/k"}
    del aws["HERMIT_SEAL_KMS_MAC_KEY_ID"]
    assert KeyServiceSettings.from_env(aws).kms_provider == "aws"
    with pytest.raises(SettingsError, match="HERMIT_SEAL_KMS_TOKEN_FILE is not used with "
                                            "HERMIT_SEAL_KMS_PROVIDER=aws"):
        KeyServiceSettings.from_env({**aws, "HERMIT_SEAL_KMS_TOKEN_FILE": "/t"})
