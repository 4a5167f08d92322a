"""The testbed runs real containers the way kubelet + containerd do (no Kubernetes)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hermit_testbed.cni import CniNetwork, Netns
from hermit_testbed.container import Mount
from hermit_testbed.containerd import Containerd
from hermit_testbed.image import build_image, image_digest
from hermit_testbed.proc import pid_alive
from hermit_testbed.procfs import parse_mountinfo
from tests.support.containerd import BUSYBOX_REF, require_containerd
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

PORT = 8080


def _wait_tcp(ip: str, port: int, timeout: float) -> bytes:
    """Connect to ip:port until it answers (deadline ``timeout``); return what it sends."""
    deadline = time.monotonic() + timeout
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((ip, port), timeout=2) as conn:
                conn.settimeout(5)
                return conn.recv(100)
        except OSError as exc:
            last = exc
            time.sleep(0.05)
    raise AssertionError(f"{ip}:{port} did not answer within {timeout}s: {last}")


def test_image_build_is_deterministic_and_matches_containerd(
    containerd_daemon: Containerd, busybox_rootfs_dir: Path, busybox_image: str, tmp_path: Path
) -> None:
    first = build_image(busybox_rootfs_dir, BUSYBOX_REF, tmp_path / "a.tar")
    second = build_image(busybox_rootfs_dir, BUSYBOX_REF, tmp_path / "b.tar")
    assert first.read_bytes() == second.read_bytes()
    assert containerd_daemon.image_digest(busybox_image) == image_digest(first)


def test_container_like_kubelet_makes_it(
    containerd_daemon: Containerd,
    busybox_image: str,
    make_netns: Callable[[str], Netns],
    tmp_path: Path,
) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "input.txt").write_text("from-host\n")
    netns = make_netns("e2e")
    script = (
        "echo hello-stdout; echo hello-stderr >&2; "
        "echo layer > /tmp/written-by-container; "
        "cat /workspace/input.txt > /workspace/output.txt; "
        f"exec nc -ll -p {PORT} -e /bin/echo pong"
    )
    container = containerd_daemon.run(
        "testbed-e2e",
        busybox_image,
        ["/bin/sh", "-c", script],
        env={"HERMIT_TEST": "1"},
        mounts=[Mount(workspace, "/workspace")],
        netns_path=netns.path,
        log_path=tmp_path / "logs" / "container.log",
        cwd="/tmp",
    )
    try:
        log = container.wait_log("hello-stderr", timeout=15)
        assert "hello-stdout" in log
        assert container.log_path == (tmp_path / "logs" / "container.log").resolve()
        out, err = container.stdio_links()
        assert out.startswith("pipe:[") and err.startswith("pipe:[")

        assert container.alive()
        assert container.ns_inode("pid") != os.stat("/proc/self/ns/pid").st_ino
        assert container.netns_inode() == netns.inode()
        assert container.rootfs() == Path(f"/proc/{container.init_pid}/root")

        upper = container.upperdir()
        assert upper.is_dir() and str(containerd_daemon.base_dir) in str(upper)
        written = upper / "tmp" / "written-by-container"
        wait_until("upperdir file", 10, written.exists, 0.05)
        assert (upper / "tmp" / "written-by-container").read_text() == "layer\n"
        assert (container.rootfs() / "tmp" / "written-by-container").read_text() == "layer\n"

        wait_until("workspace file", 10, lambda: (workspace / "output.txt").exists(), 0.05)
        assert (workspace / "output.txt").read_text() == "from-host\n"

        cgroups = container.cgroup_paths()
        parent = containerd_daemon.cgroup_parent.strip("/")
        assert cgroups["memory"] == Path("/sys/fs/cgroup/memory", parent, container.id)
        assert "freezer" in cgroups
        procs = (cgroups["memory"] / "cgroup.procs").read_text().split()
        assert str(container.init_pid) in procs

        assert _wait_tcp(netns.ip, PORT, timeout=15) == b"pong\n"
        assert containerd_daemon.exec(
            container.id, ["cat", "/tmp/written-by-container"]
        ).stdout == ("layer\n")
    finally:
        containerd_daemon.delete(container.id)
    container.wait_exit(10)
    assert container.id not in containerd_daemon.container_ids()


def test_stop_leaves_nothing_behind(
    containerd_daemon: Containerd, busybox_image: str, busybox_rootfs_dir: Path, tmp_path: Path
) -> None:
    """Also runs the same container id on two daemons at once (two "nodes")."""
    require_containerd()
    base = tmp_path / "node"
    daemon = Containerd(base, namespace="hermit-teardown")
    network = CniNetwork(tmp_path / "cni")
    daemon.start()
    try:
        ref = daemon.import_image(build_image(busybox_rootfs_dir, BUSYBOX_REF, tmp_path / "i.tar"))
        netns = network.add("teardown")
        running = [
            daemon.run(
                f"c{i}",
                ref,
                ["/bin/sh", "-c", "echo up; exec sleep 1000"],
                netns_path=netns.path if i == 0 else None,
            )
            for i in range(2)
        ]
        twin = containerd_daemon.run("c0", busybox_image, ["/bin/sh", "-c", "echo up; sleep 1000"])
        for c in [*running, twin]:
            c.wait_log("up", timeout=15)
        assert twin.cgroup_paths()["memory"] != running[0].cgroup_paths()["memory"]
        assert daemon.shim_pids()
        assert daemon.mounts()
        containerd_pid = daemon.pid
        assert containerd_pid is not None
    finally:
        daemon.stop()
        network.close()
        containerd_daemon.delete("c0")

    mountinfo = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    assert [m.mount_point for m in mountinfo if str(base) in m.mount_point] == []
    assert daemon.shim_pids() == []
    assert not pid_alive(containerd_pid)
    for c in running:
        assert not c.alive()
    assert not twin.alive()
    assert not Path("/sys/class/net", network.bridge).exists()
    assert not netns.path.exists()
    assert not Path("/sys/fs/cgroup/memory", daemon.cgroup_parent.strip("/")).exists()


def test_a_v2_node_runs_its_containers_on_cgroup_v2_like_the_cri_does(
    busybox_rootfs_dir: Path, cni_network: CniNetwork, tmp_path: Path
) -> None:
    """The cgroup v2 flavour: runc makes the container's group in the v2 hierarchy and
    none in v1; the container has a cgroup namespace and cgroup2 read-only on
    /sys/fs/cgroup; its rootfs mount shows on the host and a netns added after the
    daemon started works; stop leaves nothing, its v2 groups included."""
    require_containerd()
    base = tmp_path / "node"
    daemon = Containerd(base, namespace="hermit-v2", cgroup="v2")
    parent = daemon.cgroup_parent.strip("/")
    daemon.start()
    netns = cni_network.add("v2")  # after the daemon's mount namespace was made
    try:
        ref = daemon.import_image(build_image(busybox_rootfs_dir, BUSYBOX_REF, tmp_path / "i.tar"))
        container = daemon.run("c2", ref, ["/bin/sh", "-c", "cat /proc/self/cgroup; "
                                           f"exec nc -ll -p {PORT} -e /bin/echo pong"],
                               netns_path=netns.path)
        assert "0::/\n" in container.wait_log("0::", timeout=15)
        own = Path("/proc", str(container.init_pid), "cgroup").read_text()
        assert f"0::/{parent}/c2\n" in own
        assert (daemon.cgroup_root / parent / "c2" / "cgroup.freeze").is_file()
        assert not Path("/sys/fs/cgroup/freezer", parent).exists(), "runc made v1 groups"
        assert container.ns_inode("cgroup") != os.stat("/proc/self/ns/cgroup").st_ino
        mounts = parse_mountinfo(Path(f"/proc/{container.init_pid}/mountinfo").read_text())
        [cgroup_mount] = [m for m in mounts if m.fstype in ("cgroup", "cgroup2")]
        assert (cgroup_mount.mount_point, cgroup_mount.fstype) == ("/sys/fs/cgroup", "cgroup2")
        assert cgroup_mount.options.split(",")[0] == "ro"
        assert any(p.endswith("/c2/rootfs") for p in daemon.mounts()), daemon.mounts()
        assert _wait_tcp(netns.ip, PORT, timeout=15) == b"pong\n"
        containerd_pid = daemon.pid
    finally:
        daemon.stop()
        cni_network.delete(netns)
    assert daemon.mounts() == [] and daemon.shim_pids() == []
    assert containerd_pid is not None and not pid_alive(containerd_pid)
    assert not container.alive()
    assert not (daemon.cgroup_root / parent).exists()
