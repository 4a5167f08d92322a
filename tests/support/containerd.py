"""A real private containerd + runc + CNI bridge for integration tests.

Fixtures (hack/install-containerd installs containerd, runc and the CNI plugins):

- ``containerd_daemon`` (session): a running ``hermit_testbed.Containerd`` under a
  tmp dir, namespace ``hermit``; stopped at session end (fails if anything is left).
- ``cni_network`` (session): a private ``CniNetwork`` (bridge ``hermitN``, 10.88.x/24).
- ``make_netns`` (function): ``make_netns(name) -> Netns``; removed after the test.
- ``busybox_rootfs_dir`` / ``busybox_image`` (session): a busybox rootfs and its image
  (``BUSYBOX_REF``) imported into ``containerd_daemon``.

``two_nodes(base, image_tar, cgroup=...)`` (a context manager, for the migration tests'
module fixtures): node A and node B, each a private containerd with ``image_tar``
imported, both of the cgroup flavour ``cgroup`` (``CGROUP_FLAVOURS``: "v1" is the
host's layout, "v2" a daemon whose mount namespace has cgroup2 on /sys/fs/cgroup).

Missing binaries fail the test (never skip) and name the script to run.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hermit_testbed.cni import CniNetwork, Netns, plugin_dir
from hermit_testbed.containerd import CGROUP_FLAVOURS, Containerd
from hermit_testbed.errors import TestbedError
from hermit_testbed.image import build_image, busybox_rootfs
from hermit_testbed.scenario import Node

BUSYBOX_REF = "hermit.local/busybox:latest"
REQUIRED_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "runc")
INSTALL_HINT = "containerd/runc not found: run hack/install-containerd"


def require_containerd() -> None:
    """Fail the test when containerd, its runc shim, ctr, runc or the CNI plugins are missing."""
    path = "/usr/local/bin:/usr/bin:/usr/sbin:/sbin:/bin"
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]
    if missing:
        pytest.fail(f"{INSTALL_HINT} (missing: {', '.join(missing)})", pytrace=False)
    try:
        plugin_dir()
    except TestbedError as exc:
        pytest.fail(f"{exc}", pytrace=False)


__all__ = ["CGROUP_FLAVOURS", "require_containerd", "two_nodes"]


@contextmanager
def two_nodes(base: Path, image_tar: Path, *,
              cgroup: str = "v1") -> Iterator[tuple[Node, Node]]:
    """Node A and node B: two private containerd daemons under ``base``, each with the
    sandbox image ``image_tar`` imported and a work dir of its own."""
    with Containerd(base / "node-a", cgroup=cgroup) as cd_a, \
            Containerd(base / "node-b", cgroup=cgroup) as cd_b:
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
