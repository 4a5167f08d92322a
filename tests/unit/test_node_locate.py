"""Finding a pod container's init pid from /proc: parsing, and a fake /proc tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermit_common.errors import HermitError
from hermit_node.host import locate

CID = "3f2a9c1be4d5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5"
OTHER = "aa" * 32

CGROUPFS_V1 = f"""\
12:freezer:/kubepods/besteffort/pod1234/{CID}
11:memory:/kubepods/besteffort/pod1234/{CID}
1:name=systemd:/kubepods/besteffort/pod1234/{CID}
0::/
"""
SYSTEMD_V1 = f"""\
12:freezer:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12_34.slice/cri-containerd-{CID}.scope
0::/
"""
SYSTEMD_V2 = f"0::/kubepods.slice/kubepods-pod12.slice/cri-containerd-{CID}.scope\n"
HOST = "12:freezer:/\n0::/init.scope\n"


def test_container_id_from_status() -> None:
    assert locate.parse_container_id(f"containerd://{CID}") == CID
    assert locate.parse_container_id(f"cri-o://{CID}") == CID
    assert locate.parse_container_id(CID) == CID


@pytest.mark.parametrize("bad", ["", "containerd://", "containerd://../../etc", "docker://xyz"])
def test_bad_container_id_is_refused(bad: str) -> None:
    with pytest.raises(HermitError, match="is not <runtime>://<hex id>"):
        locate.parse_container_id(bad)


@pytest.mark.parametrize("text", [CGROUPFS_V1, SYSTEMD_V1, SYSTEMD_V2])
def test_cgroup_paths_of_both_drivers_match(text: str) -> None:
    assert locate.cgroup_mentions(text, CID)
    assert not locate.cgroup_mentions(text, OTHER)


def test_host_cgroup_does_not_match() -> None:
    assert not locate.cgroup_mentions(HOST, CID)


def test_ppid_survives_odd_process_names() -> None:
    assert locate.parse_ppid("4242 (we ird) name)) S 4100 4242 4242 0 -1") == 4100


def test_nspid() -> None:
    assert locate.parse_nspid("Name:\tinit\nNSpid:\t4242\t1\nNSsid:\t1\n") == (4242, 1)
    assert locate.parse_nspid("Name:\tinit\n") == ()


def test_pick_init_prefers_pid_one_over_exec_roots() -> None:
    procs = [
        locate.ProcInfo(pid=500, ppid=400, nspid=(500, 7)),  # kubectl exec: parent is the shim
        locate.ProcInfo(pid=420, ppid=400, nspid=(420, 1)),  # the init
        locate.ProcInfo(pid=430, ppid=420, nspid=(430, 2)),
    ]
    assert locate.pick_init(procs) == 420


def test_pick_init_without_nspid_takes_the_root() -> None:
    procs = [locate.ProcInfo(430, 420, ()), locate.ProcInfo(420, 400, ())]
    assert locate.pick_init(procs) == 420
    assert locate.pick_init([]) is None


def _proc(root: Path, pid: int, ppid: int, cgroup: str, nspid: tuple[int, ...]) -> None:
    d = root / str(pid)
    d.mkdir()
    (d / "cgroup").write_text(cgroup)
    (d / "stat").write_text(f"{pid} (sh) S {ppid} {pid} {pid} 0 -1 4194560\n")
    (d / "status").write_text("Name:\tsh\nNSpid:\t" + "\t".join(map(str, nspid)) + "\n")


def fake_proc(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    _proc(root, 1, 0, HOST, (1,))
    _proc(root, 400, 1, HOST, (400,))  # containerd-shim
    _proc(root, 410, 400, CGROUPFS_V1.replace(CID, OTHER), (410, 1))  # the pause container
    _proc(root, 420, 400, CGROUPFS_V1, (420, 1))  # our init
    _proc(root, 430, 420, CGROUPFS_V1, (430, 2))  # the workload
    _proc(root, 500, 400, CGROUPFS_V1, (500, 9))  # a kubectl exec
    (root / "self").mkdir()  # non-numeric entries are ignored
    (root / "600").mkdir()  # a process that vanished while we looked
    return root


def test_find_init_pid_in_a_fake_proc(tmp_path: Path) -> None:
    root = fake_proc(tmp_path)
    assert locate.find_init_pid(f"containerd://{CID}", root) == 420
    assert locate.find_init_pid(f"containerd://{OTHER}", root) == 410


def test_missing_container_names_it(tmp_path: Path) -> None:
    root = fake_proc(tmp_path)
    with pytest.raises(locate.ContainerNotFound, match="no process of container bbbbbbbbbbbb"):
        locate.find_init_pid("containerd://" + "bb" * 32, root)



# -- the dump root: the init, or the tree a restore made it adopt ------------------------

def _children(root: Path, pid: int, kids: list[int]) -> None:
    task = root / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (task / "children").write_text(" ".join(map(str, kids)) + (" " if kids else ""))


def test_fresh_sandbox_dumps_its_init(tmp_path: Path) -> None:
    root = fake_proc(tmp_path)
    _children(root, 420, [430])
    assert locate.dump_root(420, root) == 420


def test_restored_sandbox_dumps_the_adopted_root(tmp_path: Path) -> None:
    # Generation 2: the new init (host 420, NSpid 420 1) adopted the restored tree whose
    # root is PID 1 of a nested pid namespace (NSpid 431 23 1); its child is 2 there.
    root = fake_proc(tmp_path)
    _proc(root, 431, 420, CGROUPFS_V1, (431, 23, 1))
    _proc(root, 432, 431, CGROUPFS_V1, (432, 24, 2))
    _children(root, 420, [431])
    assert locate.dump_root(420, root) == 431


def test_a_child_in_the_inits_own_namespace_is_not_adopted() -> None:
    init = locate.ProcInfo(420, 400, (420, 1))
    forked = locate.ProcInfo(430, 420, (430, 2))
    exec_like = locate.ProcInfo(500, 400, (500, 9, 1))  # not a child of the init
    assert locate.pick_adopted_root(init, [forked, exec_like]) is None


def test_nesting_deeper_than_one_level_is_not_the_adopted_root() -> None:
    init = locate.ProcInfo(420, 400, (420, 1))
    deeper = locate.ProcInfo(431, 420, (431, 23, 7, 1))
    assert locate.pick_adopted_root(init, [deeper]) is None


def test_two_adopted_trees_are_an_error() -> None:
    init = locate.ProcInfo(420, 400, (420, 1))
    kids = [locate.ProcInfo(431, 420, (431, 23, 1)), locate.ProcInfo(441, 420, (441, 33, 1))]
    with pytest.raises(HermitError, match="adopted 2 restored trees"):
        locate.pick_adopted_root(init, kids)


def test_dump_root_of_a_vanished_init(tmp_path: Path) -> None:
    with pytest.raises(locate.ContainerNotFound):
        locate.dump_root(999, fake_proc(tmp_path))
