"""hack/push-images against a real OCI registry (CNCF Distribution v3, built by
hack/install-registry from its Go module) on loopback with htpasswd basic auth: the usual
`skopeo login` credentials push the operator, node-agent and init images, the printed helm
flags pin them by digest, and the manifests pulled back by digest are byte for byte the
ones hack/images/build made (issue 21, point 1).

The images are built into a temporary HERMIT_IMAGES_DIR (not the tarballs hack/cluster
imports); plain HTTP on loopback, so skopeo gets --tls-verify=false.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.registry import Registry

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with Registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, registry: Registry) -> dict[str, str]:
    """skopeo's usual credentials (an auth file written by `skopeo login`), and a private
    image directory."""
    d = tmp_path_factory.mktemp("push")
    e = {**os.environ, "REGISTRY_AUTH_FILE": str(d / "auth.json"),
         "HERMIT_IMAGES_DIR": str(d / "images")}
    login = subprocess.run(
        ["skopeo", "login", "--tls-verify=false", "-u", registry.user, "--password-stdin",
         registry.host], input=registry.password, capture_output=True, text=True, env=e,
        timeout=60, check=False)
    assert login.returncode == 0, login.stderr
    return e


def push(env: dict[str, str], prefix: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "hack/push-images"), prefix, "--", "--dest-tls-verify=false"],
        capture_output=True, text=True, env=env, timeout=1500, check=False)


def built_digest(archive: Path) -> str:
    with tarfile.open(archive) as tar:
        f = tar.extractfile("index.json")
        assert f is not None
        return str(json.loads(f.read())["manifests"][0]["digest"])


def test_push_and_pull_back_by_digest(registry: Registry, env: dict[str, str]) -> None:
    prefix = f"{registry.host}/platform/hermit"
    r = push(env, prefix)
    assert r.returncode == 0, r.stderr[-3000:]
    flags = r.stdout.strip().splitlines()[-1].split()
    values = dict(f.split("=", 1) for f in flags if f != "--set")
    images = Path(env["HERMIT_IMAGES_DIR"])
    expected = {"operator": built_digest(images / "hermit.tar"),
                "nodeAgent": built_digest(images / "hermit.tar"),
                "init": built_digest(images / "init.tar")}
    for key, name in (("operator", "operator"), ("nodeAgent", "node-agent"), ("init", "init")):
        assert values[f"{key}.image.repository"] == f"{prefix}/{name}"
        assert values[f"{key}.image.tag"] == "0.1.0"
        digest = values[f"{key}.image.digest"]
        assert digest == expected[key], "the registry keeps the reproducible digest"
        status, headers, body = registry.get(f"/v2/platform/hermit/{name}/manifests/{digest}")
        assert status == 200, body
        assert "sha256:" + hashlib.sha256(body).hexdigest() == digest
        assert headers.get("Docker-Content-Digest") == digest
        manifest = json.loads(body)
        assert manifest["annotations"]["org.opencontainers.image.version"] == "0.1.0"
        # the tag names the same manifest
        status, headers, _ = registry.get(f"/v2/platform/hermit/{name}/manifests/0.1.0")
        assert status == 200 and headers.get("Docker-Content-Digest") == digest
        # and every layer is there
        for layer in manifest["layers"]:
            status, _, _ = registry.get(f"/v2/platform/hermit/{name}/blobs/{layer['digest']}")
            assert status == 200


def test_push_without_credentials_is_refused(registry: Registry, env: dict[str, str],
                                             tmp_path: Path) -> None:
    (tmp_path / "empty.json").write_text("{}")
    r = push({**env, "REGISTRY_AUTH_FILE": str(tmp_path / "empty.json")},
             f"{registry.host}/anonymous/hermit")
    assert r.returncode != 0
    assert f"skopeo login {registry.host}" in r.stderr
    status, _, _ = registry.get("/v2/anonymous/hermit/init/tags/list")
    assert status == 404, "nothing was pushed"
