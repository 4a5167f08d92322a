"""The AWS KMS key wrapper's pure parts (hermit_operator.kms): the encryption context and
MAC message, how KMS's answers map to Hermit's errors, the bounds checked before KMS is
asked, and its settings. tests/integration/test_kms.py runs it against local-kms."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from hermit_common.errors import CheckpointRefused, SettingsError
from hermit_common.seal import Wrapped
from hermit_common.settings import KeyServiceSettings
from hermit_operator import kms
from hermit_operator.kms import AwsKmsWrapper, KmsUnavailable

KEY = "1234abcd-12ab-34cd-56ef-1234567890ab"
ENV = {"HERMIT_KEY_SERVICE_PORT": "9443", "HERMIT_KEY_SERVICE_TLS_CERT_FILE": "/tls/tls.crt",
       "HERMIT_KEY_SERVICE_TLS_KEY_FILE": "/tls/tls.key",
       "HERMIT_KEY_SERVICE_CALLERS": "system:serviceaccount:hermit-system:hermit-node-agent",
       "HERMIT_SEAL_KMS_KEY_ID": "alias/hermit"}


def _error(code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "no"}}, "Decrypt")


class Client:
    """Answers DescribeKey; every other call raises ``fail`` (or is recorded)."""

    def __init__(self, fail: Exception | None = None, usage: str = "ENCRYPT_DECRYPT") -> None:
        self.fail, self.usage = fail, usage
        self.calls: list[str] = []

    def describe_key(self, KeyId: str) -> dict[str, Any]:
        return {"KeyMetadata": {"KeyId": KEY, "KeyUsage": self.usage}}

    def __getattr__(self, name: str) -> Any:
        def call(**_: Any) -> dict[str, Any]:
            self.calls.append(name)
            if self.fail is not None:
                raise self.fail
            return {}
        return call


def test_the_encryption_context_binds_the_context_bytes_in_bounded_size() -> None:
    a = kms.encryption_context(b'{"sandbox":"a"}')
    assert a != kms.encryption_context(b'{"sandbox":"b"}')
    long = kms.encryption_context(b"x" * 100_000)  # a lineage of 64 long uids fits
    assert list(long) == [kms.CONTEXT_KEY] and len(long[kms.CONTEXT_KEY]) == 64
    assert kms.mac_message(KEY, b"d") != kms.mac_message("other", b"d")
    assert len(kms.mac_message(KEY, b"x" * 10_000_000)) < 4096  # KMS's Message limit


@pytest.mark.parametrize("code", ["AccessDeniedException", "NotFoundException",
                                  "DisabledException", "KMSInvalidStateException"])
def test_what_kms_refuses_is_a_refused_checkpoint_naming_the_key(code: str) -> None:
    wrapper = AwsKmsWrapper(Client(_error(code)), "alias/hermit")
    with pytest.raises(CheckpointRefused, match=f"KMS refused Decrypt with key '{KEY}': {code}"):
        wrapper.unwrap(Wrapped(KEY, b"blob"), b"ctx")
    with pytest.raises(CheckpointRefused, match=f"Encrypt with key '{KEY}'"):
        wrapper.wrap(b"k" * 32, b"ctx")
    wrapper = AwsKmsWrapper(Client(_error("InvalidCiphertextException")), "alias/hermit")
    with pytest.raises(CheckpointRefused, match="does not open for this sandbox"):
        wrapper.unwrap(Wrapped(KEY, b"blob"), b"ctx")


@pytest.mark.parametrize("fail", [_error("ThrottlingException"), _error("KMSInternalException"),
                                  EndpointConnectionError(endpoint_url="https://kms")])
def test_what_kms_does_not_answer_is_unavailable_not_refused(fail: Exception) -> None:
    # The store replaces a data key it is refused: an outage must not look like that.
    wrapper = AwsKmsWrapper(Client(fail), "alias/hermit")
    with pytest.raises(KmsUnavailable, match=f"KMS Decrypt with key '{KEY}' failed"):
        wrapper.unwrap(Wrapped(KEY, b"blob"), b"ctx")
    assert not isinstance(KmsUnavailable("x"), CheckpointRefused)


def test_bounds_are_checked_before_kms_is_asked() -> None:
    client = Client()
    wrapper = AwsKmsWrapper(client, "alias/hermit", "alias/hermit-mac")
    for blob in (b"", b"x" * (kms.MAX_WRAPPED_BYTES + 1)):
        with pytest.raises(CheckpointRefused, match=f"KMS key '{KEY}' has {len(blob)} bytes"):
            wrapper.unwrap(Wrapped(KEY, blob), b"ctx")
    assert not wrapper.verify(KEY, b"data", b"x" * 65)
    with pytest.raises(CheckpointRefused, match="'k1' is not this key service's KMS key"):
        wrapper.sign("k1", b"data")
    assert client.calls == []
    with pytest.raises(CheckpointRefused, match="HERMIT_SEAL_KMS_MAC_KEY_ID"):
        AwsKmsWrapper(client, "alias/hermit").sign(KEY, b"data")


def test_the_key_must_be_a_symmetric_encryption_key() -> None:
    with pytest.raises(CheckpointRefused, match="not a symmetric encryption key"):
        AwsKmsWrapper(Client(usage="GENERATE_VERIFY_MAC"), "alias/mac").current_key_id()
    settings = KeyServiceSettings.from_env(ENV)
    with pytest.raises(SettingsError, match="HERMIT_SEAL_KMS_KEY_ID=alias/hermit: "):
        kms.wrapper_from(settings, Client(usage="SIGN_VERIFY"))
    assert kms.wrapper_from(settings, Client()).current_key_id() == KEY


def test_kms_settings() -> None:
    s = KeyServiceSettings.from_env({**ENV, "HERMIT_SEAL_KMS_REGION": "eu-west-2",
                                     "HERMIT_SEAL_KMS_ENDPOINT": "http://127.0.0.1:8080/",
                                     "HERMIT_SEAL_KMS_MAC_KEY_ID": "alias/hermit-mac"})
    assert (s.kms_key_id, s.kms_mac_key_id, s.kms_region, s.kms_endpoint, s.keys_dir) == (
        "alias/hermit", "alias/hermit-mac", "eu-west-2", "http://127.0.0.1:8080", None)
    with pytest.raises(SettingsError, match="HERMIT_SEAL_KMS_KEY_ID and HERMIT_SEAL_KEYS_DIR"):
        KeyServiceSettings.from_env({**ENV, "HERMIT_SEAL_KEYS_DIR": "/keys"})
    with pytest.raises(SettingsError, match="HERMIT_SEAL_KMS_MAC_KEY_ID='a key'"):
        KeyServiceSettings.from_env({**ENV, "HERMIT_SEAL_KMS_MAC_KEY_ID": "a key"})
    with pytest.raises(SettingsError, match="HERMIT_SEAL_KMS_ENDPOINT='kms:8080'"):
        KeyServiceSettings.from_env({**ENV, "HERMIT_SEAL_KMS_ENDPOINT": "kms:8080"})
