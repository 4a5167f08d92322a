"""A throwaway Kubernetes control plane (etcd + kube-apiserver, built by hack/install-k8s)
for integration tests: ``control_plane`` (session scope) starts it on free ports in a
temporary directory (never the shared cluster) and stops it at the end. Missing binaries:
the test fails (never skips) and names the script to run. The process handling lives in
hermit_testbed.controlplane (bench/operator_scale.py uses it too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hermit_testbed.controlplane import ControlPlane, start_control_plane
from hermit_testbed.errors import TestbedError

__all__ = ["ControlPlane", "control_plane"]


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
