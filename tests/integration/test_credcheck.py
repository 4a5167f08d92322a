"""A checkpoint whose processes hold more than the new pod grants is refused before CRIU runs.

Real CRIU, containerd, runc and MinIO, two private containerd "nodes". The attack: a
compromised node A forges the checkpoint of a sandbox it runs (its CRIU dump's core
images rewritten with pycriu: every capability the node has, in every set), uploads it
as any checkpoint, and the sandbox moves to node B. Without the check CRIU, as host
root, gives the restored processes exactly that; with it the restore is refused,
naming pid, field, what the images ask and what the pod grants, before the new
container's files are touched or CRIU reads a byte. The same holds for a genuine
checkpoint restored into a container that grants less (a capability dropped, seccomp
on); a container that grants what the checkpoint's processes hold restores.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hermit_common.errors import CheckpointRefused
from hermit_common.pin import Pin
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore
from hermit_node.engine.checkpoint import CheckpointEngine, CheckpointTarget
from hermit_node.engine.restore import RestoreEngine, RestoreTarget
from hermit_node.host import credcheck, mountcheck
from hermit_node.host.criu import Criu, DumpRequest
from hermit_testbed.cni import CniNetwork
from hermit_testbed.errors import TestbedError
from hermit_testbed.scenario import (
    Node,
    Sandbox,
    build_sandbox_image,
    destroy_sandbox,
    process_tree,
    start_sandbox,
)
from tests.support import forge
from tests.support.containerd import CGROUP_FLAVOURS, require_containerd, two_nodes
from tests.support.minio import MinioServer

pytestmark = pytest.mark.integration

NAMESPACE = "agents"
CAP_NET_RAW = 1 << 13


@pytest.fixture(scope="module", params=CGROUP_FLAVOURS)
def nodes(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    """Node A and B, both cgroup v1 or both cgroup v2 (the test id says which)."""
    require_containerd()
    base = tmp_path_factory.mktemp(f"nodes-{request.param}")
    try:
        image_tar = build_sandbox_image(base)
    except TestbedError as exc:
        pytest.fail(str(exc), pytrace=False)
    with two_nodes(base, image_tar, cgroup=request.param) as pair:
        yield pair


@pytest.fixture
def store(minio_server: MinioServer) -> CheckpointStore:
    settings: StoreSettings = minio_server.settings(f"creds-{uuid.uuid4().hex[:8]}")
    checkpoints = CheckpointStore(settings)
    checkpoints.ensure_bucket()
    return checkpoints


def _host_caps() -> int:
    """Every capability this node's CRIU (run by this process) can give."""
    mine = credcheck.read_granted(os.getpid())
    return mine.cap_prm & mine.cap_bnd


class ForgingCriu(Criu):
    """A compromised node's CRIU: after the real dump, ``forger`` rewrites the images
    (tests/support/forge.py)."""

    def __init__(self, binary: str, forger: Callable[[Path], None]) -> None:
        super().__init__(binary)
        self.forger = forger

    def dump(self, req: DumpRequest) -> None:
        super().dump(req)
        self.forger(req.images_dir)


def _raw_sockets(images: Path) -> None:
    """Every inet socket becomes a raw one (CRIU creates it as root: no CAP_NET_RAW needed
    to use it afterwards)."""
    forge.rewrite_all(images / "files.img", lambda e: e["isk"].update(type=3)
                      if e["type"] == "INETSK" else None)


def _writable_proc_sys(images: Path) -> None:
    """/proc/sys mounted read-write: root in the sandbox writes the node's sysctls."""
    for path in sorted(images.glob("mountpoints-*.img")):
        forge.rewrite_all(path, lambda e: e.update(flags=e["flags"] & ~1)
                          if e["mountpoint"] == "/proc/sys" else None)


def _checkpoint(node: Node, criu: Criu, store: CheckpointStore, source: Sandbox, uid: str,
                name: str) -> None:
    engine = CheckpointEngine(criu, store, node.work_dir, cgroup_root=node.containerd.cgroup_root)
    engine.checkpoint(CheckpointTarget(namespace=NAMESPACE, sandbox="sbx", sandbox_uid=uid,
                                       checkpoint=name, init_pid=source.init_pid,
                                       image_digest=node.image_digest()))


def _restore_target(node: Node, target: Sandbox, uid: str, name: str) -> RestoreTarget:
    return RestoreTarget(pin=Pin(NAMESPACE, "sbx", name, uid=uid), init_pid=target.init_pid,
                         image_digest=node.image_digest())


