"""seal.py: data keys, chunk sealing, manifest envelopes, keyrings and rotation."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hermit_common import seal
from hermit_common.errors import CheckpointRefused, SettingsError
from hermit_common.pin import Pin
from hermit_common.seal import (
    ChunkCipher,
    Context,
    Keyring,
    KeyringWrapper,
    Wrapped,
    is_sealed,
    new_dek,
    seal_manifest,
    sealing_from,
)
from hermit_common.settings import SealSettings

CTX = Context("team-a", "box", "uid-1", "ckpt-1", "ckpt-0", ("uid-0", "uid-1"))
MANIFEST = b'{"marker":"SECRET-MARKER-123"}'


def _b64key(seed: bytes) -> str:
    return base64.b64encode(hashlib.sha256(seed).digest()).decode()


class _Ring:
    """A keyring that a test rotates in place."""

    def __init__(self, current: str, *ids: str) -> None:
        self.data = {"current": current, **{i: _b64key(i.encode()) for i in ids}}

    def load(self) -> Keyring:
        return Keyring.from_mapping(self.data, "test keys")

    def wrapper(self) -> KeyringWrapper:
        return KeyringWrapper(self.load)


def _sealed(wrapper: KeyringWrapper, ctx: Context = CTX,
            body: bytes = MANIFEST) -> tuple[bytes, bytes]:
    dek = new_dek()
    wrapped = wrapper.wrap(dek, ctx.sandbox_bytes())
    return seal_manifest(dek, wrapped, ctx, body), dek


def _location(ctx: Context) -> Pin:
    return Pin(ctx.namespace, ctx.sandbox, ctx.checkpoint)


def open_manifest(wrapper: KeyringWrapper, raw: bytes, where: Pin,
                  uid: str | None) -> tuple[bytes, bytes]:
    opened = seal.open_manifest(wrapper, raw, dataclasses.replace(where, uid=uid))
    return opened.plain, opened.dek


def test_manifest_round_trip_hides_plaintext() -> None:
    wrapper = _Ring("k1", "k1").wrapper()
    raw, dek = _sealed(wrapper)
    assert is_sealed(raw) and not is_sealed(MANIFEST)
    assert b"SECRET-MARKER" not in raw
    plain, got_dek = open_manifest(wrapper, raw, _location(CTX), "uid-1")
    assert plain == MANIFEST and got_dek == dek
    assert open_manifest(wrapper, raw, _location(CTX), None)[0] == MANIFEST


# What refuses an altered field of a format-3 envelope, before anything is decrypted: the
# wrapped DEK does not open for the claimed context (the KEK's authenticated encryption),
# the claimed context is malformed, or the signature under the DEK does not verify.
NOT_OPENED = "does not open for this sandbox"


@pytest.mark.parametrize("field, refusal", [
    ("ciphertext", "signature"), ("dek", NOT_OPENED), ("nonce", "signature"),
    ("kek", NOT_OPENED), ("context", "sealed lineage is not")])
def test_any_altered_field_is_refused(field: str, refusal: str) -> None:
    wrapper = _Ring("k1", "k1", "k2").wrapper()
    raw, _ = _sealed(wrapper)
    envelope = json.loads(raw)
    if field == "context":
        envelope["context"]["sandbox_uid"] = "uid-2"
    elif field == "kek":
        envelope["kek"] = "k2"
    else:
        blob = bytearray(base64.b64decode(envelope[field]))
        blob[0] ^= 1
        envelope[field] = base64.b64encode(bytes(blob)).decode()
    with pytest.raises(CheckpointRefused, match=refusal):
        open_manifest(wrapper, json.dumps(envelope).encode(), _location(CTX), "uid-1")


def test_a_non_canonical_base64_field_is_refused() -> None:
    """A changed padding bit decodes to the same bytes: refused all the same, in every
    field (it was what made the flipped-byte test below fail now and then)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    wrapper = _Ring("k1", "k1").wrapper()
    tried = 0
    for _ in range(20):  # random nonces and keys: not every field ends padded each time
        raw, _ = _sealed(wrapper)
        for field, value in json.loads(raw).items():
            if not (isinstance(value, str) and value.endswith("=")):
                continue
            envelope = json.loads(raw)
            text = value.rstrip("=")
            odd = text[:-1] + alphabet[alphabet.index(text[-1]) ^ 1] + "=" * (
                len(value) - len(text))
            assert base64.b64decode(odd) == base64.b64decode(value)
            envelope[field] = odd
            tried += 1
            with pytest.raises(CheckpointRefused):
                open_manifest(wrapper, json.dumps(envelope).encode(), _location(CTX), "uid-1")
    assert tried


