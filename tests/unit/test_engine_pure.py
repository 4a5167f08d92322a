"""Pure parts of the node-agent engine: /proc parsing, bindings, compatibility checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermit_common.errors import CheckpointRefused
from hermit_common.manifest import Binding, Manifest, Totals
from hermit_node.engine.checkpoint import external_mounts, restore_info
from hermit_node.engine.restore import check_compatible
from hermit_node.host import container, sysinfo

MOUNTINFO = (
    "1500 1400 0:91 / / rw,relatime - overlay overlay rw,lowerdir=/l/1/fs,"
    "upperdir=/var/lib/containerd/snapshots/7/fs,workdir=/var/lib/containerd/snapshots/7/work\n"
) + """\
1501 1500 0:92 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1502 1500 253:1 /tmp/ws /workspace rw,relatime - ext4 /dev/vda rw
"""


def test_upperdir_from_mountinfo() -> None:
    assert container.parse_root_upperdir(MOUNTINFO) == Path(
        "/var/lib/containerd/snapshots/7/fs")
    assert container.parse_root_upperdir("1 0 0:1 / / rw - ext4 /dev/vda rw\n") is None


def test_bind_mounts_from_oci_config() -> None:
    config = {"mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/workspace", "type": "bind", "source": "/data/ws",
         "options": ["rbind", "rw"]},
        {"destination": "/etc/hosts", "source": "/pods/x/etc-hosts", "options": ["bind"]},
    ]}
    assert container.parse_bind_mounts(config) == (
        container.BindMount("/workspace", "/data/ws"),
        container.BindMount("/etc/hosts", "/pods/x/etc-hosts"),
    )


def test_cgroups_parse_v1_and_v2() -> None:
    groups = container.parse_cgroups("12:freezer:/k/pod1/c1\n1:name=systemd:/k/pod1/c1\n0::/k\n")
    assert groups[0] == container.Cgroup("freezer", "/k/pod1/c1")
    assert groups[0].host_path("/sys/fs/cgroup") == Path("/sys/fs/cgroup/freezer/k/pod1/c1")
    assert groups[2].hierarchy == ""


# /proc/<pid>/cgroup of a container that runc put in the v2 hierarchy on a kernel whose
# controllers are bound to v1: the v1 lines name the groups its runtime was in.
V2_NODE_PROC_CGROUP = """\
6:freezer:/
4:memory:/process_api/8c3d
1:cpu:/
0::/hermit-1a76/sbx
"""


def test_a_v2_node_keeps_only_the_unified_line() -> None:
    groups = container.parse_cgroups(V2_NODE_PROC_CGROUP)
    assert container.node_cgroups(groups, unified=True) == (
        container.Cgroup("", "/hermit-1a76/sbx"),)
    assert container.node_cgroups(groups, unified=False) == groups


def test_the_freezer_group_of_a_v2_node_is_its_unified_group(tmp_path: Path) -> None:
    root = tmp_path / "cgroup2"
    root.mkdir()
    (root / "cgroup.controllers").write_text("hugetlb\n")
    assert container.is_unified(root)
    assert not container.is_unified(tmp_path)
    groups = container.node_cgroups(container.parse_cgroups(V2_NODE_PROC_CGROUP), True)
    # Not /sys/fs/cgroup/freezer (the runtime's v1 freezer group, the host's root here).
    assert container.freezer_cgroup(groups, root) == root / "hermit-1a76/sbx"
    view = container.ContainerView(
        init_pid=10, bundle=Path("/b"), rootfs=Path("/b/rootfs"), upperdir=None,
        netns_inode=1, stdio=("", "", ""), bind_mounts=(), cgroups=groups,
        cgroup_root=root)
    assert view.freezer_cgroup() == view.unified_cgroup() == root / "hermit-1a76/sbx"
    assert view.cgroup_dirs() == [root / "hermit-1a76/sbx"]


def test_the_unified_group_of_a_hybrid_node_is_under_unified(tmp_path: Path) -> None:
    (tmp_path / "unified").mkdir()
    assert container.Cgroup("", "/k/c1").host_path(str(tmp_path)) == tmp_path / "unified/k/c1"
    assert container.Cgroup("", "/k/c1").host_path(str(tmp_path / "unified")) == \
        tmp_path / "unified/k/c1"


def test_cpu_flags_keep_user_visible_features_only() -> None:
    cpuinfo = "processor: 0\nflags : fpu sse sse2 avx2 hypervisor constant_tsc aes bmi2\n"
    assert sysinfo.cpu_flags(cpuinfo) == ("aes", "avx2", "bmi2", "sse", "sse2")
    assert sysinfo.missing_cpu_flags(("avx512f", "sse2"), ("sse2",)) == ("avx512f",)


def _view(stdio: tuple[str, str, str]) -> container.ContainerView:
    return container.ContainerView(
        init_pid=10, bundle=Path("/b"), rootfs=Path("/b/rootfs"), upperdir=Path("/u"),
        netns_inode=4026532000, stdio=stdio,
        bind_mounts=(container.BindMount("/workspace", "/data/ws"),
                     container.BindMount("/etc/hosts", "/h")))


def test_restore_info_records_pipes_mounts_and_workspace() -> None:
    view = _view(("/dev/null", "pipe:[11]", "pipe:[11]"))
    keys = external_mounts(view)
    assert keys == {"m0": "/workspace", "m1": "/etc/hosts"}
    info = restore_info(view, "/workspace", keys)
    assert info["stdio"] == {"pipe:[11]": 1}
    assert info["workspace"] == "/workspace"
    assert restore_info(view, "/nope", keys)["workspace"] is None


def _manifest(**binding: object) -> Manifest:
    b = {"namespace": "ns", "sandbox": "s", "sandbox_uid": "u", "checkpoint": "c",
         "criu_version": "4.2.1", "kernel": "6.18", "cpu_flags": ("avx2", "sse2"),
         "image_digest": "sha256:aa"}
    b.update(binding)
    return Manifest(binding=Binding(**b),  # type: ignore[arg-type]
                    created_at="2026-01-01T00:00:00Z", chunk_size=1 << 20, sections={},
                    restore={}, totals=Totals())


def test_compatible_checkpoint_passes() -> None:
    check_compatible(_manifest(), criu_version="4.2.1", cpu_flags=("avx2", "sse2", "aes"),
                     image_digest="sha256:aa")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cpu_flags": ("sse2",)}, "needs CPU features this node lacks: avx2"),
    ({"criu_version": "4.1"}, "older 4.1"),
    ({"image_digest": "sha256:bb"}, "was taken from image sha256:aa"),
])
def test_incompatible_checkpoint_is_refused(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"criu_version": "4.2.1", "cpu_flags": ("avx2", "sse2"),
                               "image_digest": "sha256:aa"}
    args.update(kwargs)
    with pytest.raises(CheckpointRefused, match=message):
        check_compatible(_manifest(), **args)  # type: ignore[arg-type]


def test_entries_at_or_under_a_mount_point_are_left_alone() -> None:
    from hermit_common.tree import Entry
    from hermit_node.engine.fsapply import outside_mounts

    def e(path: str) -> Entry:
        return Entry.from_dict({"path": path, "kind": "dir", "mode": 0o755, "uid": 0,
                                "gid": 0, "mtime_ns": 0})

    entries = [e("etc"), e("etc/resolv.conf"), e("etc/resolv.conf.d"), e("workspace"),
               e("workspace/x"), e("home")]
    kept = outside_mounts(entries, ["/etc/resolv.conf", "/workspace/", "/"])
    assert [x.path for x in kept] == ["etc", "etc/resolv.conf.d", "home"]


def test_the_dump_waits_until_the_runtime_has_read_the_stdout_pipe() -> None:
    """A line still queued in the stdout pipe at the dump would be in both pods' logs."""
    import os
    import subprocess
    import threading
    import time
    from pathlib import Path

    from hermit_node.engine.checkpoint import _queued, wait_stdio_drained
    from hermit_node.host.container import ContainerView

    read_end, write_end = os.pipe()
    child = subprocess.Popen(["sh", "-c", "echo tick 1; exec sleep 5"], stdout=write_end)
    os.close(write_end)
    try:
        link = os.readlink(f"/proc/{child.pid}/fd/1")
        view = ContainerView(init_pid=child.pid, bundle=Path("/"), rootfs=Path("/"),
                             upperdir=None, netns_inode=0, stdio=("", link, link),
                             bind_mounts=())
        deadline = time.monotonic() + 5
        probe = os.open(f"/proc/{child.pid}/fd/1", os.O_RDONLY | os.O_NONBLOCK)
        while not _queued(probe) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _queued(probe) == len(b"tick 1\n")
        reader = threading.Timer(0.2, os.read, (read_end, 100))  # the runtime, a bit late
        reader.start()
        started = time.monotonic()
        wait_stdio_drained(view, timeout=3)
        assert 0.15 < time.monotonic() - started < 2.5
        assert _queued(probe) == 0
        os.close(probe)
        reader.join()
    finally:
        child.kill()
        child.wait()
        os.close(read_end)
