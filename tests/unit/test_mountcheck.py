"""mountcheck: a checkpoint's mounts are no wider than the new container's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hermit_common.errors import CheckpointRefused, RestoreFailed
from hermit_node.host import mountcheck
from hermit_node.host.mountcheck import Mount

MOUNTINFO = r"""1530 1529 0:72 / / rw,relatime - overlay overlay rw,lowerdir=/x
1531 1530 0:76 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1532 1530 0:77 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
1533 1532 0:78 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5
1534 1532 0:79 / /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k
1535 1530 0:80 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro
1536 1530 8:1 /var/lib/kubelet/pods/x/volumes/ws /workspace rw,relatime - ext4 /dev/vda1 rw
1537 1530 8:1 /pods/x/token /run/secrets/token ro,relatime - ext4 /dev/vda1 rw
1538 1531 0:76 /sys /proc/sys ro,nosuid,nodev,noexec,relatime - proc proc rw
1539 1531 0:77 /null /proc/kcore rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
1540 1530 8:1 /data/my\040dir /my\040dir rw,relatime - ext4 /dev/vda1 rw
"""


def pod() -> list[Mount]:
    return mountcheck.parse_mountinfo(MOUNTINFO)


def image(*replacing: Mount) -> list[Mount]:
    """What CRIU dumps of a container with ``pod()``'s mounts (volumes are externals),
    with ``replacing`` in place of the mounts at their paths."""
    mounts = {
        "/": Mount("/", "overlay", 0, root_mount=True),
        "/proc": Mount("/proc", "proc", 14),
        "/dev": Mount("/dev", "tmpfs", 2),
        "/dev/pts": Mount("/dev/pts", "devpts", 10),
        "/dev/shm": Mount("/dev/shm", "tmpfs", 14),
        "/sys": Mount("/sys", "sysfs", 15),
        "/workspace": Mount("/workspace", "ext4", 0, external=True),
        "/run/secrets/token": Mount(
            "/run/secrets/token", "ext4", 1, external=True),
        "/proc/sys": Mount("/proc/sys", "proc", 15),
        "/proc/kcore": Mount("/proc/kcore", "tmpfs", 2),
    }
    for mount in replacing:
        mounts[mount.mountpoint] = mount
    return list(mounts.values())


def found(namespaces: list[list[Mount]], can_mount: bool = False) -> list[str]:
    return mountcheck.violations(namespaces, pod(), can_mount)


def test_parse_mountinfo() -> None:
    mounts = {m.mountpoint: m for m in pod()}
    assert mounts["/sys"] == Mount("/sys", "sysfs", 15)
    assert mounts["/proc/sys"].flags == 15 and mounts["/dev"].flags == 2
    assert mounts["/run/secrets/token"].flags == 1
    assert "/my dir" in mounts


def test_the_containers_own_mounts_restore() -> None:
    assert found([image()]) == []


def test_a_dropped_read_only_flag_is_refused() -> None:
    assert found([image(Mount("/proc/sys", "proc", 14))]) == [
        "mount /proc/sys asks flags nosuid,nodev,noexec; the new pod mounts it "
        "ro,nosuid,nodev,noexec"]
    token = "/run/secrets/token"
    assert found([image(Mount(token, "ext4", 0, external=True))]) == [
        f"mount {token} asks flags none; the new pod mounts it ro"]


def test_a_dropped_mask_is_refused() -> None:
    forged = [m for m in image() if m.mountpoint != "/proc/kcore"]
    assert found([forged]) == [
        "mount /proc/kcore is missing; the new pod has a tmpfs mount there (nosuid)"]


@pytest.mark.parametrize("fstype", ["ext4", "devtmpfs", "binfmt_misc", "debugfs", "overlay",
                                    "securityfs", "tracefs", "fuse", "unsupported"])
def test_a_filesystem_a_process_could_not_mount_is_refused(fstype: str) -> None:
    assert found([[*image(), Mount("/mnt", fstype, 0)]]) == [
        f"mount /mnt asks a {fstype} mount; the new pod has none there"]


def test_proc_sysfs_and_cgroup_only_where_the_pod_has_them() -> None:
    assert found([[*image(), Mount("/mnt/proc", "proc", 0)]]) == [
        "mount /mnt/proc asks a proc mount; the new pod has none there"]
    assert found([[*image(), Mount("/sys/fs/cgroup", "cgroup", 0)]]) == [
        "mount /sys/fs/cgroup asks a cgroup mount; the new pod has none there"]
    assert found([[*image(), Mount("/tmp/x", "tmpfs", 0), Mount("/q", "mqueue", 0)]]) == []


def test_an_extra_mount_namespace_or_anything_with_cap_sys_admin() -> None:
    assert found([image(), image()])[0].startswith("2 mount namespaces")
    assert found([[*image(), Mount("/mnt", "ext4", 0)]], can_mount=True) == []


def test_image_mounts_from_pycriu_entries() -> None:
    entries = [
        {"mnt_id": 76, "parent_mnt_id": 51, "fstype": 17, "mountpoint": "/", "flags": 0},
        {"mnt_id": 55, "parent_mnt_id": 76, "fstype": 1, "mountpoint": "/proc/sys",
         "flags": 0x20000F},
        {"mnt_id": 60, "parent_mnt_id": 76, "fstype": 16, "fsname": "ext4",
         "mountpoint": "/mnt", "flags": 0},
        {"mnt_id": 61, "parent_mnt_id": 76, "fstype": 0, "mountpoint": "/w", "flags": 0,
         "ext_key": "m0"},
    ]
    assert mountcheck.image_mounts(entries) == [
        Mount("/", "overlay", 0, root_mount=True), Mount("/proc/sys", "proc", 15),
        Mount("/mnt", "ext4", 0), Mount("/w", "unsupported", 0, external=True)]


def test_check_raises_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointRefused, match=r"^checkpoint a/b is refused: its mounts "
                                                r"would be wider than the new pod's: mount "):
        mountcheck.check([[*image(), Mount("/mnt", "ext4", 0)]], pod(), False, "checkpoint a/b")
    mountcheck.check([image()], pod(), False, "checkpoint a/b")
    assert mountcheck.read_image_mounts(tmp_path) == []


def test_an_oversize_mount_image_is_refused_before_parsing(tmp_path: Path) -> None:
    with open(tmp_path / "mountpoints-13.img", "wb") as f:
        f.truncate(mountcheck.MAX_MOUNTS_IMAGE_BYTES + 1)
    with pytest.raises(CheckpointRefused, match=r"mountpoints-13\.img is 4194305 bytes"):
        mountcheck.read_image_mounts(tmp_path)


def test_the_containers_mounts_of_a_gone_init_are_a_retryable_failure() -> None:
    assert "/" in {m.mountpoint for m in mountcheck.read_container_mounts(os.getpid())}
    with pytest.raises(RestoreFailed):
        mountcheck.read_container_mounts(2**22 + 7)


def _entries(*mounts: tuple[str, int]) -> list[dict[str, object]]:
    return [{"mnt_id": i + 1, "parent_mnt_id": 0 if i == 0 else 1, "mountpoint": point,
             "fstype": 5, "flags": flags, "root_dev": 77, "root": "/", "source": "shm",
             "options": ""} for i, (point, flags) in enumerate(mounts)]


def test_a_mount_the_runtime_restricts_more_is_narrowed_to_the_new_pod() -> None:
    """containerd 1.6 mounts /dev/shm without nosuid, nodev and noexec, containerd 2 with
    them: a tree moved from one to the other restores with the new pod's flags."""
    entries = _entries(("/", 0), ("/dev/shm", 0), ("/dev", 2), ("/only/in/image", 0))
    assert mountcheck.narrow_entries(entries, pod()) == ["/dev/shm +nosuid,nodev,noexec"]
    assert [e["flags"] for e in entries] == [0, 14, 2, 0]
    narrowed = image(Mount("/dev/shm", "tmpfs", 14))
    assert found([narrowed]) == []