def _restore(node: Node, criu_bin: Path, store: CheckpointStore, target: Sandbox, uid: str,
             name: str) -> None:
    RestoreEngine(Criu(str(criu_bin)), store, node.work_dir,
                  cgroup_root=node.containerd.cgroup_root).restore(
        _restore_target(node, target, uid, name))


def _staging(node: Node, criu_bin: Path, store: CheckpointStore, target: Sandbox, uid: str,
             name: str) -> Path:
    """Where the restore of checkpoint ``name`` into ``target`` stages its files."""
    return RestoreEngine(Criu(str(criu_bin)), store, node.work_dir,
                         cgroup_root=node.containerd.cgroup_root).local_dir(
        _restore_target(node, target, uid, name))


def _refused(node: Node, criu_bin: Path, store: CheckpointStore, target: Sandbox, uid: str,
             name: str, *expected: str) -> str:
    """The restore is refused with every ``expected`` text in its one-line message, and
    nothing reached the new container: CRIU never ran (no log kept), no restored tree,
    no file of the checkpoint applied."""
    with pytest.raises(CheckpointRefused) as info:
        _restore(node, criu_bin, store, target, uid, name)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint {NAMESPACE}/{name} is refused: its processes "
                              "would hold more than the new pod grants: pid "), message
    for text in expected:
        assert re.search(text, message), (text, message)
    staging = _staging(node, criu_bin, store, target, uid, name)
    assert staging.parent.is_dir() and not staging.exists()
    assert not staging.with_name(f"{staging.name}.restore.log").exists(), "CRIU ran"
    assert Path(f"/proc/{target.init_pid}/task/{target.init_pid}/children").read_text() == ""
    assert not (target.container.rootfs() / "state/created.txt").exists()
    return message


def _status(pid: int) -> dict[str, str]:
    return credcheck.parse_status(Path(f"/proc/{pid}/status").read_text())


