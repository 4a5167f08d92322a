"""hack/images/build for real: every image twice from the same inputs gives the same
manifest digests (reproducible), each carries its provenance labels and an SPDX SBOM
beside it, the init image holds only hermit-init, and a missing CRIU or pycriu fails the
build naming hack/install-criu (issue 21, point 1).

The images are built into a temporary HERMIT_IMAGES_DIR (not the tarballs hack/cluster
imports); the Debian base rootfs comes from the shared cache (built on first use by
mmdebstrap). The hermit image installs the project's dependencies from PyPI.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from hermit_testbed.containerd import Containerd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
EPOCH = "1700000000"  # 2023-11-14T22:13:20Z
IMAGES = ("pause", "sandbox", "hermit", "init")


def build(images_dir: Path, *images: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "hack/images/build"), *images], capture_output=True, text=True,
        timeout=1500, check=False,
        env={**os.environ, "HERMIT_IMAGES_DIR": str(images_dir), "SOURCE_DATE_EPOCH": EPOCH,
             **env})


def blob(archive: Path, digest: str) -> Any:
    with tarfile.open(archive) as tar:
        f = tar.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
        assert f is not None
        return json.loads(f.read())


def index(archive: Path) -> dict[str, Any]:
    with tarfile.open(archive) as tar:
        f = tar.extractfile("index.json")
        assert f is not None
        return dict(json.loads(f.read()))


def manifest_digests(images_dir: Path) -> dict[str, str]:
    out = {}
    for name in IMAGES:
        digests = {m["digest"] for m in index(images_dir / f"{name}.tar")["manifests"]}
        assert len(digests) == 1, f"{name}: one manifest under every tag, got {digests}"
        out[name] = digests.pop()
    return out


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("images")
    first = build(d)
    assert first.returncode == 0, first.stderr[-3000:]
    return d


def test_same_inputs_same_digests(images_dir: Path) -> None:
    before = manifest_digests(images_dir)
    again = build(images_dir, HERMIT_IMAGES_REBUILD="1")
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(f"image hermit.local/{n}" in again.stderr for n in ("hermit", "init")), \
        "HERMIT_IMAGES_REBUILD=1 rebuilt them"
    assert manifest_digests(images_dir) == before


def test_provenance_labels(images_dir: Path) -> None:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    for name in IMAGES:
        archive = images_dir / f"{name}.tar"
        manifest = blob(archive, index(archive)["manifests"][0]["digest"])
        config = blob(archive, manifest["config"]["digest"])
        labels = config["config"]["Labels"]
        assert manifest["annotations"] == labels
        assert labels["org.opencontainers.image.revision"] == head
        assert labels["org.opencontainers.image.created"] == "2023-11-14T22:13:20Z"
        assert labels["org.opencontainers.image.version"] == "0.1.0"
        assert labels["org.opencontainers.image.title"] == name
        assert config["created"] == "2023-11-14T22:13:20Z"
        assert (config["architecture"], config["os"]) == ("amd64", "linux")


def test_sboms_list_what_is_inside(images_dir: Path) -> None:
    docs = {n: json.loads((images_dir / f"{n}.spdx.json").read_text()) for n in IMAGES}
    for doc in docs.values():
        assert doc["spdxVersion"] == "SPDX-2.3"
        assert doc["creationInfo"]["created"] == "2023-11-14T22:13:20Z"
    purls = {p["externalRefs"][0]["referenceLocator"].split("@")[0]
             for p in docs["hermit"]["packages"] if p.get("externalRefs")}
    assert {"pkg:deb/debian/python3", "pkg:deb/debian/libprotobuf-c1", "pkg:pypi/kopf",
            "pkg:pypi/boto3", "pkg:pypi/hermit"} <= purls
    files = {p["name"] for p in docs["hermit"]["packages"] if p.get("checksums")}
    assert files == {"criu", "pycriu", "hermit-init"}
    assert [p["name"] for p in docs["init"]["packages"][1:]] == ["hermit-init"]


def test_init_image_holds_only_hermit_init(images_dir: Path, tmp_path: Path) -> None:
    """Only the static binary, and small: what every sandbox pod pulls."""
    archive = images_dir / "init.tar"
    manifest = blob(archive, index(archive)["manifests"][0]["digest"])
    assert {m["annotations"]["io.containerd.image.name"]
            for m in index(archive)["manifests"]} == {"hermit.local/init:dev",
                                                       "docker.io/hermit/init:0.1.0"}
    [layer] = manifest["layers"]
    with tarfile.open(archive) as tar:
        tar.extract(f"blobs/sha256/{layer['digest'].removeprefix('sha256:')}", tmp_path,
                    filter="data")
    blob_path = tmp_path / "blobs/sha256" / layer["digest"].removeprefix("sha256:")
    with tarfile.open(blob_path, "r:gz") as t:
        files = {m.name: m for m in t.getmembers() if not m.isdir()}
        assert list(files) == ["usr/local/bin/hermit-init"]
        assert files["usr/local/bin/hermit-init"].mode == 0o755
        t.extract("usr/local/bin/hermit-init", tmp_path, filter="data")
    version = subprocess.run([tmp_path / "usr/local/bin/hermit-init", "--version"],
                             capture_output=True, text=True, check=True)
    assert version.stdout.startswith("hermit-init ")
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+gzip"
    assert layer["size"] < 1024 * 1024, "a static binary, not a distribution"


@pytest.mark.parametrize("var", ["HERMIT_IMAGE_CRIU", "HERMIT_IMAGE_PYCRIU"])
def test_missing_criu_or_pycriu_fails_the_build(tmp_path: Path, var: str) -> None:
    r = build(tmp_path, "hermit", **{var: str(tmp_path / "nothing-here")})
    assert r.returncode != 0
    assert "missing: run hack/install-criu" in r.stderr
    assert not list(tmp_path.glob("hermit-*.tar")), "no image without it"


def test_containerd_imports_and_runs_them(images_dir: Path, containerd_daemon: Containerd,
                                          tmp_path: Path) -> None:
    """A real containerd (what hack/cluster load-images imports into) takes the gzip
    archives under every tag with the archives' digests, and the init image's only binary
    installs itself as a sandbox pod's init container does."""
    refs = [m["annotations"]["io.containerd.image.name"]
            for name in ("init", "hermit") for m in index(images_dir / f"{name}.tar")["manifests"]]
    try:
        for name in ("init", "hermit"):
            archive = images_dir / f"{name}.tar"
            containerd_daemon.ctr("images", "import", "--snapshotter",
                                  containerd_daemon.snapshotter, str(archive), timeout=300)
            digest = index(archive)["manifests"][0]["digest"]
            for m in index(archive)["manifests"]:
                ref = m["annotations"]["io.containerd.image.name"]
                assert containerd_daemon.image_digest(ref) == digest
        out = tmp_path / "hermit"
        out.mkdir()
        cid = "init-install"
        containerd_daemon.ctr(
            "run", "--rm", "--snapshotter", containerd_daemon.snapshotter,
            "--runc-root", str(containerd_daemon.runc_root),
            "--cgroup", f"{containerd_daemon.cgroup_parent}/{cid}",
            "--mount", f"type=bind,src={out},dst=/.hermit,options=rbind:rw",
            "hermit.local/init:dev", cid, "/usr/local/bin/hermit-init", "--install",
            "/.hermit/hermit-init", timeout=120)
    finally:
        for ref in refs:
            containerd_daemon.ctr("images", "rm", ref, check=False)
    installed = out / "hermit-init"
    assert installed.stat().st_mode & 0o777 == 0o755
    version = subprocess.run([installed, "--version"], capture_output=True, text=True,
                             check=True)
    assert version.stdout.startswith("hermit-init ")
