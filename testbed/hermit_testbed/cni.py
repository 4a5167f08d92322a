"""Network namespaces wired up by the real CNI plugins (bridge + host-local + loopback).

Like kubelet + containerd's CRI: a namespace is created under /run/netns, then the
plugin binaries from /usr/lib/cni are executed with ``CNI_COMMAND=ADD`` and the
network config on stdin. All traffic stays on a private bridge of this machine.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from hermit_testbed.errors import TestbedError
from hermit_testbed.proc import run
from hermit_testbed.procfs import ns_inode

CNI_PLUGIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
NETNS_DIR = Path("/run/netns")
CNI_VERSION = "1.0.0"
_MAX_NETWORKS = 64


@dataclass(frozen=True)
class Netns:
    """A network namespace with one CNI interface (``eth0``)."""

    name: str
    path: Path
    ip: str
    prefix_len: int
    gateway: str
    container_id: str

    def inode(self) -> int:
        """Inode of the namespace (what ``/proc/<pid>/ns/net`` of a member points to)."""
        return os.stat(self.path).st_ino


def plugin_dir() -> Path:
    """The directory holding the CNI plugin binaries."""
    for d in CNI_PLUGIN_DIRS:
        if (d / "bridge").exists():
            return d
    raise TestbedError("CNI plugins not found: run hack/install-containerd")


def bridge_config(
    name: str, bridge: str, subnet: str, gateway: str, ipam_dir: Path
) -> dict[str, Any]:
    """The CNI network config for a gateway bridge with host-local IPAM."""
    return {
        "cniVersion": CNI_VERSION,
        "name": name,
        "type": "bridge",
        "bridge": bridge,
        "isGateway": True,
        "ipMasq": False,
        "hairpinMode": True,
        "ipam": {
            "type": "host-local",
            "ranges": [[{"subnet": subnet, "gateway": gateway}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": str(ipam_dir),
        },
    }


def loopback_config() -> dict[str, Any]:
    """The CNI config that brings ``lo`` up."""
    return {"cniVersion": CNI_VERSION, "name": "lo", "type": "loopback"}


def parse_result(stdout: str) -> tuple[str, int]:
    """The first IPv4 address and prefix length in a CNI ADD result."""
    result = json.loads(stdout)
    for ip in result.get("ips", []):
        iface = ipaddress.ip_interface(ip["address"])
        if iface.version == 4:
            return str(iface.ip), iface.network.prefixlen
    raise TestbedError(f"CNI result has no IPv4 address: {stdout.strip()[:200]}")


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


class CniNetwork:
    """A private bridge network; ``add`` makes a netns attached to it, ``close`` removes all.

    Without ``bridge``/``subnet`` it picks the first free ``hermitN`` bridge and
    ``10.88.(100+N).0/24`` under a machine-wide lock, so parallel test sessions
    do not collide.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        bridge: str | None = None,
        subnet: str | None = None,
        name: str = "hermit",
    ) -> None:
        self.state_dir = state_dir
        self.name = name
        self.bridge = bridge or ""
        self.subnet = subnet or ""
        self._netns: dict[str, Netns] = {}
        self._created_bridge = False
        self._plugins = plugin_dir()

    # -- lifecycle ---------------------------------------------------------------

    def setup(self) -> CniNetwork:
        """Reserve and create the bridge. Idempotent."""
        if self._created_bridge or (self.bridge and _link_exists(self.bridge)):
            return self
        # Bridges are a machine-wide resource, so the lock is too (not per cache).
        with open("/run/lock/hermit-testbed-net.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not self.bridge:
                for n in range(_MAX_NETWORKS):
                    if not _link_exists(f"hermit{n}"):
                        self.bridge = f"hermit{n}"
                        self.subnet = self.subnet or f"10.88.{100 + n}.0/24"
                        break
                else:
                    raise TestbedError("no free hermitN bridge name: delete stale hermit bridges")
            if not self.subnet:
                raise TestbedError(f"CNI network {self.name}: a subnet is required with a bridge")
            run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._created_bridge = True
            run(["ip", "link", "set", self.bridge, "up"])
        self.ipam_dir.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def ipam_dir(self) -> Path:
        return self.state_dir / "ipam"

    @property
    def gateway(self) -> str:
        return str(next(ipaddress.ip_network(self.subnet).hosts()))

    def close(self) -> None:
        """Delete every namespace made here, then the bridge and IPAM state."""
        errors: list[str] = []
        for netns in list(self._netns.values()):
            try:
                self.delete(netns)
            except TestbedError as exc:
                errors.append(str(exc))
        if self._created_bridge and _link_exists(self.bridge):
            run(["ip", "link", "del", self.bridge], check=False)
        self._created_bridge = False
        shutil.rmtree(self.ipam_dir, ignore_errors=True)
        if errors:
            raise TestbedError(f"CNI teardown of {self.bridge} failed: {errors[0]}")

    def __enter__(self) -> CniNetwork:
        return self.setup()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- namespaces --------------------------------------------------------------

    def _exec(
        self,
        plugin: str,
        command: str,
        config: dict[str, Any],
        netns: Netns | str,
        container_id: str,
    ) -> str:
        path = netns.path if isinstance(netns, Netns) else Path(netns)
        env = dict(os.environ)
        env.update(
            {
                "CNI_COMMAND": command,
                "CNI_CONTAINERID": container_id,
                "CNI_NETNS": str(path),
                "CNI_IFNAME": "lo" if plugin == "loopback" else "eth0",
                "CNI_PATH": str(self._plugins),
            }
        )
        proc = run(
            [str(self._plugins / plugin)],
            input_text=json.dumps(config),
            env=env,
            check=False,
            timeout=30,
        )
        if proc.returncode != 0:
            try:
                msg = json.loads(proc.stdout).get("msg", "")
            except ValueError:
                msg = (proc.stderr or proc.stdout).strip()
            raise TestbedError(f"CNI {plugin} {command} for {container_id} failed: {msg}")
        return proc.stdout

    def _config(self) -> dict[str, Any]:
        return bridge_config(self.name, self.bridge, self.subnet, self.gateway, self.ipam_dir)

    def add(self, name: str) -> Netns:
        """Create netns ``<bridge>-<name>`` under /run/netns and attach it (ADD)."""
        self.setup()
        ns_name = f"{self.bridge}-{name}"
        path = NETNS_DIR / ns_name
        if ns_name in self._netns:
            raise TestbedError(f"netns {ns_name} already exists")
        if path.exists():  # left over from a crashed run
            run(["ip", "netns", "del", ns_name], check=False)
        run(["ip", "netns", "add", ns_name])
        container_id = f"hermit-{ns_name}"
        try:
            self._exec("loopback", "ADD", loopback_config(), str(path), container_id)
            out = self._exec("bridge", "ADD", self._config(), str(path), container_id)
            ip, prefix = parse_result(out)
        except TestbedError:
            self._exec("bridge", "DEL", self._config(), str(path), container_id)
            run(["ip", "netns", "del", ns_name], check=False)
            raise
        netns = Netns(ns_name, path, ip, prefix, self.gateway, container_id)
        self._netns[ns_name] = netns
        return netns

    def delete(self, netns: Netns) -> None:
        """Detach the namespace (DEL) and remove it."""
        try:
            if netns.path.exists():
                self._exec("bridge", "DEL", self._config(), netns, netns.container_id)
                self._exec("loopback", "DEL", loopback_config(), netns, netns.container_id)
        finally:
            run(["ip", "netns", "del", netns.name], check=False)
            self._netns.pop(netns.name, None)

    def namespaces(self) -> list[Netns]:
        return list(self._netns.values())


def netns_inode_of(pid: int) -> int:
    """Inode of the network namespace of ``pid``."""
    return ns_inode(pid, "net")
