"""The e2e helpers' view of hack/cluster's layout (tests/e2e/cluster.py LocalCluster) is
hack/cluster.d/env.sh's, for the first instance and the one hack/test ci adds."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]


def _env_sh(instance: str) -> dict[str, str]:
    names = ("BRIDGE", "BRIDGE_IP", "NODE_NET_PREFIX", "NETNS_PREFIX", "CLUSTER_DIR",
             "CLUSTER_VAR", "CLUSTER_RUN", "CGROUP_ROOT", "VETH_PREFIX", "ETCD_CLIENT_PORT",
             "CONTROLLER_MANAGER_PORT", "SCHEDULER_PORT", "POD_NET_PREFIX", "SERVICE_CIDR")
    script = ". hack/lib.sh; . hack/cluster.d/env.sh; " + "; ".join(
        f'echo "{n}=${n}"' for n in names)
    out = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "HERMIT_CLUSTER_INSTANCE": instance,
                              "HERMIT_CACHE": "/cache"}, check=False)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


@pytest.mark.parametrize("instance", [0, 1])
def test_the_helpers_see_the_layout_env_sh_makes(instance: int) -> None:
    env, mine = _env_sh(str(instance)), LocalCluster(instance)
    assert mine.host == env["BRIDGE_IP"] and mine.bridge == env["BRIDGE"]
    assert ipaddress.ip_address(f"{env['NODE_NET_PREFIX']}.11") in ipaddress.ip_network(
        mine.nodes)
    assert mine.netns("spot-1") == f"{env['NETNS_PREFIX']}spot-1"
    assert mine.cgroup_root == env["CGROUP_ROOT"]


def test_instance_0_keeps_its_names_and_instance_1_shares_none_of_them() -> None:
    first, second = _env_sh("0"), _env_sh("1")
    assert first == {
        "BRIDGE": "hermit-br0", "BRIDGE_IP": "10.213.0.1", "NODE_NET_PREFIX": "10.213.0",
        "NETNS_PREFIX": "hermit-", "CLUSTER_DIR": "/cache/cluster",
        "CLUSTER_VAR": "/var/lib/hermit-cluster", "CLUSTER_RUN": "/run/hermit-cluster",
        "CGROUP_ROOT": "hermit", "VETH_PREFIX": "hmv", "ETCD_CLIENT_PORT": "23790",
        "CONTROLLER_MANAGER_PORT": "10257", "SCHEDULER_PORT": "10259",
        "POD_NET_PREFIX": "10.214", "SERVICE_CIDR": "10.215.0.0/16"}
    for name, value in first.items():
        other = second[name]
        assert other != value, name
        # leftovers and down find their own by these (pgrep -f, grep ^name): neither may
        # contain the other's (ports are numbers; the cgroup root is a whole path segment)
        if name not in ("ETCD_CLIENT_PORT", "CONTROLLER_MANAGER_PORT", "SCHEDULER_PORT",
                        "CGROUP_ROOT"):
            assert value not in other and other not in value, (name, value, other)


def test_a_bad_instance_is_refused_by_name() -> None:
    out = subprocess.run(["bash", "-c", ". hack/lib.sh; . hack/cluster.d/env.sh"], cwd=REPO,
                         capture_output=True, text=True, check=False,
                         env={**os.environ, "HERMIT_CLUSTER_INSTANCE": "12"})
    assert out.returncode != 0 and "HERMIT_CLUSTER_INSTANCE must be 0-9" in out.stderr
