"""The chart's CRDs on a throwaway control plane (never the shared cluster).

CRDs that an older chart's crds/ folder installed (no Helm ownership, an older schema)
make `helm install` fail; hack/adopt-crds adopts them (twice: it is idempotent); the
chart then upgrades them to crds/ and `helm uninstall` keeps them. The e2e harness's
adoption (tests/support/crds.adopt_crds) moves them to another release the same way.
docs/operations.md#upgrading-hermit.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.support.chart import CHART, ROOT, find_helm
from tests.support.controlplane import ControlPlane, control_plane
from tests.support.crds import CRD_NAMES, CRDS, adopt_crds
from tests.support.wait import wait_until

__all__ = ["control_plane"]

pytestmark = pytest.mark.integration

# A CRDs-only release: with neither component the chart renders just the CRDs.
CRDS_ONLY = ["--set", "operator.enabled=false", "--set", "nodeAgent.enabled=false"]
KEEP = ("helm.sh/resource-policy", "keep")
OWNER = ("app.kubernetes.io/managed-by", "meta.helm.sh/release-name",
         "meta.helm.sh/release-namespace")


@pytest.fixture(scope="module")
def plane(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[tuple[ControlPlane, dict[str, str]]]:
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data")}
    yield control_plane, env


def _ext(plane: ControlPlane) -> client.ApiextensionsV1Api:
    api_client: Any = config.new_client_from_config(config_file=str(plane.kubeconfig))
    return client.ApiextensionsV1Api(api_client)


def _helm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    helm = find_helm()
    if helm is None:
        pytest.fail("no helm binary on PATH or in ~/.cache/hermit/bin: run hack/install-helm")
    return subprocess.run([helm, *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def _columns(crd: Any) -> list[str]:
    """The printer column names of the CRD's one version (a client object or a dict)."""
    if isinstance(crd, dict):
        return [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    return [c.name for c in crd.spec.versions[0].additional_printer_columns]


def _older(crd: dict[str, Any]) -> dict[str, Any]:
    """The CRD as an older release would have it: its last printer column missing."""
    old = copy.deepcopy(crd)
    old["spec"]["versions"][0]["additionalPrinterColumns"].pop()
    return old


def _established(ext: client.ApiextensionsV1Api, name: str) -> bool:
    try:
        status = ext.read_custom_resource_definition(name).status
    except ApiException:
        return False
    return any(c.type == "Established" and c.status == "True"
               for c in (status.conditions if status else None) or [])


def test_old_crds_are_adopted_then_upgraded_by_the_chart_and_kept(
        plane: tuple[ControlPlane, dict[str, str]]) -> None:
    cp, env = plane
    ext = _ext(cp)
    # As the chart's old crds/ folder (or kubectl apply) left them; replaced when another
    # module on this control plane installed them already.
    for crd in CRDS.values():
        old = _older(crd)
        try:
            ext.create_custom_resource_definition(old)
        except ApiException as exc:
            if exc.status != 409:
                raise
            current = ext.read_custom_resource_definition(crd["metadata"]["name"])
            old["metadata"]["resourceVersion"] = current.metadata.resource_version
            ext.replace_custom_resource_definition(crd["metadata"]["name"], old)
    for name in CRD_NAMES:
        wait_until(f"CRD {name} Established", 30, lambda n=name: _established(ext, n))

    refused = _helm(env, "install", "hermit", str(CHART), "-n", "hermit-system",
                    "--create-namespace", *CRDS_ONLY)
    assert refused.returncode != 0
    assert "invalid ownership metadata" in refused.stderr, refused.stderr

    adopt = [str(ROOT / "hack" / "adopt-crds"), "hermit", "hermit-system"]
    first = subprocess.run(adopt, env=env, capture_output=True, text=True, timeout=60,
                           check=False)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count("adopted into release hermit") == len(CRD_NAMES), first.stderr
    again = subprocess.run(adopt, env=env, capture_output=True, text=True, timeout=60,
                           check=False)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("already in release hermit") == len(CRD_NAMES), again.stderr

    installed = _helm(env, "install", "hermit", str(CHART), "-n", "hermit-system",
                      "--create-namespace", *CRDS_ONLY)
    assert installed.returncode == 0, installed.stderr
    by_name = {crd["metadata"]["name"]: crd for crd in CRDS.values()}
    for name in CRD_NAMES:
        live = ext.read_custom_resource_definition(name)
        # The chart's schema (crds/), not the older one: helm install updated it.
        assert _columns(live) == _columns(by_name[name]) != _columns(_older(by_name[name]))
        assert (live.metadata.annotations or {}).get(KEEP[0]) == KEEP[1], name

    uninstalled = _helm(env, "uninstall", "hermit", "-n", "hermit-system", "--wait")
    assert uninstalled.returncode == 0, uninstalled.stderr
    for name in CRD_NAMES:  # kept, with every AgentSandbox and Checkpoint in it
        assert _established(ext, name), name

    # Another release: refused until adopted (the e2e harness's way), then upgraded.
    other = ["install", "other", str(CHART), "-n", "other-ns", "--create-namespace",
             *CRDS_ONLY]
    assert _helm(env, *other).returncode != 0
    assert adopt_crds(ext, "other", "other-ns") == CRD_NAMES
    assert adopt_crds(ext, "other", "other-ns") == []
    moved = _helm(env, *other)
    assert moved.returncode == 0, moved.stderr
    for name in CRD_NAMES:
        meta = ext.read_custom_resource_definition(name).metadata
        annotations, labels = meta.annotations or {}, meta.labels or {}
        assert (labels[OWNER[0]], annotations[OWNER[1]], annotations[OWNER[2]]) == (
            "Helm", "other", "other-ns"), name
    assert _helm(env, "uninstall", "other", "-n", "other-ns", "--wait").returncode == 0


def test_an_upgrade_from_a_chart_with_a_crds_folder_adopts_and_a_rollback_keeps_them(
        plane: tuple[ControlPlane, dict[str, str]], tmp_path: Path) -> None:
    """The documented upgrade (docs/operations.md#upgrading-hermit): a release of the
    former chart layout (CRDs in crds/, older schema), hack/adopt-crds, `helm upgrade`;
    a rollback to the former release keeps the CRDs (crds.keep)."""
    cp, env = plane
    ext = _ext(cp)
    for name in CRD_NAMES:  # the former chart's crds/ folder installs only absent CRDs
        try:
            ext.delete_custom_resource_definition(name)
        except ApiException as exc:
            if exc.status != 404:
                raise
    for name in CRD_NAMES:
        _wait_gone(ext, name)
    former = tmp_path / "hermit"
    shutil.copytree(CHART, former)
    shutil.rmtree(former / "templates" / "crds")
    (former / "crds").mkdir()
    for crd in CRDS.values():
        (former / "crds" / f"{crd['spec']['names']['plural']}.yaml").write_text(
            yaml.safe_dump(_older(crd)))

    release = ["legacy", "-n", "legacy-ns"]
    first = _helm(env, "install", *release, str(former), "--create-namespace", *CRDS_ONLY)
    assert first.returncode == 0, first.stderr
    for name in CRD_NAMES:
        meta = ext.read_custom_resource_definition(name).metadata
        assert OWNER[0] not in (meta.labels or {}), name  # Helm's crds/: never owned

    upgrade = ["upgrade", *release, str(CHART), *CRDS_ONLY]
    refused = _helm(env, *upgrade)
    assert refused.returncode != 0
    assert "invalid ownership metadata" in refused.stderr, refused.stderr
    adopted = subprocess.run([str(ROOT / "hack" / "adopt-crds"), "legacy", "legacy-ns"],
                             env=env, capture_output=True, text=True, timeout=60, check=False)
    assert adopted.returncode == 0, adopted.stderr
    upgraded = _helm(env, *upgrade)
    assert upgraded.returncode == 0, upgraded.stderr
    by_name = {crd["metadata"]["name"]: crd for crd in CRDS.values()}
    for name in CRD_NAMES:
        assert _columns(ext.read_custom_resource_definition(name)) == \
            _columns(by_name[name]), name

    rolled_back = _helm(env, "rollback", *release, "1", "--wait")
    assert rolled_back.returncode == 0, rolled_back.stderr
    for name in CRD_NAMES:  # not in revision 1's manifest, yet kept
        assert _established(ext, name), name
    assert _helm(env, "uninstall", *release, "--wait").returncode == 0


# The API server's CRD finalizer deletes the instances and drops the storage before the
# CRD goes; on a loaded machine (this tier runs beside the e2e cluster) that took over 60 s.
CRD_DELETE_SECONDS = 180


def _wait_gone(ext: client.ApiextensionsV1Api, name: str) -> None:
    """Waits for CRD ``name`` to be deleted; fails with its conditions (the finalizer says
    in them what it waits for) when it is still there."""
    try:
        wait_until(f"CRD {name} gone", CRD_DELETE_SECONDS, lambda: not _exists(ext, name))
    except pytest.fail.Exception:
        crd: Any = ext.read_custom_resource_definition(name)
        conditions = [(c.type, c.status, c.reason, c.message)
                      for c in (crd.status.conditions if crd.status else None) or []]
        pytest.fail(f"CRD {name} still there {CRD_DELETE_SECONDS} s after its deletion "
                    f"(finalizers {crd.metadata.finalizers}): {conditions}")


def _exists(ext: client.ApiextensionsV1Api, name: str) -> bool:
    try:
        ext.read_custom_resource_definition(name)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True
