"""Restored file descriptors carry no capability the new container does not grant.

CRIU creates a checkpoint's sockets and special files as host root and hands them to
the restored processes. Some carry the privilege they were created with for as long as
they are open: a packet or raw socket (CAP_NET_RAW at creation, none to use it: sniff
and forge frames on the pod's network, ARP-spoof its node neighbours), a tun device
(CAP_NET_ADMIN), a fanotify group (CAP_SYS_ADMIN), a BPF map (CAP_BPF). A forged
``files.img`` could hand them to a sandbox whose pod grants none of these. So each
such file in the images needs its capability in the new container's init's permitted
set (credcheck.Granted.has).

``files.img`` can be large (one entry per open file of the tree), so it is read with a
lean protobuf walker that keeps nothing but the kinds found, not with pycriu. The
per-type images of CRIU before files.img (inetsk.img, packetsk.img, ...), which CRIU
still reads, are refused: this project's CRIU never writes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from hermit_common.errors import CheckpointRefused
from hermit_node.host import credcheck, criu, protowire

FILES_MAGIC: Final = 0x56303138
# file_entry.type (images/fdinfo.proto) -> (what, capability it needs, its name)
FD_INETSK: Final = 4
FD_PACKETSK: Final = 10
FD_FANOTIFY: Final = 12
FD_TUNF: Final = 15
FD_BPFMAP: Final = 19
SOCK_RAW: Final = 3
SOCK_PACKET: Final = 10
CAP_NET_ADMIN: Final = 12
CAP_NET_RAW: Final = 13
CAP_BPF: Final = 39
NEEDS: Final = {FD_PACKETSK: ("a packet socket", CAP_NET_RAW),
                FD_TUNF: ("a tun device", CAP_NET_ADMIN),
                FD_FANOTIFY: ("a fanotify group", credcheck.CAP_SYS_ADMIN),
                FD_BPFMAP: ("a BPF map", CAP_BPF)}
RAW_SOCKET: Final = ("a raw socket", CAP_NET_RAW)
# Before files.img: one image per kind, still read by CRIU's restore.
LEGACY_IMAGES: Final = ("inetsk.img", "packetsk.img", "netlinksk.img", "tunfile.img",
                        "fanotify.img", "bpfmap-file.img")
# One entry is 30-300 bytes: 64 MiB is a few hundred thousand open files, more than the
# default RLIMIT_NOFILE of a whole tree of processes.
MAX_FILES_IMAGE_BYTES: Final = 64 << 20


@dataclass(frozen=True)
class PrivilegedFile:
    id: int  # file_entry.id (the fdinfo images of each task point at it)
    what: str
    cap: int


def file_kinds(raw: bytes) -> Iterator[tuple[int, int, int | None]]:
    """(file_entry.type, id, inet socket type or None) of each entry of a ``files.img``
    (pure; raises protowire.WireError)."""
    for entry in protowire.entries(raw, FILES_MAGIC, "files"):
        kind = ident = 0
        isk_type = None
        for number, value in protowire.fields(entry):
            if number == 1 and isinstance(value, int):
                kind = value
            elif number == 2 and isinstance(value, int):
                ident = value
            elif number == 4 and isinstance(value, bytes):  # inet_sk_entry
                found = next((v for n, v in protowire.fields(value) if n == 4), None)
                isk_type = found if isinstance(found, int) else None
        yield kind, ident, isk_type


def privileged_files(raw: bytes) -> list[PrivilegedFile]:
    """The files of a ``files.img`` that carry a capability (pure)."""
    out = []
    for kind, ident, isk_type in file_kinds(raw):
        need = NEEDS.get(kind)
        if kind == FD_INETSK and isk_type in (SOCK_RAW, SOCK_PACKET):
            need = RAW_SOCKET
        if need is not None:
            out.append(PrivilegedFile(ident, *need))
    return out


def violations(files: list[PrivilegedFile], legacy: list[str],
               granted: credcheck.Granted) -> list[str]:
    out = [f"{name} (a per-kind image CRIU before files.img wrote; this CRIU never does)"
           for name in legacy]
    out += [f"file {f.id} is {f.what}, which needs {credcheck.cap_names(1 << f.cap)}; "
            "the new pod does not grant it" for f in files if not granted.has(f.cap)
            and not (f.cap == CAP_BPF and granted.has(credcheck.CAP_SYS_ADMIN))]
    return out


def read_files(images_dir: Path) -> tuple[list[PrivilegedFile], list[str]]:
    """The privileged files of ``images_dir``'s files.img, and the legacy images there."""
    legacy = [name for name in LEGACY_IMAGES if (images_dir / name).exists()]
    path = images_dir / "files.img"
    if not path.exists():
        return [], legacy
    raw = criu.read_image_bytes(path, MAX_FILES_IMAGE_BYTES)
    try:
        return privileged_files(raw), legacy
    except protowire.WireError as exc:
        raise CheckpointRefused(f"CRIU image files.img cannot be parsed: {exc}") from None


def check(images_dir: Path, granted: credcheck.Granted, what: str, shown: int = 6) -> None:
    found = violations(*read_files(images_dir), granted)
    if found:
        more = f"; and {len(found) - shown} more" if len(found) > shown else ""
        raise CheckpointRefused(f"{what} is refused: its open files would carry more than "
                                f"the new pod grants: {'; '.join(found[:shown])}{more}")