def test_flipped_byte_anywhere_is_refused() -> None:
    wrapper = _Ring("k1", "k1").wrapper()
    raw, _ = _sealed(wrapper)
    for i in range(0, len(raw), 7):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(CheckpointRefused):
            open_manifest(wrapper, bytes(bad), _location(CTX), "uid-1")


@pytest.mark.parametrize("where, uid", [
    (Pin("team-b", "box", "ckpt-1"), "uid-1"),  # another namespace
    (Pin("team-a", "other", "ckpt-1"), "uid-1"),  # another sandbox
    (Pin("team-a", "box", "ckpt-2"), "uid-1"),  # swapped for another checkpoint
    (Pin("team-a", "box", "ckpt-1"), "uid-2"),  # a sandbox recreated with the name
])
def test_wrong_context_is_refused(where: Pin, uid: str) -> None:
    wrapper = _Ring("k1", "k1").wrapper()
    raw, _ = _sealed(wrapper)
    with pytest.raises(CheckpointRefused, match="sealed for checkpoint team-a/ckpt-1"):
        open_manifest(wrapper, raw, where, uid)


def test_foreign_keyring_is_refused() -> None:
    raw, _ = _sealed(_Ring("k1", "k1").wrapper())
    other = _Ring("k1", "k1")
    other.data["k1"] = _b64key(b"another cluster")
    with pytest.raises(CheckpointRefused, match=NOT_OPENED):
        open_manifest(other.wrapper(), raw, _location(CTX), "uid-1")


def test_rotation() -> None:
    ring = _Ring("1", "1")
    wrapper = ring.wrapper()
    old, _ = _sealed(wrapper)
    ring.data.update({"current": "2", "2": _b64key(b"2")})
    assert open_manifest(wrapper, old, _location(CTX), "uid-1")[0] == MANIFEST
    new, _ = _sealed(wrapper)
    assert json.loads(new)["kek"] == "2" and json.loads(old)["kek"] == "1"
    del ring.data["1"]
    assert open_manifest(wrapper, new, _location(CTX), "uid-1")[0] == MANIFEST
    with pytest.raises(CheckpointRefused, match="sealing key '1' is not in the sealing Secret"):
        open_manifest(wrapper, old, _location(CTX), "uid-1")


def test_rewrap_keeps_the_data_key() -> None:
    ring = _Ring("1", "1", "2")
    wrapper = ring.wrapper()
    dek = new_dek()
    first = wrapper.wrap(dek, CTX.sandbox_bytes())
    ring.data["current"] = "2"
    second = wrapper.wrap(wrapper.unwrap(first, CTX.sandbox_bytes()), CTX.sandbox_bytes())
    assert second.key_id == "2"
    assert wrapper.unwrap(second, CTX.sandbox_bytes()) == dek
    assert Wrapped.from_bytes(second.to_bytes()) == second
    with pytest.raises(CheckpointRefused, match="does not open"):
        wrapper.unwrap(second, Context("team-b", "box", "uid-1").sandbox_bytes())
    other_lineage = dataclasses.replace(CTX, lineage=("uid-9", "uid-1"))
    with pytest.raises(CheckpointRefused, match="does not open"):
        wrapper.unwrap(second, other_lineage.sandbox_bytes())  # another lineage


