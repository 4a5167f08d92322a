"""The Azure Key Vault key wrapper (hermit_operator.keyvault) against a vault made here
of the same REST answers (RSA-OAEP-256, PS256 in ``cryptography``; no network): the DEK
opens for its own context only, a blob the vault did not make is refused, what the vault
refuses and what it does not answer are told apart, sizes are bounded before the vault
is asked, and the workload identity's token request. Not tested against Key Vault or an
emulator (docs/security.md#a-cloud-kms)."""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed

from hermit_common.errors import CheckpointRefused, SettingsError
from hermit_common.pin import Pin
from hermit_common.seal import Context, Wrapped, new_dek, open_manifest, seal_manifest
from hermit_common.settings import KeyServiceSettings
from hermit_operator import keyvault, kms, kmshttp
from hermit_operator.keyvault import KeyUrl, KeyVaultWrapper
from hermit_operator.kmshttp import KmsUnavailable
from tests.support.kmshttp_fakes import FakeHttp, Reply, Sent, refuse_network

VAULT = "https://hermit.vault.azure.net"
V1, V2 = "a" * 32, "b" * 32
CTX = Context("tenants", "box", "uid-box", lineage=("uid-box",))
OTHER = Context("tenants", "box-b", "uid-box-b", lineage=("uid-box-b",))
ENV = {"HERMIT_KEY_SERVICE_PORT": "9443", "HERMIT_KEY_SERVICE_TLS_CERT_FILE": "/tls/tls.crt",
       "HERMIT_KEY_SERVICE_TLS_KEY_FILE": "/tls/tls.key",
       "HERMIT_KEY_SERVICE_CALLERS": "system:serviceaccount:hermit-system:hermit-node-agent",
       "HERMIT_SEAL_KMS_PROVIDER": "azure", "HERMIT_SEAL_KMS_KEY_ID": f"{VAULT}/keys/hermit",
       "AZURE_CLIENT_ID": "client-1", "AZURE_TENANT_ID": "tenant-1",
       "AZURE_FEDERATED_TOKEN_FILE": "/var/run/secrets/azure/tokens/azure-identity-token"}
PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)
OAEP = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)


def _unb64(value: str) -> bytes:
    return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))


class Vault:
    """Key Vault's REST answers for one RSA key ``hermit`` with versions V1 (older) and
    V2 (current), from real RSA keys."""

    def __init__(self) -> None:
        self.keys = {v: rsa.generate_private_key(public_exponent=65537, key_size=2048)
                     for v in (V1, V2)}
        self.kty, self.ops = "RSA", ["wrapKey", "unwrapKey", "sign", "verify"]
        self.fail: Reply | None = None

    def __call__(self, sent: Sent) -> Reply:
        assert sent.headers["Authorization"] == "Bearer vault-token"
        path, _, query = sent.url.removeprefix(VAULT).partition("?")
        assert query == "api-version=7.4"
        parts = path.strip("/").split("/")
        if sent.method == "GET":
            version = parts[2] if len(parts) == 3 else V2
            if parts[1] != "hermit" or version not in self.keys:
                return Reply(404, {"error": {"code": "KeyNotFound", "message": "no"}})
            return Reply(200, {"key": {"kid": f"{VAULT}/keys/hermit/{version}",
                                       "kty": self.kty, "key_ops": self.ops},
                               "attributes": {"enabled": True}})
        if self.fail is not None:
            return self.fail
        key = self.keys.get(parts[2])
        if key is None:
            return Reply(404, {"error": {"code": "KeyNotFound", "message": "no"}})
        op, body = parts[3], sent.json
        if op == "wrapkey":
            assert body["alg"] == "RSA-OAEP-256"
            return Reply(200, {"kid": "k", "value": kmshttp.b64url(
                key.public_key().encrypt(_unb64(body["value"]), OAEP))})
        if op == "unwrapkey":
            try:
                plain = key.decrypt(_unb64(body["value"]), OAEP)
            except ValueError:
                return Reply(400, {"error": {"code": "BadParameter", "message": "crypto"}})
            return Reply(200, {"kid": "k", "value": kmshttp.b64url(plain)})
        if op == "sign":
            assert body["alg"] == "PS256"
            return Reply(200, {"kid": "k", "value": kmshttp.b64url(key.sign(
                _unb64(body["value"]), PSS, Prehashed(hashes.SHA256())))})
        assert op == "verify"
        try:
            key.public_key().verify(_unb64(body["value"]), _unb64(body["digest"]), PSS,
                                    Prehashed(hashes.SHA256()))
        except Exception:
            return Reply(200, {"value": False})
        return Reply(200, {"value": True})


@pytest.fixture
def vault() -> Vault:
    return Vault()