def test_a_forged_checkpoint_with_the_nodes_capabilities_is_refused(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path, store: CheckpointStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    caps = _host_caps()
    alive = [start_sandbox(node_a, cni_network, "forger")]
    try:
        source = alive[0]
        source.wait_ticks(3)
        _checkpoint(node_a, ForgingCriu(str(criu_bin), forge.all_caps(caps)), store, source,
                    uid, "forged")
        destroy_sandbox(source, cni_network)
        alive.remove(source)

        target = start_sandbox(node_b, cni_network, "victim", restore=True)
        alive.append(target)
        granted = _status(target.init_pid)
        assert int(granted["CapBnd"], 16) & ~caps == 0 and int(granted["CapBnd"], 16) != caps
        message = _refused(node_b, criu_bin, store, target, uid, "forged",
                           r"cap_bnd asks [A-Z_, ]*CAP_SYS_ADMIN[A-Z_, ]* beyond the "
                           r"container's bounding set; the new pod grants CAP_CHOWN",
                           "cap_prm asks", "cap_eff asks")
        print(f"\nrefused: {message}")

        # The attack is real: without the check CRIU gives the restored processes every
        # capability the forged images ask for, in a container that grants 14.
        monkeypatch.setattr(credcheck, "check", lambda *_: None)
        _restore(node_b, criu_bin, store, target, uid, "forged")
        restored = process_tree(target.init_pid)[1:]
        assert restored
        held = {int(_status(pid)["CapEff"], 16) for pid in restored}
        assert held == {caps}, (held, caps)
    finally:
        for sandbox in alive:
            destroy_sandbox(sandbox, cni_network)


def test_a_genuine_checkpoint_is_refused_by_a_pod_that_grants_less_and_restores_where_it_may(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path, store: CheckpointStore,
) -> None:
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    criu = Criu(str(criu_bin))
    narrow = ("--cap-drop", "CAP_NET_RAW", "--seccomp")
    alive: list[Sandbox] = []
    try:
        # A routine checkpoint of a default sandbox (root, 14 capabilities, no seccomp),
        # and one of a sandbox without CAP_NET_RAW and with the default seccomp profile.
        alive.append(start_sandbox(node_a, cni_network, "wide"))
        alive.append(start_sandbox(node_a, cni_network, "narrow", ctr_args=narrow))
        for sandbox, name in zip(alive, ("wide", "narrow"), strict=True):
            sandbox.wait_ticks(3)
            _checkpoint(node_a, criu, store, sandbox, uid, name)
        assert _status(alive[1].init_pid)["Seccomp"] == "2"

        # Into a pod without CAP_NET_RAW: refused, naming it in the three sets.
        no_raw = start_sandbox(node_b, cni_network, "no-raw", restore=True,
                               ctr_args=("--cap-drop", "CAP_NET_RAW"))
        alive.append(no_raw)
        _refused(node_b, criu_bin, store, no_raw, uid, "wide",
                 "cap_bnd asks CAP_NET_RAW beyond the container's bounding set",
                 "cap_prm asks CAP_NET_RAW", "cap_eff asks CAP_NET_RAW")

        # Into a pod with seccomp on: refused, the images' processes have none.
        confined = start_sandbox(node_b, cni_network, "confined", restore=True,
                                 ctr_args=("--seccomp",))
        alive.append(confined)
        _refused(node_b, criu_bin, store, confined, uid, "wide",
                 "seccomp mode disabled; the new pod grants seccomp mode filter")

        # Positive control: the narrow checkpoint into a pod as narrow restores, and its
        # processes hold what the pod grants, no more.
        same = start_sandbox(node_b, cni_network, "same", restore=True, ctr_args=narrow)
        alive.append(same)
        _restore(node_b, criu_bin, store, same, uid, "narrow")
        restored = process_tree(same.init_pid)[1:]
        assert restored
        last = same.ticks()[-1]
        same.wait_ticks(last + 3)
        for pid in restored:
            status = _status(pid)
            assert int(status["CapBnd"], 16) & CAP_NET_RAW == 0
            assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
    finally:
        for sandbox in alive:
            destroy_sandbox(sandbox, cni_network)


# -- the reader, on a real dump rewritten with pycriu ---------------------------------------

@pytest.fixture(scope="module")
def real_dump(tmp_path_factory: pytest.TempPathFactory, criu_bin: Path) -> tuple[Path, int]:
    """CRIU's images of a host process (root, this process's capabilities)."""
    images = tmp_path_factory.mktemp("dump")
    proc = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
    try:
        Criu(str(criu_bin)).dump(DumpRequest(pid=proc.pid, images_dir=images,
                                             leave_running=False, tcp_established=False))
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return images, proc.pid


def _copy(real_dump: tuple[Path, int], tmp_path: Path) -> tuple[Path, int]:
    images = tmp_path / "images"
    shutil.copytree(real_dump[0], images)
    return images, real_dump[1]


def test_the_reader_on_real_images(real_dump: tuple[Path, int], tmp_path: Path) -> None:
    images, pid = real_dump
    found = credcheck.read_images(images)
    [thread] = found.threads
    mine = credcheck.read_granted(os.getpid())
    assert (thread.pid, thread.uids, thread.cap_bnd) == (pid, (0, 0, 0, 0), mine.cap_bnd)
    assert thread.rlimits_max is not None and len(thread.rlimits_max) == 16
    assert found.user_namespaces == () and found.problems == ()
    assert credcheck.violations(found, mine) == []


def test_forged_images_the_reader_refuses(real_dump: tuple[Path, int], tmp_path: Path) -> None:
    images, pid = _copy(real_dump, tmp_path)
    granted = credcheck.read_granted(os.getpid())
    core = images / f"core-{pid}.img"

    # No creds: CRIU would leave the thread with its own (host root's) credentials.
    forge.rewrite(core, lambda e: e["thread_core"].pop("creds"))
    # No rlimits: CRIU would leave the node-agent's limits.
    forge.rewrite(core, lambda e: e["tc"].pop("rlimits"))
    # Another user namespace than the dumping CRIU's: CRIU would create one.
    forge.rewrite(images / f"ids-{pid}.img",
                  lambda e: e.update(user_ns_id=e["user_ns_id"] + 100))
    # AppArmor policies for CRIU to load.
    shutil.copy(images / "inventory.img", images / "apparmor.img")
    found = credcheck.read_images(images)
    assert found.user_namespaces == (pid,) and found.apparmor_policies
    assert found.threads[0].uids is None
    narrow = dataclasses.replace(granted, cap_prm=0)  # CAP_SYS_RESOURCE not held
    assert [v.field for v in credcheck.violations(found, narrow)] == [
        "user namespace", "apparmor.img", "creds"]
    forge.rewrite(core, lambda e: e["thread_core"].update(creds={
        k: 0 for k in ("uid", "gid", "euid", "egid", "suid", "sgid", "fsuid", "fsgid",
                       "secbits")}))
    assert "rlimits" in [v.field for v in credcheck.violations(credcheck.read_images(images),
                                                                narrow)]

    # A thread pstree lists without its core image.
    forge.rewrite(images / "pstree.img", lambda e: e.update(threads=[pid, pid + 1]))
    assert credcheck.read_images(images).problems == (
        f"thread {pid + 1} of pid {pid} has no core-{pid + 1}.img",)


def test_oversize_or_corrupt_images_are_refused_before_parsing(
    real_dump: tuple[Path, int], tmp_path: Path,
) -> None:
    images, pid = _copy(real_dump, tmp_path)
    core = images / f"core-{pid}.img"
    original = core.read_bytes()
    with core.open("ab") as f:
        f.write(b"\0" * credcheck.MAX_CORE_IMAGE_BYTES)
    with pytest.raises(CheckpointRefused, match=rf"core-{pid}\.img is \d+ bytes, more than the "
                                                rf"{credcheck.MAX_CORE_IMAGE_BYTES}"):
        credcheck.read_images(images)
    core.write_bytes(original[:8] + b"\xff" * 64)
    with pytest.raises(CheckpointRefused, match=rf"core-{pid}\.img cannot be parsed"):
        credcheck.read_images(images)


def test_a_forged_checkpoint_with_a_writable_proc_sys_is_refused(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path, store: CheckpointStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node's sysctls (kernel.core_pattern: code run as root on the node) are behind
    the container's read-only /proc/sys; a forged mount image drops the flag."""
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    alive = [start_sandbox(node_a, cni_network, "forger-mnt")]
    try:
        source = alive[0]
        source.wait_ticks(3)
        _checkpoint(node_a, ForgingCriu(str(criu_bin), _writable_proc_sys), store, source, uid,
                    "forged-mnt")
        destroy_sandbox(source, cni_network)
        alive.remove(source)

        target = start_sandbox(node_b, cni_network, "victim-mnt", restore=True)
        alive.append(target)
        assert _proc_sys_options(target.init_pid)[0] == "ro"
        with pytest.raises(CheckpointRefused) as info:
            _restore(node_b, criu_bin, store, target, uid, "forged-mnt")
        message = str(info.value)
        assert message == ("checkpoint agents/forged-mnt is refused: its mounts would be "
                           "wider than the new pod's: mount /proc/sys asks flags "
                           "nosuid,nodev,noexec; the new pod mounts it ro,nosuid,nodev,noexec")
        staging = _staging(node_b, criu_bin, store, target, uid, "forged-mnt")
        assert staging.parent.is_dir(), "no restore was staged"
        assert not staging.with_name(f"{staging.name}.restore.log").exists(), "CRIU ran"
        assert Path(f"/proc/{target.init_pid}/task/{target.init_pid}/children").read_text() \
            == ""

        # The attack is real: without the check the restored tree's /proc/sys is writable.
        monkeypatch.setattr(mountcheck, "check", lambda *_: None)
        _restore(node_b, criu_bin, store, target, uid, "forged-mnt")
        restored = process_tree(target.init_pid)[1:]
        assert restored and _proc_sys_options(restored[-1])[0] == "rw"
    finally:
        for sandbox in alive:
            destroy_sandbox(sandbox, cni_network)


def _proc_sys_options(pid: int) -> list[str]:
    """The per-mount options of /proc/sys as ``pid`` sees it."""
    for m in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = m.split()
        if fields[4] == "/proc/sys":
            return fields[5].split(",")
    raise AssertionError(f"pid {pid} has no /proc/sys mount")


def test_a_forged_checkpoint_with_a_raw_socket_is_refused_where_cap_net_raw_is_dropped(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path, store: CheckpointStore,
) -> None:
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    no_raw = ("--cap-drop", "CAP_NET_RAW")
    alive = [start_sandbox(node_a, cni_network, "forger-sk", ctr_args=no_raw)]
    try:
        source = alive[0]
        source.wait_ticks(3)
        _checkpoint(node_a, ForgingCriu(str(criu_bin), _raw_sockets), store, source, uid,
                    "forged-sk")
        destroy_sandbox(source, cni_network)
        alive.remove(source)
        target = start_sandbox(node_b, cni_network, "victim-sk", restore=True, ctr_args=no_raw)
        alive.append(target)
        with pytest.raises(CheckpointRefused, match=re.escape(
                "checkpoint agents/forged-sk is refused: its open files would carry more than "
                "the new pod grants: file ") + r"\d+ is a raw socket, which needs CAP_NET_RAW; "
                "the new pod does not grant it"):
            _restore(node_b, criu_bin, store, target, uid, "forged-sk")
        staging = _staging(node_b, criu_bin, store, target, uid, "forged-sk")
        assert staging.parent.is_dir(), "no restore was staged"
        assert not staging.with_name(f"{staging.name}.restore.log").exists(), "CRIU ran"
        assert Path(f"/proc/{target.init_pid}/task/{target.init_pid}/children").read_text() \
            == ""
    finally:
        for sandbox in alive:
            destroy_sandbox(sandbox, cni_network)
