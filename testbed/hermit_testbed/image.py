"""OCI image layout tarballs that ``ctr images import`` accepts, and a busybox rootfs.

``build_image`` is deterministic: files are added sorted, with fixed mtimes and
owners, so the same rootfs and config always give the same manifest digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import tarfile
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from hermit_testbed.errors import TestbedError
from hermit_testbed.proc import run

FIXED_MTIME = 946684800  # 2000-01-01T00:00:00Z
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
ANNOTATION_REF = "org.opencontainers.image.ref.name"
ANNOTATION_CONTAINERD_NAME = "io.containerd.image.name"
HERMIT_CACHE = Path(os.environ.get("HERMIT_CACHE", str(Path.home() / ".cache" / "hermit")))

_ARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le"}


def oci_arch() -> str:
    """This machine's architecture in OCI terms (amd64, arm64, ...)."""
    machine = platform.machine()
    return _ARCH.get(machine, machine)


def _walk_sorted(root: Path) -> Iterator[Path]:
    """Every path under ``root`` (not root itself), parents before children, sorted by name."""
    for name in sorted(os.listdir(root)):
        path = root / name
        yield path
        if path.is_dir() and not path.is_symlink():
            yield from _walk_sorted(path)


def _layer_tarinfo(tar: tarfile.TarFile, path: Path, arcname: str) -> tarfile.TarInfo | None:
    info = tar.gettarinfo(str(path), arcname)
    if info.type not in (
        tarfile.REGTYPE,
        tarfile.AREGTYPE,
        tarfile.DIRTYPE,
        tarfile.SYMTYPE,
        tarfile.LNKTYPE,
        tarfile.CHRTYPE,
        tarfile.BLKTYPE,
        tarfile.FIFOTYPE,
    ):
        return None  # sockets and the like have no place in an image
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_layer(rootfs_dir: Path, out: IO[bytes]) -> None:
    """Write ``rootfs_dir`` as an uncompressed, deterministic layer tar to ``out``."""
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk_sorted(rootfs_dir):
            arcname = path.relative_to(rootfs_dir).as_posix()
            info = _layer_tarinfo(tar, path, arcname)
            if info is None:
                continue
            if info.isreg():
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)


def _hash_file(f: IO[bytes]) -> tuple[str, int]:
    """sha256 digest and size of an open file, read from the start."""
    f.seek(0)
    sha = hashlib.sha256()
    size = 0
    while chunk := f.read(1 << 20):
        sha.update(chunk)
        size += len(chunk)
    return "sha256:" + sha.hexdigest(), size


def _json_blob(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = FIXED_MTIME
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mtime = FIXED_MTIME
    info.mode = 0o755
    tar.addfile(info)


def image_config(
    diff_id: str,
    *,
    entrypoint: Sequence[str] | None,
    cmd: Sequence[str] | None,
    env: Mapping[str, str] | None,
    workdir: str,
) -> dict[str, Any]:
    """The OCI image config for one layer with ``diff_id``."""
    environment = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    environment.update(env or {})
    config: dict[str, Any] = {
        "Env": [f"{k}={v}" for k, v in environment.items()],
        "WorkingDir": workdir,
    }
    if entrypoint is not None:
        config["Entrypoint"] = list(entrypoint)
    if cmd is not None:
        config["Cmd"] = list(cmd)
    return {
        "architecture": oci_arch(),
        "os": "linux",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }


def build_image(
    rootfs_dir: Path,
    ref: str,
    out_tar: Path,
    *,
    entrypoint: Sequence[str] | None = None,
    cmd: Sequence[str] | None = ("/bin/sh",),
    env: Mapping[str, str] | None = None,
    workdir: str = "/",
) -> Path:
    """Write an OCI image layout tarball of ``rootfs_dir`` named ``ref`` to ``out_tar``.

    ``ref`` should be a full reference such as ``hermit.local/busybox:latest``;
    containerd records it verbatim as the image name. Returns ``out_tar``.
    """
    if not rootfs_dir.is_dir():
        raise TestbedError(f"cannot build image {ref}: {rootfs_dir} is not a directory")
    out_tar.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out_tar.parent) as layer_file:
        write_layer(rootfs_dir, layer_file)
        layer_digest, layer_size = _hash_file(layer_file)
        config = _json_blob(
            image_config(layer_digest, entrypoint=entrypoint, cmd=cmd, env=env, workdir=workdir)
        )
        manifest = _json_blob(
            {
                "schemaVersion": 2,
                "mediaType": MEDIA_MANIFEST,
                "config": {"mediaType": MEDIA_CONFIG, "digest": _sha(config), "size": len(config)},
                "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": layer_size}],
            }
        )
        index = _json_blob(
            {
                "schemaVersion": 2,
                "mediaType": MEDIA_INDEX,
                "manifests": [
                    {
                        "mediaType": MEDIA_MANIFEST,
                        "digest": _sha(manifest),
                        "size": len(manifest),
                        "platform": {"architecture": oci_arch(), "os": "linux"},
                        "annotations": {ANNOTATION_REF: ref, ANNOTATION_CONTAINERD_NAME: ref},
                    }
                ],
            }
        )
        tmp_out = out_tar.with_name(out_tar.name + ".tmp")
        with tarfile.open(tmp_out, mode="w", format=tarfile.PAX_FORMAT) as tar:
            _add_bytes(tar, "oci-layout", _json_blob({"imageLayoutVersion": "1.0.0"}))
            _add_bytes(tar, "index.json", index)
            _add_dir(tar, "blobs")
            _add_dir(tar, "blobs/sha256")
            _add_bytes(tar, f"blobs/sha256/{_sha(config)[7:]}", config)
            _add_bytes(tar, f"blobs/sha256/{_sha(manifest)[7:]}", manifest)
            layer_info = tarfile.TarInfo(f"blobs/sha256/{layer_digest[7:]}")
            layer_info.size = layer_size
            layer_info.mtime = FIXED_MTIME
            layer_info.mode = 0o644
            layer_file.seek(0)
            tar.addfile(layer_info, layer_file)
        tmp_out.replace(out_tar)
    return out_tar