def wrapper(vault: Vault, key: str = f"{VAULT}/keys/hermit") -> KeyVaultWrapper:
    return KeyVaultWrapper(KeyUrl.parse(key), lambda: "vault-token", http=FakeHttp(vault))


def test_a_data_key_opens_for_its_own_context_only(vault: Vault) -> None:
    kw = wrapper(vault)
    assert kw.current_key_id() == V2  # the key's current version, asked once
    dek = new_dek()
    wrapped = kw.wrap(dek, CTX.sandbox_bytes())
    assert wrapped.key_id == V2 and dek not in wrapped.blob
    assert kw.unwrap(wrapped, CTX.sandbox_bytes()) == dek
    for other in (OTHER, dataclasses.replace(CTX, lineage=("uid-src", "uid-box"))):
        with pytest.raises(CheckpointRefused, match=f"version '{V2}' does not open for this"):
            kw.unwrap(wrapped, other.sandbox_bytes())
    # A flipped byte anywhere (the length, the wrapped bytes, the signature).
    for i in (1, 2, 100, len(wrapped.blob) - 1):
        tampered = bytearray(wrapped.blob)
        tampered[i] ^= 0x01
        with pytest.raises(CheckpointRefused, match=f"version '{V2}'"):
            kw.unwrap(dataclasses.replace(wrapped, blob=bytes(tampered)), CTX.sandbox_bytes())
    # Records of an older version open with that version: Key Vault's rotation.
    older = wrapper(vault, f"{VAULT}/keys/hermit/{V1}")
    assert older.current_key_id() == V1
    old = older.wrap(dek, CTX.sandbox_bytes())
    assert kw.unwrap(old, CTX.sandbox_bytes()) == dek


def test_a_blob_the_vault_did_not_make_does_not_open(vault: Vault) -> None:
    # Anyone with the public key can wrap a DEK of their choosing for any context: the
    # signature by the same key version is what makes it the vault's.
    kw = wrapper(vault)
    dek, ctx = new_dek(), CTX.sandbox_bytes()
    forged = vault.keys[V2].public_key().encrypt(dek + keyvault.context_digest(ctx), OAEP)
    honest = kw.wrap(new_dek(), ctx)
    _, signature = keyvault.unpack(honest.blob, V2, True)
    with pytest.raises(CheckpointRefused, match="does not open for this sandbox"):
        kw.unwrap(Wrapped(V2, keyvault.pack(forged, signature)), ctx)


def test_what_the_vault_refuses_and_what_it_does_not_answer(vault: Vault) -> None:
    kw = wrapper(vault)
    wrapped = kw.wrap(new_dek(), CTX.sandbox_bytes())
    for status, code in ((403, "Forbidden"), (404, "KeyNotFound"), (400, "KeyDisabled")):
        vault.fail = Reply(status, {"error": {"code": code, "message": "no"}})
        with pytest.raises(CheckpointRefused, match=f"Key Vault refused verify with key "
                                                    f"'hermit': {code}"):
            kw.unwrap(wrapped, CTX.sandbox_bytes())
    vault.fail = Reply(401, {"error": {"code": "Unauthorized", "message": "no"}})
    with pytest.raises(CheckpointRefused, match=r"its token .* is not accepted"):
        kw.wrap(new_dek(), CTX.sandbox_bytes())
    for reply in (Reply(429, {"error": {"code": "Throttled"}}), Reply(503, b"<html>"),
                  Reply(200, b"not json"), Reply(200, {"kid": "k"}),
                  Reply(200, {"value": "x" * 100_000}),
                  Reply(200, b"{" + b" " * kmshttp.MAX_ANSWER_BYTES + b"}"),
                  Reply(200, b"", {"Content-Length": str(10**9)})):
        vault.fail = reply
        with pytest.raises(KmsUnavailable):
            kw.wrap(new_dek(), CTX.sandbox_bytes())
        assert not isinstance(KmsUnavailable("x"), CheckpointRefused)
    # An oversized answer is not read past its bound.
    vault.fail = Reply(200, b"x" * (10 * kmshttp.MAX_ANSWER_BYTES))
    http = FakeHttp(vault)
    with pytest.raises(KmsUnavailable, match="answered more than"):
        KeyVaultWrapper(KeyUrl.parse(f"{VAULT}/keys/hermit"), lambda: "vault-token",
                        http=http).wrap(new_dek(), b"ctx")
    assert http.last is not None and http.last.read <= kmshttp.MAX_ANSWER_BYTES + 8192
    with pytest.raises(KmsUnavailable, match="did not answer: ConnectionError"):
        KeyVaultWrapper(KeyUrl.parse(f"{VAULT}/keys/hermit"), lambda: "vault-token",
                        http=FakeHttp(refuse_network)).current_key_id()