def test_chunks_are_deterministic_per_data_key() -> None:
    dek = new_dek()
    data = b"chunk with SECRET-MARKER-123" * 100
    digest = hashlib.sha256(data).hexdigest()
    a, b = ChunkCipher(dek), ChunkCipher(dek)
    assert a.name(digest) == b.name(digest) and a.name(digest) != digest
    assert a.seal(a.name(digest), data) == b.seal(b.name(digest), data)
    assert b"SECRET-MARKER" not in a.seal(a.name(digest), data)
    other = ChunkCipher(new_dek())
    assert other.name(digest) != a.name(digest)
    assert a.open(a.name(digest), a.seal(a.name(digest), data)) == data


def test_chunk_nonces_differ_for_different_bytes() -> None:
    cipher = ChunkCipher(new_dek())
    name = cipher.name("00" * 32)
    one, two = cipher.seal(name, b"one"), cipher.seal(name, b"two")
    assert one[4:16] != two[4:16]  # no nonce reuse, even under the same name


def test_chunk_tamper_and_swap_are_refused() -> None:
    cipher = ChunkCipher(new_dek())
    n1, n2 = cipher.name("11" * 32), cipher.name("22" * 32)
    body = bytearray(cipher.seal(n1, b"payload"))
    with pytest.raises(CheckpointRefused, match="does not decrypt"):
        cipher.open(n2, bytes(body))  # stored under another chunk's name
    body[-1] ^= 1
    with pytest.raises(CheckpointRefused, match="does not decrypt"):
        cipher.open(n1, bytes(body))
    with pytest.raises(CheckpointRefused, match="not a sealed chunk"):
        cipher.open(n1, b"(\xb5/\xfd plain zstd")


def test_keyring_validation() -> None:
    good = _b64key(b"x")
    with pytest.raises(SettingsError, match="no 'current'"):
        Keyring.from_mapping({"k": good}, "s")
    with pytest.raises(SettingsError, match="current key 'k2' is not in it"):
        Keyring.from_mapping({"current": "k2", "k": good}, "s")
    with pytest.raises(SettingsError, match="has 3 bytes"):
        Keyring.from_mapping({"current": "k", "k": base64.b64encode(b"abc").decode()}, "s")
    with pytest.raises(SettingsError, match="not base64"):
        Keyring.from_mapping({"current": "k", "k": "!!!"}, "s")
    ring = Keyring.from_mapping({"current": "k", "k": good}, "s")
    assert repr(ring) == "Keyring(current='k')"  # key bytes never in a repr


def test_sealing_from_a_mounted_secret(tmp_path: Path) -> None:
    assert sealing_from(SealSettings()) is None
    data = tmp_path / "..2026_data"
    data.mkdir()
    (data / "current").write_text("k1")
    (data / "k1").write_text(_b64key(b"k1"))
    for name in ("current", "k1"):  # as the kubelet lays a Secret volume out
        os.symlink(f"..2026_data/{name}", tmp_path / name)
    os.symlink("..2026_data", tmp_path / "..data")
    sealing = sealing_from(SealSettings(keys_dir=str(tmp_path), accept_plain=True))
    assert sealing is not None and sealing.accept_plain
    assert sealing.wrapper.current_key_id() == "k1"
    with pytest.raises(SettingsError, match="HERMIT_SEAL_KEYS_DIR=/nonexistent"):
        sealing_from(SealSettings(keys_dir="/nonexistent"))
    assert SealSettings.from_env({"HERMIT_SEAL_KEYS_DIR": "/k",
                                  "HERMIT_SEAL_ACCEPT_PLAIN": "true"}) == \
        SealSettings("/k", True)


