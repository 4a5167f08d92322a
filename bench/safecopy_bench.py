"""safecopy.copy_tree against the copier it replaced (cp -a --reflink=auto), side by side.

    sudo .venv/bin/python bench/safecopy_bench.py [--dir /var/tmp] [--mib 1024] [--rounds 3]

Builds a tree of about ``--mib`` MiB of mixed files under ``--dir`` (a quarter in a few
64 MiB files, a quarter in 1 MiB files, half in 16 KiB files across nested directories,
plus symlinks, hardlinks and a sparse file, as a workspace or an upperdir holds), then
copies it ``--rounds`` times with each copier, alternating, into the same filesystem (as
the engine copies into its work dir), after a ``sync`` so neither pays for the other's
writeback. It prints each wall and CPU time (user + system, children included), the
medians and the ratios safecopy / cp. Needs root (owners are kept).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from hermit_node.engine import safecopy

MIB = 1 << 20


def build(root: Path, mib: int) -> tuple[int, int]:
    """The tree; returns (files, bytes)."""
    files = written = 0
    blob = os.urandom(MIB)

    def put(path: Path, size: int) -> None:
        nonlocal files, written
        with open(path, "wb") as f:
            left = size
            while left > 0:
                f.write(blob[: min(left, MIB)])
                left -= MIB
        files += 1
        written += size

    (root / "big").mkdir(parents=True)
    for i in range(max(1, mib // 4 // 64)):
        put(root / "big" / f"blob{i}", 64 * MIB)
    (root / "mid").mkdir()
    for i in range(mib // 4):
        put(root / "mid" / f"f{i:04d}", MIB)
    small = mib // 2 * MIB // (16 << 10)
    for i in range(small):
        d = root / "src" / f"pkg{i // 200:03d}" / f"mod{i // 20 % 10}"
        if i % 20 == 0:
            d.mkdir(parents=True, exist_ok=True)
        put(d / f"file{i:06d}.py", 16 << 10)
        if i % 100 == 0:
            os.symlink(f"file{i:06d}.py", d / f"link{i:06d}")
            os.link(d / f"file{i:06d}.py", d / f"hard{i:06d}")
    with open(root / "sparse", "wb") as f:
        f.seek(256 * MIB)
        f.write(b"end")
    return files, written


def timed(fn: object, *args: object) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process and its children). The dirty pages
    of the previous round are flushed first, so neither copier pays for the other's."""
    subprocess.run(["sync"], check=True)
    before, started = os.times(), time.monotonic()
    fn(*args)  # type: ignore[operator]
    wall, after = time.monotonic() - started, os.times()
    cpu = sum(after[:4]) - sum(before[:4])
    return wall, cpu


def cp_a(source: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    subprocess.run(["cp", "-a", "--reflink=auto", f"{source}/.", str(dest)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="safecopy-bench-", dir=args.dir))
    try:
        files, size = build(base / "tree", args.mib)
        print(f"tree: {files} files, {size / MIB:.0f} MiB (+ a 256 MiB sparse file), "
              f"in {base}")
        walls: dict[str, list[float]] = {"cp -a": [], "safecopy": []}
        cpus: dict[str, list[float]] = {"cp -a": [], "safecopy": []}
        for r in range(args.rounds):
            for name, fn in (("cp -a", cp_a), ("safecopy", safecopy.copy_tree)):
                dest = base / f"copy-{r}-{name.replace(' ', '')}"
                wall, cpu = timed(fn, base / "tree", dest)
                walls[name].append(wall)
                cpus[name].append(cpu)
                print(f"round {r + 1}: {name:9s} {wall:7.2f} s wall, {cpu:6.2f} s CPU")
                shutil.rmtree(dest)
        for what, got in (("wall", walls), ("CPU", cpus)):
            cp, safe = statistics.median(got["cp -a"]), statistics.median(got["safecopy"])
            print(f"median {what}: cp -a {cp:.2f} s, safecopy {safe:.2f} s, ratio "
                  f"safecopy/cp {safe / cp:.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