def test_bounds_and_key_checks_before_the_vault_is_asked(vault: Vault) -> None:
    http = FakeHttp(vault)
    kw = KeyVaultWrapper(KeyUrl.parse(f"{VAULT}/keys/hermit"), lambda: "vault-token",
                         http=http)
    for blob in (b"", b"\x00\x01", b"x" * (keyvault.MAX_WRAPPED_BYTES + 1),
                 b"\x00\x00" + b"x" * 10, b"\x02\x01" + b"x" * 600, b"\x00\x05abcde"):
        with pytest.raises(CheckpointRefused, match=f"Key Vault key version '{V2}'"):
            kw.unwrap(Wrapped(V2, blob), b"ctx")
    with pytest.raises(CheckpointRefused, match="'k1' is not a Key Vault key version"):
        kw.unwrap(Wrapped("k1", b"\x00\x01x"), b"ctx")
    assert not kw.verify(V2, b"data", b"")
    assert not kw.verify(V2, b"data", b"x" * 513)
    assert http.sent == []
    vault.kty = "EC"
    with pytest.raises(CheckpointRefused, match="is not an enabled RSA/RSA-HSM key"):
        kw.current_key_id()
    aes = KeyVaultWrapper(KeyUrl.parse(f"{VAULT}/keys/hermit"), lambda: "t",
                          algorithm="A256KW", http=FakeHttp(vault))
    with pytest.raises(CheckpointRefused, match="A256KW key does not sign"):
        aes.verify(V2, b"data", b"sig")


def test_manifests_are_signed_by_the_wrapping_key(vault: Vault) -> None:
    kw = wrapper(vault)
    signature = kw.sign(V2, b"signed bytes")
    assert kw.verify(V2, b"signed bytes", signature)
    assert not kw.verify(V2, b"signed bytez", signature)
    assert not kw.verify(V1, b"signed bytes", signature)
    with pytest.raises(CheckpointRefused, match=f"sealing key '{V1}' is not this"):
        kw.sign(V1, b"data")
    ctx = dataclasses.replace(CTX, checkpoint="cp-1")
    dek = new_dek()
    raw = seal_manifest(dek, kw.wrap(dek, ctx.sandbox_bytes()), ctx, b'{"m":1}')
    opened = open_manifest(kw, raw, Pin("tenants", "box", "cp-1", uid="uid-box"))
    assert (opened.dek, opened.plain) == (dek, b'{"m":1}')


def test_key_urls_and_scopes() -> None:
    key = KeyUrl.parse(f"{VAULT}/keys/hermit/{V1}")
    assert (key.vault, key.name, key.version) == (VAULT, "hermit", V1)
    assert key.scope() == "https://vault.azure.net/.default"
    assert KeyUrl.parse("https://h.managedhsm.azure.net/keys/k").scope() == \
        "https://managedhsm.azure.net/.default"
    for bad in ("http://v.vault.azure.net/keys/k", "https://v/secrets/k",
                "https://v/keys/k/notaversion", "https://v/keys/k?x=1",
                "https://u@v/keys/k", "https://v/keys/a_b"):
        with pytest.raises(SettingsError, match="is not a Key Vault key URL"):
            KeyUrl.parse(bad)


def test_the_workload_identity_asks_entra_with_the_federated_token(tmp_path: Path) -> None:
    assertion = tmp_path / "azure-identity-token"
    assertion.write_text("federated.jwt.token\n")
    settings = KeyServiceSettings.from_env({**ENV, "AZURE_FEDERATED_TOKEN_FILE":
                                            str(assertion)})
    answers = [Reply(200, {"access_token": "vault-token", "expires_in": 3599,
                           "token_type": "Bearer"})]
    vault = Vault()

    def handler(sent: Sent) -> Reply:
        if sent.url.startswith("https://login.microsoftonline.com/"):
            return answers.pop(0)
        return vault(sent)
    http = FakeHttp(handler)
    kw = kms.wrapper_from(settings, http)
    assert isinstance(kw, KeyVaultWrapper) and kw.current_key_id() == V2
    kw.wrap(new_dek(), b"ctx")
    kw.wrap(new_dek(), b"ctx")
    [token] = [s for s in http.sent if "login" in s.url]  # one token, kept
    assert token.url == "https://login.microsoftonline.com/tenant-1/oauth2/v2.0/token"
    assert token.form == {
        "grant_type": "client_credentials", "client_id": "client-1",
        "scope": "https://vault.azure.net/.default",
        "client_assertion_type": "urn:ietf:params:oauth:client-assertion-type:jwt-bearer",
        "client_assertion": "federated.jwt.token"}
    # Entra says no: the start stops naming the settings; Entra away: asked again later.
    answers[:] = [Reply(400, {"error": "invalid_client",
                              "error_description": "AADSTS70021"})]
    with pytest.raises(SettingsError, match=r"HERMIT_SEAL_KMS_KEY_ID=.*refused the workload "
                                            r"identity .AZURE_CLIENT_ID.*invalid_client"):
        kms.wrapper_from(settings, http)
    answers[:] = [Reply(503, b"")]
    assert isinstance(kms.wrapper_from(settings, http), KeyVaultWrapper)
    assertion.unlink()
    with pytest.raises(SettingsError, match=r"AZURE_FEDERATED_TOKEN_FILE=.*cannot read"):
        kms.wrapper_from(settings, http)


