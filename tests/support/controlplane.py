"""A throwaway Kubernetes control plane (etcd + kube-apiserver, built by hack/install-k8s)
for integration tests: ``control_plane`` (session scope) starts it on free ports in a
temporary directory (never the shared cluster) and stops it at the end. Missing binaries:
the test fails (never skips) and names the script to run. The process handling lives in
hermit_testbed.controlplane (bench/operator_scale.py uses it too)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from hermit_testbed.controlplane import ControlPlane, start_control_plane
from hermit_testbed.errors import TestbedError

__all__ = ["ControlPlane", "control_plane", "install_crds"]

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    try:
        plane = start_control_plane(tmp_path_factory.mktemp("controlplane"))
    except TestbedError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield plane
    finally:
        plane.stop()


def install_crds(api_client: client.ApiClient, timeout: float = 30.0) -> None:
    """Hermit's CRDs on the control plane (once per session: a second call finds them),
    served when this returns."""
    from hermit_common import api

    ext = client.ApiextensionsV1Api(api_client)
    for path in sorted(CRDS.glob("*.yaml")):
        try:
            ext.create_custom_resource_definition(yaml.safe_load(path.read_text()))
        except ApiException as exc:
            if exc.status != 409:
                raise
    custom = client.CustomObjectsApi(api_client)
    deadline = time.monotonic() + timeout
    while True:
        try:
            for plural in (api.SANDBOX_PLURAL, api.CHECKPOINT_PLURAL):
                custom.list_cluster_custom_object(api.GROUP, api.VERSION, plural)
            return
        except ApiException:
            assert time.monotonic() < deadline, f"the CRDs not served within {timeout:.0f} s"
            time.sleep(0.1)
