#!/usr/bin/env python3
"""Writes an OCI image layout tarball (`ctr images import` reads it) from layers.

Usage: oci.py --ref NAME:TAG [--ref NAME:TAG]... --out IMAGE.tar
              [--layer-dir DIR | --layer-tar TAR]... [--entrypoint JSON] [--cmd JSON]
              [--env K=V]... [--workdir DIR] [--label K=V]...

Layers are written deterministically (sorted names, mtime 0, no owner names) and
gzip-compressed deterministically (no file name, mtime 0, level 6), so the same inputs
give the same digests; a registry stores them as they are (skopeo copy
--preserve-digests). The config's `created` is
$SOURCE_DATE_EPOCH (the reproducible-builds convention; 0 when unset). Each --label goes
into the config's Labels (what `docker inspect` and scanners read) and the manifest's
annotations (what registries show), e.g. org.opencontainers.image.revision.
Prints the manifest digest. Standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

MT_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MT_CONFIG = "application/vnd.oci.image.config.v1+json"
MT_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
GZIP_LEVEL = 6


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.mtime = 0
    info.uname = ""
    info.gname = ""
    return info


def layer_from_dir(src: Path, out: Path) -> None:
    """Tars the contents of src (not src itself) into out, sorted, mtime 0."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(src):
            dirs.sort()
            for name in [*sorted(dirs), *sorted(files)]:
                full = Path(root) / name
                rel = full.relative_to(src).as_posix()
                tar.add(full, arcname=rel, recursive=False, filter=_clean)


def gzip_layer(src: Path, out: Path) -> str:
    """Compresses src into out with a fixed gzip header (no file name, mtime 0); returns
    the sha256 of the uncompressed tar (the layer's diff_id)."""
    h = hashlib.sha256()
    with src.open("rb") as f, out.open("wb") as raw, gzip.GzipFile(
            filename="", mode="wb", fileobj=raw, compresslevel=GZIP_LEVEL, mtime=0) as gz:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            gz.write(block)
    return h.hexdigest()


class Blobs:
    def __init__(self, layout: Path) -> None:
        self.dir = layout / "blobs" / "sha256"
        self.dir.mkdir(parents=True, exist_ok=True)

    def add_file(self, path: Path) -> tuple[str, int]:
        digest = _sha256_file(path)
        dest = self.dir / digest
        if not dest.exists():
            shutil.copyfile(path, dest)
        return digest, dest.stat().st_size

    def add_bytes(self, data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (self.dir / digest).write_bytes(data)
        return digest, len(data)


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def created(environ: dict[str, str] | os._Environ[str]) -> str:
    """$SOURCE_DATE_EPOCH as RFC 3339 UTC: the one timestamp in an image (never the clock)."""
    raw = environ.get("SOURCE_DATE_EPOCH", "0") or "0"
    if not raw.isdigit():
        raise ValueError(f"SOURCE_DATE_EPOCH={raw!r} is not a number of seconds")
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(raw)))


def _labels(pairs: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--label {pair!r} is not KEY=VALUE")
        out[key] = value
    return out


def build(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory(prefix="hermit-oci-", dir=args.tmpdir) as tmp:
        layout = Path(tmp) / "layout"
        blobs = Blobs(layout)
        layers: list[dict[str, Any]] = []
        diff_ids: list[str] = []
        for i, (kind, value) in enumerate(args.layers):
            if kind == "dir":
                tar_path = Path(tmp) / f"layer{i}.tar"
                layer_from_dir(Path(value), tar_path)
            else:
                tar_path = Path(value)
            gz_path = Path(tmp) / f"layer{i}.tar.gz"
            diff_id = gzip_layer(tar_path, gz_path)
            digest, size = blobs.add_file(gz_path)
            gz_path.unlink()
            layers.append({"mediaType": MT_LAYER, "digest": f"sha256:{digest}", "size": size})
            diff_ids.append(f"sha256:{diff_id}")
        cfg: dict[str, Any] = {
            "Env": args.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        }
        if args.entrypoint:
            cfg["Entrypoint"] = json.loads(args.entrypoint)
        if args.cmd:
            cfg["Cmd"] = json.loads(args.cmd)
        if args.workdir:
            cfg["WorkingDir"] = args.workdir
        labels = _labels(args.label)
        if labels:
            cfg["Labels"] = labels
        config = {
            "architecture": "amd64",
            "os": "linux",
            "created": created(os.environ),
            "config": cfg,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }
        cdigest, csize = blobs.add_bytes(_json(config))
        manifest = {
            "schemaVersion": 2,
            "mediaType": MT_MANIFEST,
            "config": {"mediaType": MT_CONFIG, "digest": f"sha256:{cdigest}", "size": csize},
            "layers": layers,
        }
        if labels:
            manifest["annotations"] = labels
        mdigest, msize = blobs.add_bytes(_json(manifest))
        entries = []
        for ref in args.ref:
            last = ref.rsplit("/", 1)[-1]
            tag = last.rsplit(":", 1)[1] if ":" in last else "latest"
            entries.append(
                {
                    "mediaType": MT_MANIFEST,
                    "digest": f"sha256:{mdigest}",
                    "size": msize,
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": tag,
                    },
                }
            )
        index = {"schemaVersion": 2, "manifests": entries}
        (layout / "index.json").write_bytes(_json(index))
        (layout / "oci-layout").write_bytes(_json({"imageLayoutVersion": "1.0.0"}))
        out = Path(args.out)
        partial = out.with_suffix(".partial")
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            for p in sorted(layout.rglob("*")):
                tar.add(p, arcname=p.relative_to(layout).as_posix(), recursive=False, filter=_clean)
        partial.replace(out)
        return f"sha256:{mdigest}"


class _LayerAction(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        ns: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        kind = "dir" if option_string == "--layer-dir" else "tar"
        ns.layers = [*(ns.layers or []), (kind, values)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", required=True, action="append")
    p.add_argument("--out", required=True)
    p.add_argument("--layer-dir", action=_LayerAction, dest="layers")
    p.add_argument("--layer-tar", action=_LayerAction, dest="layers")
    p.add_argument("--entrypoint")
    p.add_argument("--cmd")
    p.add_argument("--env", action="append")
    p.add_argument("--workdir")
    p.add_argument("--label", action="append")
    p.add_argument("--tmpdir")
    args = p.parse_args(argv)
    if not args.layers:
        p.error("at least one --layer-dir or --layer-tar is needed")
    try:
        print(build(args))
    except (OSError, ValueError, tarfile.TarError) as exc:
        print(f"oci.py: building {args.ref} failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