def test_the_runtimes_masks_are_never_narrowed_a_dump_without_them_is_refused() -> None:
    entries = _entries(("/", 0), ("/proc/sys", 14), ("/sys", 0))
    assert mountcheck.narrow_entries(entries, pod()) == ["/sys +ro,nosuid,nodev,noexec"]
    assert entries[1]["flags"] == 14  # /proc/sys keeps its dropped ro: refused below
    assert found([image(Mount("/proc/sys", "proc", 14))]) == [
        "mount /proc/sys asks flags nosuid,nodev,noexec; the new pod mounts it "
        "ro,nosuid,nodev,noexec"]


def test_narrowing_rewrites_only_the_images_it_changes(tmp_path: Path) -> None:
    import pycriu.images

    for name, flags in (("mountpoints-1.img", 0), ("mountpoints-2.img", 14)):
        (tmp_path / name).write_bytes(pycriu.images.dumps(
            {"magic": "MNTS", "entries": _entries(("/", 0), ("/dev/shm", flags))}))
    untouched = (tmp_path / "mountpoints-2.img").stat().st_ino
    linked = tmp_path / "cached-copy"
    os.link(tmp_path / "mountpoints-1.img", linked)  # as a chunk cache might hold it
    before = linked.read_bytes()
    namespaces, changed = mountcheck.narrow_image_mounts(tmp_path, pod())
    assert changed == ["/dev/shm +nosuid,nodev,noexec"]
    assert [[m.flags for m in ns] for ns in mountcheck.read_image_mounts(tmp_path)] == [
        [m.flags for m in ns] for ns in namespaces] == [[0, 14], [0, 14]]
    assert linked.read_bytes() == before  # a new file, not the shared one rewritten
    assert (tmp_path / "mountpoints-2.img").stat().st_ino == untouched
