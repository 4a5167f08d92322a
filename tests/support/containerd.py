"""A real private containerd + runc + CNI bridge for integration tests.

Fixtures (hack/install-containerd installs containerd, runc and the CNI plugins):

- ``containerd_daemon`` (session): a running ``hermit_testbed.Containerd`` under a
  tmp dir, namespace ``hermit``; stopped at session end (fails if anything is left).
- ``cni_network`` (session): a private ``CniNetwork`` (bridge ``hermitN``, 10.88.x/24).
- ``make_netns`` (function): ``make_netns(name) -> Netns``; removed after the test.
- ``busybox_rootfs_dir`` / ``busybox_image`` (session): a busybox rootfs and its image
  (``BUSYBOX_REF``) imported into ``containerd_daemon``.

``two_nodes(base, image_tar, cgroup=..., runtime=...)`` (a context manager, for the
migration tests' module fixtures): node A and node B, each a private containerd with
``image_tar`` imported, both of the cgroup flavour ``cgroup`` (``CGROUP_FLAVOURS``: "v1"
is the host's layout, "v2" a daemon whose mount namespace has cgroup2 on /sys/fs/cgroup)
and the runtime flavour ``runtime`` ("debian": containerd 1.6 and runc from Debian;
"ctrd2": containerd 2.x and a current runc from hack/install-containerd2).

A node flavour in a test id is ``<cgroup>`` for Debian's runtime and ``ctrd2-<cgroup>``
for containerd 2 (``split_flavour``); ``CTRD2_FLAVOURS`` are the ones that run here:
containerd 2 on cgroup v2, what managed node images run.

Missing binaries fail the test (never skip) and name the script to run.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hermit_testbed.cni import CniNetwork, Netns, plugin_dir
from hermit_testbed.containerd import (
    CGROUP_FLAVOURS,
    CONTAINERD2_HINT,
    Containerd,
    containerd2_bin_dir,
)
from hermit_testbed.errors import TestbedError
from hermit_testbed.image import build_image, busybox_rootfs
from hermit_testbed.scenario import Node

BUSYBOX_REF = "hermit.local/busybox:latest"
REQUIRED_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "runc")
INSTALL_HINT = "containerd/runc not found: run hack/install-containerd"
CTRD2_FLAVOURS = ("ctrd2-v2",)
RUNTIME_PREFIX = "ctrd2-"


def split_flavour(flavour: str) -> tuple[str, str]:
    """A node flavour -> (runtime flavour, cgroup flavour): "v2" -> ("debian", "v2"),
    "ctrd2-v2" -> ("ctrd2", "v2")."""
    if flavour.startswith(RUNTIME_PREFIX):
        return "ctrd2", flavour.removeprefix(RUNTIME_PREFIX)
    return "debian", flavour


def require_containerd(runtime: str = "debian") -> None:
    """Fail the test when containerd, its runc shim, ctr, runc or the CNI plugins of the
    runtime flavour are missing."""
    path = "/usr/local/bin:/usr/bin:/usr/sbin:/sbin:/bin"
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]
    if missing:
        pytest.fail(f"{INSTALL_HINT} (missing: {', '.join(missing)})", pytrace=False)
    if runtime == "ctrd2":
        bin_dir = containerd2_bin_dir()
        missing = [b for b in REQUIRED_BINARIES if shutil.which(b, path=str(bin_dir)) is None]
        if missing:
            pytest.fail(f"containerd 2 / runc not found in {bin_dir}: {CONTAINERD2_HINT} "
                        f"(missing: {', '.join(missing)})", pytrace=False)
    try:
        plugin_dir()
    except TestbedError as exc:
        pytest.fail(f"{exc}", pytrace=False)


__all__ = ["CGROUP_FLAVOURS", "CTRD2_FLAVOURS", "require_containerd", "split_flavour",
           "two_nodes"]


@contextmanager
def two_nodes(base: Path, image_tar: Path, *, cgroup: str = "v1",
              runtime: str = "debian") -> Iterator[tuple[Node, Node]]:
    """Node A and node B: two private containerd daemons under ``base``, each with the
    sandbox image ``image_tar`` imported and a work dir of its own."""
    with Containerd(base / "node-a", cgroup=cgroup, runtime=runtime) as cd_a, \
            Containerd(base / "node-b", cgroup=cgroup, runtime=runtime) as cd_b:
        pair = (Node("node-a", cd_a, base / "work-a"), Node("node-b", cd_b, base / "work-b"))
        for node in pair:
            node.work_dir.mkdir()
            node.image_ref = node.containerd.import_image(image_tar)
        yield pair


@pytest.fixture(scope="session")
def containerd_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Containerd]:
    """A running private containerd for the whole session."""
    require_containerd()
    daemon = Containerd(tmp_path_factory.mktemp("containerd"))
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="session")
def cni_network(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CniNetwork]:
    """A private CNI bridge network for the whole session."""
    require_containerd()
    with CniNetwork(tmp_path_factory.mktemp("cni")) as network:
        yield network


@pytest.fixture
def make_netns(cni_network: CniNetwork) -> Iterator[Callable[[str], Netns]]:
    """Factory for CNI-wired network namespaces; each is removed when the test ends."""
    made: list[Netns] = []

    def make(name: str) -> Netns:
        netns = cni_network.add(name)
        made.append(netns)
        return netns

    yield make
    for netns in reversed(made):
        cni_network.delete(netns)


@pytest.fixture(scope="session")
def busybox_rootfs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A minimal busybox rootfs (copy it before adding files of your own)."""
    return busybox_rootfs(tmp_path_factory.mktemp("busybox") / "rootfs")


@pytest.fixture(scope="session")
def busybox_image(
    containerd_daemon: Containerd,
    busybox_rootfs_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """``BUSYBOX_REF`` built from ``busybox_rootfs_dir`` and imported; returns the ref."""
    tar = build_image(
        busybox_rootfs_dir, BUSYBOX_REF, tmp_path_factory.mktemp("images") / "busybox.tar"
    )
    return containerd_daemon.import_image(tar)