def read_index(tar_path: Path) -> dict[str, Any]:
    """The index.json of an OCI layout tarball."""
    with tarfile.open(tar_path) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise TestbedError(f"{tar_path} has no index.json")
        index: dict[str, Any] = json.loads(member.read())
    return index


def image_digest(tar_path: Path) -> str:
    """The manifest digest of an OCI layout tarball: what containerd reports after import."""
    manifests = read_index(tar_path).get("manifests", [])
    if len(manifests) != 1:
        raise TestbedError(f"{tar_path} holds {len(manifests)} manifests, expected 1")
    return str(manifests[0]["digest"])


def image_ref(tar_path: Path) -> str:
    """The image name recorded in an OCI layout tarball's index."""
    manifests = read_index(tar_path).get("manifests", [])
    for m in manifests:
        annotations = m.get("annotations", {})
        name = annotations.get(ANNOTATION_CONTAINERD_NAME) or annotations.get(ANNOTATION_REF)
        if name:
            return str(name)
    raise TestbedError(f"{tar_path} names no image (no {ANNOTATION_REF} annotation)")


# --- busybox rootfs -----------------------------------------------------------------


def _installed_version(package: str) -> str | None:
    proc = run(["dpkg-query", "-W", "-f=${Status} ${Version}", package], check=False)
    if proc.returncode == 0 and proc.stdout.startswith("install ok installed"):
        return proc.stdout.split()[-1]
    return None


def busybox_binary() -> Path:
    """A static busybox binary from Debian's busybox-static package.

    Uses the installed package when present, otherwise ``apt-get download`` +
    ``dpkg-deb -x`` into ``$HERMIT_CACHE/busybox-static/<version>`` (cached).
    """
    if _installed_version("busybox-static") is not None and Path("/bin/busybox").exists():
        return Path("/bin/busybox")
    cached = sorted((HERMIT_CACHE / "busybox-static").glob("*/bin/busybox"))
    if cached:
        return cached[-1]
    policy = run(["apt-cache", "policy", "busybox-static"]).stdout
    version = next(
        (ln.split()[1] for ln in policy.splitlines() if ln.strip().startswith("Candidate:")),
        None,
    )
    if not version or version == "(none)":
        raise TestbedError("busybox-static is not available from apt: run apt-get update")
    target = HERMIT_CACHE / "busybox-static" / version
    binary = target / "bin" / "busybox"
    if binary.exists():
        return binary
    HERMIT_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=HERMIT_CACHE) as tmp:
        run(["apt-get", "download", f"busybox-static={version}"], timeout=300, cwd=tmp)
        debs = sorted(Path(tmp).glob("busybox-static_*.deb"))
        if not debs:
            raise TestbedError("apt-get download busybox-static produced no .deb")
        deb = debs[-1]
        staging = Path(tmp) / "x"
        run(["dpkg-deb", "-x", str(deb), str(staging)])
        target.parent.mkdir(parents=True, exist_ok=True)
        staging.replace(target)
    if not binary.exists():
        raise TestbedError(f"busybox-static package has no bin/busybox under {target}")
    return binary


_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"
_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost\n"


def busybox_rootfs(dest: Path) -> Path:
    """Make a minimal rootfs at ``dest``: static busybox with its applets in /bin.

    Has /bin/sh, /sbin and /usr/bin (symlinks to /bin), /tmp (1777), /root,
    /proc, /sys, /dev and /etc/{passwd,group,hosts}. Callers add their own
    binaries on top. Returns ``dest``.
    """
    binary = busybox_binary()
    bindir = dest / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(binary, bindir / "busybox")
    (bindir / "busybox").chmod(0o755)
    applets = run([str(binary), "--list"]).stdout.split()
    for applet in applets:
        link = bindir / applet
        if applet != "busybox" and not link.exists() and not link.is_symlink():
            link.symlink_to("busybox")
    for name in ("proc", "sys", "dev", "root", "etc", "usr", "var", "run"):
        (dest / name).mkdir(exist_ok=True)
    tmp = dest / "tmp"
    tmp.mkdir(exist_ok=True)
    tmp.chmod(0o1777)
    for link_path, target in ((dest / "sbin", "bin"), (dest / "usr" / "bin", "../bin")):
        if not link_path.exists() and not link_path.is_symlink():
            link_path.symlink_to(target)
    (dest / "etc" / "passwd").write_text(_PASSWD, encoding="utf-8")
    (dest / "etc" / "group").write_text(_GROUP, encoding="utf-8")
    (dest / "etc" / "hosts").write_text(_HOSTS, encoding="utf-8")
    return dest