@pytest.mark.parametrize("expect, says", [
    (Pin("team-a", "box", "ckpt-1", "uid-1", parent="ckpt-x"),
     "sealed with parent checkpoint 'ckpt-0', but the Checkpoint records 'ckpt-x'"),
    (Pin("team-a", "box", "ckpt-1", "uid-1", parent=""),
     "sealed with parent checkpoint 'ckpt-0', but the Checkpoint records '(none)'"),
    (Pin("team-a", "box", "ckpt-1", "uid-1", lineage=("uid-1",)),
     "sealed for sandbox lineage uid-0/uid-1, but the Checkpoint records uid-1"),
    (Pin("team-a", "box", "ckpt-1", "uid-1", lineage=("uid-7", "uid-1")),
     "sealed for sandbox lineage uid-0/uid-1, but the Checkpoint records uid-7/uid-1"),
])
def test_a_swapped_parent_or_lineage_is_refused(expect: Pin, says: str) -> None:
    wrapper = _Ring("k1", "k1").wrapper()
    raw, _ = _sealed(wrapper)
    with pytest.raises(CheckpointRefused, match=re.escape(says)):
        seal.open_manifest(wrapper, raw, expect)
    right = dataclasses.replace(expect, parent="ckpt-0", lineage=("uid-0", "uid-1"))
    assert seal.open_manifest(wrapper, raw, right).context == CTX


@pytest.mark.parametrize("field, value, refusal", [
    ("parent", "ckpt-x", "signature"),  # signed under the DEK
    ("lineage", ["uid-7", "uid-1"], NOT_OPENED)])  # also binds the wrapped DEK
def test_parent_and_lineage_are_signed(field: str, value: object, refusal: str) -> None:
    wrapper = _Ring("k1", "k1").wrapper()
    raw, _ = _sealed(wrapper)
    envelope = json.loads(raw)
    envelope["context"][field] = value
    with pytest.raises(CheckpointRefused, match=refusal):
        open_manifest(wrapper, json.dumps(envelope).encode(), _location(CTX), "uid-1")


@pytest.mark.parametrize("lineage", [(), ("uid-1", "uid-0"), ("uid-1", "uid-1"),
                                     ("bad uid", "uid-1"),
                                     (*(f"u{i}" for i in range(64)), "uid-1")])
def test_a_malformed_lineage_is_not_sealed(lineage: tuple[str, ...]) -> None:
    wrapper = _Ring("k1", "k1").wrapper()
    with pytest.raises(CheckpointRefused, match="lineage"):
        _sealed(wrapper, dataclasses.replace(CTX, lineage=lineage))


def _sealed_v1(wrapper: KeyringWrapper, ctx: Context) -> bytes:
    """A manifest as the first sealed format wrote it: no parent, no lineage."""
    dek, nonce = new_dek(), os.urandom(12)
    context = {"namespace": ctx.namespace, "sandbox": ctx.sandbox,
               "sandbox_uid": ctx.sandbox_uid, "checkpoint": ctx.checkpoint}
    wrapped = wrapper.wrap(dek, Context(ctx.namespace, ctx.sandbox,
                                        ctx.sandbox_uid).sandbox_bytes())
    canonical = json.dumps(context, sort_keys=True, separators=(",", ":")).encode()
    envelope = {"sealed": 1, "context": context, "kek": wrapped.key_id,
                "dek": base64.b64encode(wrapped.blob).decode(),
                "nonce": base64.b64encode(nonce).decode(),
                "ciphertext": base64.b64encode(
                    AESGCM(dek).encrypt(nonce, MANIFEST, canonical)).decode()}
    body = json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()
    envelope["signature"] = base64.b64encode(
        wrapper.sign(wrapped.key_id, b"hermit/manifest/v1\0" + body)).decode()
    return json.dumps(envelope, sort_keys=True, separators=(",", ":")).encode()


