"""fdcheck: restored files carry no capability the new pod does not grant."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from hermit_common.errors import CheckpointRefused
from hermit_node.host import credcheck, fdcheck, protowire
from hermit_node.host.credcheck import Granted
from tests.support.pagemap import varint

DEFAULT_CAPS = 0x00000000A80425FB  # includes CAP_NET_RAW
NO_RAW = DEFAULT_CAPS & ~(1 << 13)


def pod(caps: int = NO_RAW) -> Granted:
    return Granted(uids=(0,) * 4, gids=(0,) * 4, groups=frozenset(), cap_inh=0,
                   cap_prm=caps, cap_eff=caps, cap_bnd=caps, cap_amb=0, no_new_privs=True,
                   seccomp_mode=2, seccomp_filters=1)


def _varint_field(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(value)) + value


def entry(kind: int, ident: int, inner: bytes = b"", inner_field: int = 3) -> bytes:
    body = _varint_field(1, kind) + _varint_field(2, ident)
    if inner:
        body += _bytes_field(inner_field, inner)
    return struct.pack("<I", len(body)) + body


def files_img(*entries: bytes) -> bytes:
    return struct.pack("<II", protowire.IMG_COMMON_MAGIC, fdcheck.FILES_MAGIC) + b"".join(entries)


def inet(sock_type: int) -> bytes:
    """An inet_sk_entry: id, ino, family, type, then a fixed64 field the walker skips."""
    return (_varint_field(1, 14) + _varint_field(2, 99) + _varint_field(3, 2)
            + _varint_field(4, sock_type) + varint(20 << 3 | 1) + bytes(8))


def test_ordinary_files_carry_nothing() -> None:
    raw = files_img(entry(1, 1, b"\x0a\x03abc"), entry(2, 3), entry(4, 14, inet(1), 4),
                    entry(5, 18), entry(13, 20))  # reg, pipe, tcp, unix, netlink
    assert list(fdcheck.file_kinds(raw)) == [(1, 1, None), (2, 3, None), (4, 14, 1),
                                             (5, 18, None), (13, 20, None)]
    assert fdcheck.privileged_files(raw) == []


@pytest.mark.parametrize("raw,what,cap", [
    (files_img(entry(10, 7)), "a packet socket", "CAP_NET_RAW"),
    (files_img(entry(4, 7, inet(3), 4)), "a raw socket", "CAP_NET_RAW"),
    (files_img(entry(4, 7, inet(10), 4)), "a raw socket", "CAP_NET_RAW"),
    (files_img(entry(15, 7)), "a tun device", "CAP_NET_ADMIN"),
    (files_img(entry(12, 7)), "a fanotify group", "CAP_SYS_ADMIN"),
    (files_img(entry(19, 7)), "a BPF map", "CAP_BPF"),
])
def test_a_file_that_carries_a_capability_needs_it(raw: bytes, what: str, cap: str) -> None:
    files = fdcheck.privileged_files(raw)
    assert fdcheck.violations(files, [], pod()) == [
        f"file 7 is {what}, which needs {cap}; the new pod does not grant it"]
    everything = pod((1 << 41) - 1)
    assert fdcheck.violations(files, [], everything) == []


def test_raw_sockets_restore_where_the_pod_grants_cap_net_raw() -> None:
    files = fdcheck.privileged_files(files_img(entry(10, 7), entry(4, 8, inet(3), 4)))
    assert fdcheck.violations(files, [], pod(DEFAULT_CAPS)) == []
    bpf = fdcheck.privileged_files(files_img(entry(19, 7)))
    assert fdcheck.violations(bpf, [], pod(NO_RAW | 1 << credcheck.CAP_SYS_ADMIN)) == []


def test_legacy_per_kind_images_are_refused(tmp_path: Path) -> None:
    (tmp_path / "packetsk.img").write_bytes(b"")
    files, legacy = fdcheck.read_files(tmp_path)
    assert (files, legacy) == ([], ["packetsk.img"])
    with pytest.raises(CheckpointRefused, match=r"^checkpoint a/b is refused: its open files "
                                                r"would carry more than the new pod grants: "
                                                r"packetsk\.img"):
        fdcheck.check(tmp_path, pod(), "checkpoint a/b")


def test_files_img_is_bounded_and_malformed_ones_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "files.img"
    path.write_bytes(files_img(entry(10, 7))[:-1])
    with pytest.raises(CheckpointRefused, match=r"files\.img cannot be parsed: truncated"):
        fdcheck.read_files(tmp_path)
    path.write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointRefused, match="not a files image"):
        fdcheck.read_files(tmp_path)
    with open(path, "wb") as f:
        f.truncate(fdcheck.MAX_FILES_IMAGE_BYTES + 1)
    with pytest.raises(CheckpointRefused, match=r"files\.img is 67108865 bytes, more than"):
        fdcheck.read_files(tmp_path)
    path.write_bytes(files_img(entry(1, 1)))
    fdcheck.check(tmp_path, pod(), "checkpoint a/b")
