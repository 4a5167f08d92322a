"""What a compromised node does to a real CRIU dump before it uploads it: rewrite its
images with pycriu (CRIU's own image codec, so the result is a dump CRIU would accept).

Used by the integration tests (a ForgingCriu that rewrites right after the dump) and by
the e2e attack (a checkpoint downloaded from the bucket, rewritten, uploaded again).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

CAP_SETS = ("cap_inh", "cap_prm", "cap_eff", "cap_bnd", "cap_amb")


def rewrite(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Rewrites the first entry of a CRIU image with pycriu."""
    import pycriu.images

    with path.open("rb") as f:
        image = pycriu.images.load(f)
    change(image["entries"][0])
    with path.open("wb") as f:
        pycriu.images.dump(image, f)


def rewrite_all(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Rewrites every entry of a CRIU image with pycriu."""
    import pycriu.images

    with path.open("rb") as f:
        image = pycriu.images.load(f)
    for entry in image["entries"]:
        change(entry)
    with path.open("wb") as f:
        pycriu.images.dump(image, f)


def capabilities_of(pid: int, proc: Path = Path("/proc")) -> int:
    """Every capability process ``pid`` can give away (its permitted set within its
    bounding set): for a node-agent, the most its CRIU can restore a process with. (Bits
    beyond that, up to the kernel's last capability, CRIU itself could not grant: a forge
    asking for them would fail in CRIU even without Hermit's check.)"""
    fields = dict(line.split(":", 1) for line in
                  (proc / str(pid) / "status").read_text().splitlines() if ":" in line)
    return int(fields["CapPrm"], 16) & int(fields["CapBnd"], 16)


def all_caps(caps: int) -> Callable[[Path], None]:
    """A forge: every thread's core image (core-*.img under the images directory) asks for
    ``caps`` in all five sets (inheritable, permitted, effective, bounding, ambient)."""
    words = [caps & 0xFFFFFFFF, caps >> 32]

    def forge(images: Path) -> None:
        cores = sorted(images.glob("core-*.img"))
        if not cores:
            raise AssertionError(f"no core-*.img under {images}: nothing to forge")
        for path in cores:
            rewrite(path, lambda e: e["thread_core"]["creds"].update(
                {name: list(words) for name in CAP_SETS}))
    return forge


def caps_of(images: Path) -> dict[str, set[int]]:
    """cap set -> the distinct masks the threads' core images hold (to check a forge)."""
    import pycriu.images

    out: dict[str, set[int]] = {name: set() for name in CAP_SETS}
    for path in sorted(images.glob("core-*.img")):
        with path.open("rb") as f:
            creds = pycriu.images.load(f)["entries"][0]["thread_core"]["creds"]
        for name in CAP_SETS:
            words = creds.get(name) or [0, 0]
            out[name].add(int(words[0]) | int(words[1]) << 32)
    return out
