"""A sandbox as the restricted pod policy makes it moves like any other: nothing in the
capture or the restore path needs root inside the container.

Under the restricted default (operator/hermit_operator/podpolicy.py) a sandbox whose
template names no user runs as 65532:65532, with no capabilities (bounding set empty),
no_new_privs and the runtime's seccomp profile; its workspace is a world-writable emptyDir.
Here the same, on real containerd, runc, CRIU and MinIO: ``ctr`` has no --user, so a tiny
static helper drops the bounding set and switches to 65532 before it execs hermit-init
(exactly what runc does for runAsUser with capabilities drop ALL), and ``--seccomp`` gives
containerd's default profile (no_new_privs is containerd's default). The node-agent's
engines checkpoint it on node A and restore it into a container started the same way on
node B, and the restored processes still hold exactly that: uid 65532, no capabilities,
no_new_privs, a seccomp filter.

CRIU reads a task's rlimits with prlimit(2), which for a task of another uid needs
CAP_SYS_RESOURCE: a privileged node-agent on a real node has it. A host without it (a
machine that is itself a container, like the one hack/cluster runs on: docs/cluster.md)
cannot checkpoint a non-root sandbox at all; there the test shows that the checkpoint
fails cleanly and the sandbox keeps running, and the e2e release uses the baseline
profile (tests/e2e/cluster.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermit_common.errors import CheckpointFailed
from hermit_common.pin import Pin
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore
from hermit_node.engine.checkpoint import CheckpointEngine, CheckpointTarget
from hermit_node.engine.restore import RestoreEngine, RestoreTarget
from hermit_node.host.criu import Criu
from hermit_testbed.cni import CniNetwork
from hermit_testbed.container import Mount
from hermit_testbed.errors import TestbedError
from hermit_testbed.image import build_image, busybox_rootfs
from hermit_testbed.scenario import (
    Node,
    Sandbox,
    destroy_sandbox,
    process_tree,
    required_binary,
)
from tests.support.containerd import CGROUP_FLAVOURS, require_containerd, two_nodes
from tests.support.minio import MinioServer

pytestmark = pytest.mark.integration

NAMESPACE = "agents"
IMAGE_REF = "hermit.local/restricted-sandbox:test"
BIN = "/usr/local/bin"
AS_USER = f"{BIN}/as-65532"
USER = 65532
HELPER_C = r"""
#define _GNU_SOURCE
#include <grp.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>
/* runc's order for runAsUser with capabilities drop ALL: bounding set, groups, ids, exec */
int main(int argc, char **argv) {
    if (argc < 2) return 2;
    for (int cap = 0; cap <= 63; cap++) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
    if (setgroups(0, NULL) || setresgid(65532, 65532, 65532) || setresuid(65532, 65532, 65532)) {
        perror("as-65532");
        return 126;
    }
    execv(argv[1], argv + 1);
    perror("as-65532: execv");
    return 127;
}
"""
# The workload's writable-layer state in /tmp (1777): the image's / belongs to root.
ENV = {"HERMIT_STATE_DIR": "/tmp/state", "HERMIT_DELETE_PATH": "",
       "HERMIT_WORKLOAD_MEM_MB": "8"}


def _image(work: Path) -> Path:
    rootfs = busybox_rootfs(work / "restricted-rootfs")
    bindir = rootfs / BIN.lstrip("/")
    bindir.mkdir(parents=True, exist_ok=True)
    for binary in (required_binary("hermit-init", "hack/build-init"),
                   required_binary("hermit-stateful", "hack/build-init stateful")):
        shutil.copy2(binary, bindir / binary.name)
    source = work / "as-65532.c"
    source.write_text(HELPER_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(bindir / "as-65532"), str(source)],
                   check=True, capture_output=True, timeout=120)
    (rootfs / "workspace").mkdir(exist_ok=True)
    return build_image(rootfs, IMAGE_REF, work / "restricted-image.tar")


@pytest.fixture(scope="module", params=CGROUP_FLAVOURS)
def nodes(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    """Node A and B, both cgroup v1 or both cgroup v2 (the test id says which)."""
    require_containerd()
    base = tmp_path_factory.mktemp(f"restricted-{request.param}")
    try:
        image_tar = _image(base)
    except (TestbedError, subprocess.CalledProcessError) as exc:
        pytest.fail(str(exc), pytrace=False)
    with two_nodes(base, image_tar, cgroup=request.param) as pair:
        yield pair


def _start(node: Node, network: CniNetwork, name: str, *, restore: bool = False) -> Sandbox:
    """The sandbox container as the restricted policy makes its pod."""
    workspace = node.work_dir / f"{name}-workspace"
    shutil.rmtree(workspace, ignore_errors=True)
    workspace.mkdir(parents=True)
    workspace.chmod(0o777)  # as the kubelet makes an emptyDir
    netns = network.add(f"{node.name}-{name}")
    init = [f"{BIN}/hermit-init", *(["--restore", "--restore-timeout", "300"] if restore
                                    else ["--", f"{BIN}/hermit-stateful"])]
    log_path = node.work_dir / f"{name}.log"
    container = node.containerd.run(
        name, node.image_ref, [AS_USER, *init], env=ENV,
        mounts=[Mount(workspace, "/workspace")], netns_path=netns.path, log_path=log_path,
        extra_args=["--seccomp"])
    return Sandbox(node, container, netns, workspace, log_path)


def _credentials(pid: int) -> dict[str, str]:
    status = Path(f"/proc/{pid}/status").read_text()
    wanted = ("Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs",
              "Seccomp")
    return {k: " ".join(v.split()) for k, _, v in (line.partition(":") for line in
                                                    status.splitlines()) if k in wanted}


CAP_SYS_RESOURCE = 24


def _have_sys_resource() -> bool:
    """Whether CRIU, run by this process, holds CAP_SYS_RESOURCE."""
    caps = int(_credentials(os.getpid())["CapEff"], 16)
    return bool(caps >> CAP_SYS_RESOURCE & 1)


RESTRICTED = {"Uid": f"{USER} {USER} {USER} {USER}", "Gid": f"{USER} {USER} {USER} {USER}",
              "CapInh": "0000000000000000", "CapPrm": "0000000000000000",
              "CapEff": "0000000000000000", "CapBnd": "0000000000000000",
              "CapAmb": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"}


def test_a_restricted_sandbox_is_checkpointed_and_restored_without_root(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
    minio_server: MinioServer,
) -> None:
    settings: StoreSettings = minio_server.settings(f"restricted-{uuid.uuid4().hex[:8]}")
    CheckpointStore(settings).ensure_bucket()
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    source = _start(node_a, cni_network, "sbx")
    try:
        source.wait_ticks(10)
        tree = process_tree(source.init_pid)
        assert len(tree) >= 3, tree  # hermit-init, the workload, its background child
        for pid in tree:
            assert _credentials(pid) == RESTRICTED, (pid, _credentials(pid))
        checkpoint = CheckpointEngine(Criu(str(criu_bin)), CheckpointStore(settings),
                                      node_a.work_dir, cgroup_root=node_a.containerd.cgroup_root)
        target_a = CheckpointTarget(
            namespace=NAMESPACE, sandbox="sbx", sandbox_uid=uid, checkpoint="ckpt-1",
            init_pid=source.init_pid, image_digest=node_a.image_digest())
        if not _have_sys_resource():
            with pytest.raises(CheckpointFailed, match=r"(?s)sandbox left running: .*rlimit"):
                checkpoint.checkpoint(target_a, stop=True)
            before = source.ticks()[-1]
            source.wait_ticks(before + 3)  # thawed, still ticking
            print("\nno CAP_SYS_RESOURCE on this host: CRIU cannot read the rlimits of a "
                  "non-root task; the checkpoint failed and the sandbox kept running")
            return
        checkpoint.checkpoint(target_a, stop=True)
        source.container.wait_exit(30)
        last = source.ticks()[-1]
    finally:
        destroy_sandbox(source, cni_network)

    target = _start(node_b, cni_network, "sbx", restore=True)
    try:
        assert _credentials(target.init_pid) == RESTRICTED  # the waiting init, unprivileged
        restored = RestoreEngine(Criu(str(criu_bin)), CheckpointStore(settings),
                                 node_b.work_dir,
                                 cgroup_root=node_b.containerd.cgroup_root).restore(RestoreTarget(
            pin=Pin(NAMESPACE, "sbx", "ckpt-1",
                    uid=uid), init_pid=target.init_pid, image_digest=node_b.image_digest()))
        assert restored.restored_pid > 0
        ticks = target.wait_ticks(last + 10)
        assert ticks == list(range(1, len(ticks) + 1)), "ticks.log has a gap or a duplicate"
        tree = process_tree(target.init_pid)
        assert len(tree) >= 4, tree  # the waiting init, then the restored tree under it
        for pid in tree:
            assert _credentials(pid) == RESTRICTED, (pid, _credentials(pid))
        workload_root = Path(f"/proc/{tree[-1]}/root")
        created = workload_root / "tmp/state/created.txt"
        assert created.read_text().startswith("created by pid")
        assert created.stat().st_uid == USER
        target.container.wait_log(f"tick {last + 5}\n", 30)
    finally:
        destroy_sandbox(target, cni_network)
