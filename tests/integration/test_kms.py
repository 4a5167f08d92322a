"""The AWS KMS key wrapper (hermit_operator.kms) against the real local-kms
(tests/support/localkms.py): a data key wraps and unwraps for its own context only, a
tampered or foreign blob and an unknown key are refused naming the key, and manifests
are signed and verified with an HMAC key in KMS. The key service answering from KMS over
HTTPS is in tests/integration/test_key_service.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from hermit_common.errors import CheckpointRefused
from hermit_common.pin import Pin
from hermit_common.seal import Context, new_dek, open_manifest, seal_manifest
from hermit_common.settings import KeyServiceSettings
from hermit_operator import kms
from hermit_operator.kms import AwsKmsWrapper, KmsUnavailable
from tests.support.localkms import REGION, LocalKms, local_kms

__all__ = ["local_kms"]

pytestmark = pytest.mark.integration

CTX = Context("tenants", "box", "uid-box", lineage=("uid-box",))
OTHER = Context("tenants", "box-b", "uid-box-b", lineage=("uid-box-b",))
UNKNOWN = "00000000-0000-4000-8000-000000000000"


def make_keys(client: Any) -> tuple[str, str]:
    """A symmetric key (alias/hermit) and an HMAC key (alias/hermit-mac); their ids."""
    key = client.create_key()["KeyMetadata"]["KeyId"]
    mac = client.create_key(KeySpec="HMAC_256", KeyUsage="GENERATE_VERIFY_MAC")
    client.create_alias(AliasName="alias/hermit", TargetKeyId=key)
    client.create_alias(AliasName="alias/hermit-mac",
                        TargetKeyId=mac["KeyMetadata"]["KeyId"])
    return key, mac["KeyMetadata"]["KeyId"]


@pytest.fixture(scope="module")
def wrapper(local_kms: LocalKms) -> tuple[AwsKmsWrapper, str]:
    key, _ = make_keys(local_kms.client())
    settings = KeyServiceSettings(kms_key_id="alias/hermit", kms_mac_key_id="alias/hermit-mac",
                                  kms_region=REGION, kms_endpoint=local_kms.endpoint)
    return kms.wrapper_from(settings, local_kms.client()), key


def test_a_data_key_opens_for_its_own_context_only(wrapper: tuple[AwsKmsWrapper, str]
                                                   ) -> None:
    kw, key = wrapper
    assert kw.current_key_id() == key  # the alias resolved to the key's id
    dek = new_dek()
    wrapped = kw.wrap(dek, CTX.sandbox_bytes())
    assert wrapped.key_id == key and dek not in wrapped.blob
    assert kw.unwrap(wrapped, CTX.sandbox_bytes()) == dek
    # Another sandbox, or the same sandbox with another lineage: refused.
    for other in (OTHER, dataclasses.replace(CTX, lineage=("uid-src", "uid-box"))):
        with pytest.raises(CheckpointRefused, match=f"wrapped by KMS key '{key}' does not "
                                                    "open for this sandbox"):
            kw.unwrap(wrapped, other.sandbox_bytes())
    # A flipped byte in the length of the key's ARN, the nonce, the ciphertext or the tag;
    # or a truncated blob. (local-kms does not authenticate the ARN after that length when
    # Decrypt names the key, as AWS does; the key is named, so an altered ARN changes
    # nothing.)
    header = 1 + wrapped.blob[0] + 4
    for i in (0, header, (header + len(wrapped.blob)) // 2, len(wrapped.blob) - 1):
        tampered = bytearray(wrapped.blob)
        tampered[i] ^= 0x01
        with pytest.raises(CheckpointRefused, match=f"KMS key '{key}'"):
            kw.unwrap(dataclasses.replace(wrapped, blob=bytes(tampered)), CTX.sandbox_bytes())
    with pytest.raises(CheckpointRefused, match=f"KMS key '{key}'"):
        kw.unwrap(dataclasses.replace(wrapped, blob=wrapped.blob[:40]), CTX.sandbox_bytes())


def test_an_unknown_key_is_refused_naming_it(wrapper: tuple[AwsKmsWrapper, str],
                                             local_kms: LocalKms) -> None:
    kw, _ = wrapper
    wrapped = kw.wrap(new_dek(), CTX.sandbox_bytes())
    with pytest.raises(CheckpointRefused, match=f"KMS refused Decrypt with key '{UNKNOWN}'"):
        kw.unwrap(dataclasses.replace(wrapped, key_id=UNKNOWN), CTX.sandbox_bytes())
    with pytest.raises(CheckpointRefused, match="KMS refused DescribeKey with key "
                                                "'alias/nope': NotFoundException"):
        AwsKmsWrapper(local_kms.client(), "alias/nope").current_key_id()
    # A key record made under another key of the same KMS: Decrypt is told which key.
    other = local_kms.client().create_key()["KeyMetadata"]["KeyId"]
    foreign = AwsKmsWrapper(local_kms.client(), other).wrap(new_dek(), CTX.sandbox_bytes())
    with pytest.raises(CheckpointRefused, match=f"KMS key '{kw.current_key_id()}' does not "
                                                "open for this sandbox"):
        kw.unwrap(dataclasses.replace(foreign, key_id=kw.current_key_id()),
                  CTX.sandbox_bytes())


def test_manifests_are_signed_and_verified_with_the_kms_hmac_key(
        wrapper: tuple[AwsKmsWrapper, str]) -> None:
    kw, key = wrapper
    signature = kw.sign(key, b"signed bytes")
    assert kw.verify(key, b"signed bytes", signature)
    assert not kw.verify(key, b"signed bytez", signature)
    assert not kw.verify(key, b"signed bytes", bytes([signature[0] ^ 1]) + signature[1:])
    with pytest.raises(CheckpointRefused, match=f"sealing key '{UNKNOWN}' is not"):
        kw.verify(UNKNOWN, b"signed bytes", signature)
    # A sealed manifest whose data key KMS wraps opens, bound to its checkpoint.
    ctx = dataclasses.replace(CTX, checkpoint="cp-1")
    dek = new_dek()
    raw = seal_manifest(dek, kw.wrap(dek, ctx.sandbox_bytes()), ctx, b'{"m":1}')
    opened = open_manifest(kw, raw, Pin("tenants", "box", "cp-1", uid="uid-box"))
    assert (opened.dek, opened.plain) == (dek, b'{"m":1}')


def test_kms_that_does_not_answer_is_unavailable(wrapper: tuple[AwsKmsWrapper, str],
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    kw, key = wrapper
    wrapped = kw.wrap(new_dek(), CTX.sandbox_bytes())
    gone = LocalKms(tmp_path_factory.mktemp("gone-kms"))
    client = gone.client()
    gone.stop()
    with pytest.raises(KmsUnavailable, match=f"KMS Decrypt with key '{key}' failed"):
        AwsKmsWrapper(client, key).unwrap(wrapped, CTX.sandbox_bytes())