def test_key_vault_settings(tmp_path: Path) -> None:
    s = KeyServiceSettings.from_env(ENV)
    assert (s.kms_provider, s.kms_key_id, s.kms_azure_wrap_algorithm, s.kms_azure_client_id,
            s.kms_azure_authority_host) == ("azure", f"{VAULT}/keys/hermit", "RSA-OAEP-256",
                                            "client-1", "https://login.microsoftonline.com")
    token = tmp_path / "token"
    token.write_text("vault-token")
    bare = {k: v for k, v in ENV.items() if not k.startswith("AZURE_")}
    with pytest.raises(SettingsError, match="needs the pod's workload identity "
                                            r"\(AZURE_CLIENT_ID, AZURE_TENANT_ID"):
        KeyServiceSettings.from_env(bare)
    s = KeyServiceSettings.from_env({**bare, "HERMIT_SEAL_KMS_TOKEN_FILE": str(token),
                                     "HERMIT_SEAL_KMS_AZURE_WRAP_ALGORITHM": "A256KW"})
    assert (s.kms_token_file, s.kms_azure_wrap_algorithm) == (str(token), "A256KW")
    for extra, match in (({"HERMIT_SEAL_KMS_KEY_ID": "alias/hermit"},
                          "HERMIT_SEAL_KMS_KEY_ID='alias/hermit' is not a Key Vault key URL"),
                         ({"HERMIT_SEAL_KMS_MAC_KEY_ID": f"{VAULT}/keys/mac"},
                          "HERMIT_SEAL_KMS_MAC_KEY_ID is not used with .*azure"),
                         ({"HERMIT_SEAL_KMS_REGION": "eu-west-2"},
                          "HERMIT_SEAL_KMS_REGION is not used"),
                         ({"HERMIT_SEAL_KMS_AZURE_WRAP_ALGORITHM": "RSA1_5"},
                          "HERMIT_SEAL_KMS_AZURE_WRAP_ALGORITHM='RSA1_5' is not one of"),
                         ({"HERMIT_SEAL_KMS_PROVIDER": "oci"},
                          "HERMIT_SEAL_KMS_PROVIDER='oci' is not one of aws, azure, gcp"),
                         ({"AZURE_TENANT_ID": "a/b"}, "AZURE_TENANT_ID='a/b'")):
        with pytest.raises(SettingsError, match=match):
            KeyServiceSettings.from_env({**ENV, **extra})
    # A key service with a token file reads it at each use (the kubelet rotates it).
    http = FakeHttp(Vault())
    kw = keyvault.wrapper_from(KeyServiceSettings.from_env(
        {**bare, "HERMIT_SEAL_KMS_TOKEN_FILE": str(token)}), http)
    token.write_text("other-token")
    with pytest.raises(AssertionError):  # the vault here takes "vault-token" only
        kw.wrap(new_dek(), b"ctx")
    assert [s.headers["Authorization"] for s in http.sent] == ["Bearer vault-token",
                                                               "Bearer other-token"]


def test_helpers_are_bounded() -> None:
    with pytest.raises(KmsUnavailable, match="not base64"):
        kmshttp.b64decode_field({"v": "!!!!"}, "v", urlsafe=False, limit=10)
    with pytest.raises(KmsUnavailable, match="of 12 bytes"):
        kmshttp.b64decode_field({"v": kmshttp.b64(b"x" * 12)}, "v", urlsafe=False, limit=10)
    assert kmshttp.b64decode_field({"v": kmshttp.b64url(b"\xff" * 9)}, "v", urlsafe=True,
                                   limit=10) == b"\xff" * 9
    clock = [0.0]
    fetched: list[int] = []

    def fetch() -> tuple[str, Any]:
        fetched.append(1)
        return f"t{len(fetched)}", 600
    token = kmshttp.CachedToken(fetch, clock=lambda: clock[0])
    assert (token(), token()) == ("t1", "t1")
    clock[0] = 600 - kmshttp.TOKEN_MARGIN_SECONDS
    assert token() == "t2"
    token.forget()
    assert token() == "t3"