def test_the_first_format_verifies_under_its_own_rules() -> None:
    """Manifests sealed before parent and lineage were signed still restore (their
    namespace, sandbox, uid and checkpoint are checked; parent and lineage cannot be)."""
    wrapper = _Ring("k1", "k1").wrapper()
    raw = _sealed_v1(wrapper, CTX)
    opened = seal.open_manifest(wrapper, raw, Pin("team-a", "box", "ckpt-1", "uid-1",
                                                       parent="ckpt-0",
                                                       lineage=("uid-0", "uid-1")))
    assert opened.plain == MANIFEST and opened.context.lineage == ()
    with pytest.raises(CheckpointRefused, match="sealed for checkpoint"):
        seal.open_manifest(wrapper, raw, Pin("team-a", "box", "ckpt-1", "uid-2"))
    envelope = json.loads(raw)
    envelope["context"]["lineage"] = ["uid-1"]  # upgrading it in place breaks the signature
    with pytest.raises(CheckpointRefused, match="signature"):
        seal.open_manifest(wrapper, json.dumps(envelope).encode(),
                           Pin("team-a", "box", "ckpt-1"))
    envelope = json.loads(raw)
    envelope["sealed"] = 2  # a first-format body presented as the second: not signed so
    with pytest.raises(CheckpointRefused, match="signature"):
        seal.open_manifest(wrapper, json.dumps(envelope).encode(),
                           Pin("team-a", "box", "ckpt-1"))


def test_key_records_carry_their_lineage() -> None:
    wrapper = _Ring("k1", "k1").wrapper()
    dek = new_dek()
    record = dataclasses.replace(wrapper.wrap(dek, CTX.sandbox_bytes()),
                                 lineage=CTX.lineage, source="box-src")
    again = Wrapped.from_bytes(record.to_bytes())
    assert again == record and b"uid-0" in record.to_bytes()
    assert wrapper.unwrap(again, dataclasses.replace(CTX, lineage=again.lineage)
                          .sandbox_bytes()) == dek
    old = Wrapped.from_bytes(json.dumps({"kek": "k1", "dek": "AAAA"}).encode())
    assert old.lineage == () and old.source == ""
    with pytest.raises(CheckpointRefused, match="malformed"):
        Wrapped.from_bytes(json.dumps({"kek": "k1", "dek": "AAAA", "lineage": "x"}).encode())


def _sealed_v2(wrapper: KeyringWrapper, ctx: Context = CTX) -> bytes:
    """A manifest as format 2 sealed it (before format 3): signed under the KEK."""
    dek = new_dek()
    wrapped = wrapper.wrap(dek, ctx.sandbox_bytes())
    nonce = os.urandom(seal.NONCE_BYTES)
    envelope = {"sealed": seal.SEALED_FORMAT_V2, "context": ctx.to_dict(),
                "kek": wrapped.key_id, "dek": seal.b64(wrapped.blob), "nonce": seal.b64(nonce),
                "ciphertext": seal.b64(AESGCM(dek).encrypt(
                    nonce, MANIFEST, seal._canonical(ctx.to_dict())))}
    envelope["signature"] = seal.b64(wrapper.sign(wrapped.key_id,
                                                  seal._signed_bytes(envelope)))
    return seal._canonical(envelope)


def test_format_3_signs_under_the_data_key_and_format_2_still_opens() -> None:
    """Format 3 needs no KEK to seal (the signature is the DEK's): a node-agent seals its
    sandbox's checkpoints with the data key alone. A format-2 manifest (KEK-signed)
    still opens, and a change to it still fails its KEK signature."""
    wrapper = _Ring("k1", "k1").wrapper()
    raw, _ = _sealed(wrapper)
    assert json.loads(raw)["sealed"] == seal.SEALED_FORMAT == 3

    class NoSigning:  # a wrapper that must not be asked to sign or verify for format 3
        current_key_id, wrap, unwrap = (wrapper.current_key_id, wrapper.wrap,
                                        wrapper.unwrap)

        def sign(self, key_id: str, data: bytes) -> bytes:
            raise AssertionError("format 3 asked the KEK to sign")

        def verify(self, key_id: str, data: bytes, signature: bytes) -> bool:
            raise AssertionError("format 3 asked the KEK to verify")

    assert seal.open_manifest(NoSigning(), raw, _location(CTX)).plain == MANIFEST
    old = _sealed_v2(wrapper)
    assert seal.open_manifest(wrapper, old, _location(CTX)).plain == MANIFEST
    envelope = json.loads(old)
    envelope["context"]["parent"] = "ckpt-x"
    with pytest.raises(CheckpointRefused, match="signature"):
        seal.open_manifest(wrapper, json.dumps(envelope).encode(), _location(CTX))
