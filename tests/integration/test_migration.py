"""The migration test: a stateful container checkpointed to MinIO and resumed in another one.

Real CRIU, containerd, runc, CNI and MinIO. Node A and node B are two private
containerd daemons; nothing of A (container, netns, workspace, local images)
survives before B restores, so everything B gets comes from S3.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard

from hermit_common.errors import CheckpointFailed, CheckpointRefused
from hermit_common.pin import Pin
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore, make_s3_client
from hermit_node.engine.checkpoint import CheckpointEngine, CheckpointTarget
from hermit_node.engine.restore import RestoreEngine, RestoreTarget
from hermit_node.host import locate
from hermit_node.host.criu import Criu
from hermit_testbed.cni import CniNetwork
from hermit_testbed.errors import TestbedError
from hermit_testbed.scenario import (
    DELETED_FROM_IMAGE,
    Node,
    Sandbox,
    build_sandbox_image,
    destroy_sandbox,
    ns_pid,
    process_tree,
    start_sandbox,
)
from tests.support.containerd import (
    CGROUP_FLAVOURS,
    CTRD2_FLAVOURS,
    require_containerd,
    split_flavour,
    two_nodes,
)
from tests.support.minio import MinioServer
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration

NAMESPACE = "agents"
# Every test runs on Debian's containerd 1.6 with cgroup v1 and v2; the ones marked
# ``on_every_runtime`` also on containerd 2 + a current runc with cgroup v2 (the
# combination managed node images run), as extra ids such as ``[ctrd2-v2-full]``.
NODE_FLAVOURS = (*CGROUP_FLAVOURS, *CTRD2_FLAVOURS)
on_every_runtime = pytest.mark.parametrize("nodes", NODE_FLAVOURS, indirect=True)


@pytest.fixture(scope="module", params=CGROUP_FLAVOURS)
def nodes(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    """Node A and B of one node flavour: "v1"/"v2" (Debian's containerd, cgroup v1 or v2) or
    "ctrd2-v2" (containerd 2, cgroup v2); the test id says which."""
    runtime, cgroup = split_flavour(request.param)
    require_containerd(runtime)
    base = tmp_path_factory.mktemp(f"nodes-{request.param}")
    try:
        image_tar = build_sandbox_image(base)
    except TestbedError as exc:
        pytest.fail(str(exc), pytrace=False)
    with two_nodes(base, image_tar, cgroup=cgroup, runtime=runtime) as pair:
        yield pair


@pytest.fixture
def store_settings(minio_server: MinioServer) -> StoreSettings:
    settings = minio_server.settings(f"migration-{uuid.uuid4().hex[:8]}")
    CheckpointStore(settings).ensure_bucket()
    return settings


def engines(node: Node, criu_bin: Path, settings: StoreSettings, *,
            lazy: bool = False) -> tuple[CheckpointEngine, RestoreEngine]:
    store = CheckpointStore(settings)
    criu = Criu(str(criu_bin))
    root = node.containerd.cgroup_root
    return (CheckpointEngine(criu, store, node.work_dir, cgroup_root=root),
            RestoreEngine(criu, store, node.work_dir, lazy=lazy, cgroup_root=root))


def checkpoint_target(sandbox: Sandbox, uid: str, name: str) -> CheckpointTarget:
    return CheckpointTarget(namespace=NAMESPACE, sandbox="sbx", sandbox_uid=uid,
                            checkpoint=name, init_pid=sandbox.init_pid,
                            image_digest=sandbox.node.image_digest())


def restore_target(sandbox: Sandbox, uid: str, name: str) -> RestoreTarget:
    return RestoreTarget(pin=Pin(NAMESPACE, "sbx", name, uid=uid), init_pid=sandbox.init_pid,
                         image_digest=sandbox.node.image_digest())


@pytest.mark.parametrize("lazy", [False, True], ids=["full", "lazy"])
@on_every_runtime
def test_migration_keeps_memory_children_files_log_socket_and_output(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
    store_settings: StoreSettings, lazy: bool,
) -> None:
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    ckpt_a, restore_b = engines(node_a, criu_bin, store_settings)[0], engines(
        node_b, criu_bin, store_settings, lazy=lazy)[1]

    source = start_sandbox(node_a, cni_network, "sbx")
    source.wait_ticks(15)
    before = source.ask()
    result = ckpt_a.checkpoint(checkpoint_target(source, uid, "ckpt-1"), stop=True)
    assert result.manifest_digest.startswith("sha256:")
    assert result.image_bytes > 0 and result.stored_bytes > 0
    source.container.wait_exit(30)
    ticks_at_checkpoint = source.ticks()
    last = ticks_at_checkpoint[-1]
    assert ticks_at_checkpoint == list(range(1, last + 1))
    # The old copy's last word on its stdout: a copy that ran on after its stopping
    # checkpoint printed ticks the restored copy makes again (a duplicate).
    printed_on_a = _stdout_ticks(source.container.read_log())
    child_before = int(before["child"])

    # Node A's copy is gone entirely: container, netns, workspace, local images.
    destroy_sandbox(source, cni_network)
    assert not ckpt_a.local_dir(checkpoint_target(source, uid, "ckpt-1")).exists()

    target = start_sandbox(node_b, cni_network, "sbx", restore=True)
    try:
        restored = restore_b.restore(restore_target(target, uid, "ckpt-1"))
        assert restored.restored_pid > 0
        assert restored.lazy == lazy
        if lazy:
            _wait_for_every_page(restore_b.local_dir(restore_target(target, uid, "ckpt-1")))

        # The in-memory counter continues where it was: no gap, no duplicate, not from zero.
        ticks = target.wait_ticks(last + 10)
        assert ticks == list(range(1, len(ticks) + 1)), "ticks.log has a gap or a duplicate"
        # Node B's stdout takes up exactly where node A's stopped: its first tick is the
        # one after A's last (none made twice, none skipped), whatever tick the freeze cut.
        printed_on_b = _stdout_ticks(target.container.read_log())
        assert printed_on_a and printed_on_b, (printed_on_a[-3:], printed_on_b[:3])
        assert printed_on_b[0] == printed_on_a[-1] + 1, (
            f"node A printed up to tick {printed_on_a[-1]}, node B began at "
            f"{printed_on_b[0]}")

        # The listening socket answers on B's address, with the same child.
        answer = target.ask()
        assert int(answer["counter"]) > last
        assert int(answer["child"]) == child_before

        # The background child is alive with its pid in the namespace unchanged.
        tree = process_tree(target.init_pid)
        assert child_before in {ns_pid(p) for p in tree[1:]}, "background child not restored"

        # Writable layer: the created file is there and the deleted one still gone.
        workload_root = Path(f"/proc/{tree[-1]}/root")
        assert (workload_root / "state/created.txt").read_text().startswith("created by pid")
        assert not (workload_root / DELETED_FROM_IMAGE.lstrip("/")).exists()
        assert int((workload_root / "state/counter.txt").read_text()) > last

        # stdout of B carries the workload's output after the restore.
        target.container.wait_log(f"tick {last + 5}\n", 30)

        # Every restored process lives in B's cgroups, and sees them as B's init does:
        # through its cgroup namespace (a v2 node's containers have one of their own) and
        # its cgroup mounts (v2: cgroup2 on /sys/fs/cgroup, rooted at B's group).
        expected = Path(f"/proc/{target.init_pid}/cgroup").read_text()
        cgroup_ns = os.readlink(f"/proc/{target.init_pid}/ns/cgroup")
        init_view = _cgroup_view(target.init_pid)
        for pid in tree[1:]:
            assert Path(f"/proc/{pid}/cgroup").read_text() == expected, f"pid {pid} cgroup"
            assert os.readlink(f"/proc/{pid}/ns/cgroup") == cgroup_ns, f"pid {pid} cgroupns"
            assert _cgroup_view(pid) == init_view, f"pid {pid} sees other cgroups"
        if node_b.containerd.cgroup == "v2":
            assert cgroup_ns != os.readlink("/proc/self/ns/cgroup")
            assert init_view == ("0::/", [("/sys/fs/cgroup", "/", "ro,nosuid,nodev,noexec,relatime",
                                           "cgroup2")]), init_view
    finally:
        destroy_sandbox(target, cni_network)


def _stdout_ticks(log: str) -> list[int]:
    """The ticks a workload printed on its stdout ("tick N" lines), in order."""
    return [int(line.split()[1]) for line in log.splitlines()
            if line.startswith("tick ") and line.split()[1].isdigit()]


def _cgroup_view(pid: int) -> tuple[str, list[tuple[str, ...]]]:
    """What ``pid`` itself reads: the v2 line of its /proc/self/cgroup, and the mount
    point, root, options and type of every cgroup mount it has (both read from inside its
    cgroup namespace: they show paths relative to the reader's)."""
    def read(path: str) -> str:
        return subprocess.run(["nsenter", "-t", str(pid), "-C", "cat", path],
                              capture_output=True, text=True, check=True, timeout=10).stdout

    line = next(ln for ln in read(f"/proc/{pid}/cgroup").splitlines() if ln.startswith("0::"))
    mounts = [(f[4], f[3], f[5], f[f.index("-") + 1])
              for f in (ln.split() for ln in read(f"/proc/{pid}/mountinfo").splitlines())
              if f[f.index("-") + 1] in ("cgroup", "cgroup2")]
    return line, mounts


@on_every_runtime
def test_the_init_is_found_from_the_container_id(
    nodes: tuple[Node, Node], cni_network: CniNetwork,
) -> None:
    """As the node-agent finds a pod's container from the kubelet's containerID: by the id
    in its processes' cgroup paths (on v2 only the 0:: line names it)."""
    node_a, _ = nodes
    cid = uuid.uuid4().hex
    sandbox = start_sandbox(node_a, cni_network, cid)
    try:
        sandbox.wait_ticks(1)
        lines = [ln for ln in Path(f"/proc/{sandbox.init_pid}/cgroup").read_text().splitlines()
                 if cid in ln]
        if node_a.containerd.cgroup == "v2":
            assert [ln.split(":", 2)[0] for ln in lines] == ["0"], lines
        assert locate.find_init_pid(f"containerd://{cid}") == sandbox.init_pid
        assert locate.dump_root(sandbox.init_pid) == sandbox.init_pid
        _assert_runtime(node_a)
    finally:
        destroy_sandbox(sandbox, cni_network)


def _assert_runtime(node: Node) -> None:
    """The node runs the shim and containerd of its flavour: containerd 2.x and runc 1.3 or
    newer for ctrd2 (not Debian's 1.6, which is on PATH too)."""
    daemon = node.containerd
    bin_dir = daemon.bin_dir
    shims = daemon.shim_pids()
    assert shims, "no shim serves the node"
    if bin_dir is None:
        return
    for pid in shims:
        exe = Path(os.readlink(f"/proc/{pid}/exe"))
        assert exe == (bin_dir / "containerd-shim-runc-v2").resolve(), exe
    containerd, runc = daemon.version()
    assert re.fullmatch(r"v2\.\d+\.\d+", containerd), containerd
    major, minor = (int(n) for n in runc.split(".")[:2])
    assert (major, minor) >= (1, 3), runc


def _wait_for_every_page(staged: Path, timeout: float = 120.0) -> None:
    """A lazy restore's staging dir (``staged``) goes once its daemon has copied every page
    in (a failed daemon leaves its log beside it)."""
    assert staged.parent.is_dir(), f"no restore staged under {staged.parent}"
    wait_until("the lazy-pages daemon to finish", timeout, lambda: not staged.exists(), 0.01)
    kept = staged.with_name(f"{staged.name}.lazy-pages.log")
    assert not kept.exists(), kept.read_text()[-2000:]


def _nspid(host_pid: int) -> tuple[int, ...]:
    for line in Path(f"/proc/{host_pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return tuple(int(p) for p in line.split()[1:])
    raise AssertionError(f"no NSpid for {host_pid}")


# Enough patterned memory that its CRIU pages image spans several store chunks (4 MiB).
MULTI_CHUNK_MEM_MB = "24"


@on_every_runtime
def test_a_sandbox_moves_three_times_and_keeps_everything_each_generation(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
    store_settings: StoreSettings,
) -> None:
    """Generation 2 and 3 fail where generation 1 passes: a restored sandbox must
    checkpoint again (its tree is adopted, in a nested pid namespace) and the nesting
    must not grow with every move."""
    alive = [start_sandbox(nodes[0], cni_network, "gen0",
                           env={"HERMIT_WORKLOAD_MEM_MB": MULTI_CHUNK_MEM_MB})]
    try:
        _move_three_times(nodes, cni_network, criu_bin, store_settings, alive)
    finally:
        for sandbox in alive:
            destroy_sandbox(sandbox, cni_network)


def _move_three_times(nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
                      store_settings: StoreSettings, alive: list[Sandbox]) -> None:
    """A -> B -> A -> B; ``alive`` holds what the caller must clean up."""
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    source = alive[0]
    source.wait_ticks(10)
    child = int(source.ask()["child"])
    current = source
    for generation, node in enumerate((node_b, node_a, node_b), start=1):
        checkpoint, _ = engines(current.node, criu_bin, store_settings)
        name = f"ckpt-gen{generation}"
        result = checkpoint.checkpoint(checkpoint_target(current, uid, name), stop=True)
        assert result.image_bytes > int(MULTI_CHUNK_MEM_MB) << 20, result
        current.container.wait_exit(30)
        last = current.ticks()[-1]
        destroy_sandbox(current, cni_network)
        alive.remove(current)

        _, restore = engines(node, criu_bin, store_settings)
        current = start_sandbox(node, cni_network, f"gen{generation}", restore=True)
        alive.append(current)
        restore.restore(restore_target(current, uid, name))

        ticks = current.wait_ticks(last + 10)
        assert ticks == list(range(1, len(ticks) + 1)), f"gen {generation}: gap or duplicate"
        answer = current.ask()
        assert int(answer["counter"]) > last, (generation, answer, last)
        assert int(answer["child"]) == child, f"gen {generation}: another child"
        assert current.container.alive(), current.container.read_log()[-500:]
        # One nested pid namespace under the new init, however often the sandbox moved.
        tree = process_tree(current.init_pid)
        depth = len(_nspid(current.init_pid))
        assert tree[1:], f"gen {generation}: nothing adopted"
        assert {len(_nspid(p)) for p in tree[1:]} == {depth + 1}, (generation, tree)
        assert child in {ns_pid(p) for p in tree[1:]}
        # The workload verifies its patterned memory every tick and exits 3 if it is not.
        current.wait_ticks(ticks[-1] + 5)
        assert current.container.alive(), current.container.read_log()[-500:]


LARGE_MEM_MB = "256"


def test_a_large_sandbox_restored_lazily_runs_before_its_memory_is_in(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
    store_settings: StoreSettings,
) -> None:
    """The same checkpoint from MinIO, restored fully and then lazily (its pages images
    streamed from the store while the tree runs). The workload verifies its patterned
    memory every tick and exits 3 if a word is wrong."""
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    source = start_sandbox(node_a, cni_network, "sbx", env={"HERMIT_WORKLOAD_MEM_MB": LARGE_MEM_MB})
    try:
        source.wait_ticks(5)
        checkpoint = engines(node_a, criu_bin, store_settings)[0]
        result = checkpoint.checkpoint(checkpoint_target(source, uid, "big"), stop=True)
        source.container.wait_exit(30)
        last = source.ticks()[-1]
    finally:
        destroy_sandbox(source, cni_network)
    figures = []
    for lazy in (False, True):
        restore = engines(node_b, criu_bin, store_settings, lazy=lazy)[1]
        target = start_sandbox(node_b, cni_network, "sbx", restore=True)
        try:
            began = time.monotonic()
            restored = restore.restore(restore_target(target, uid, "big"))
            running_ms = (time.monotonic() - began) * 1000
            assert restored.lazy == lazy
            if lazy:
                _wait_for_every_page(restore.local_dir(restore_target(target, uid, "big")))
            all_in_ms = (time.monotonic() - began) * 1000
            ticks = target.wait_ticks(last + 5)
            assert ticks == list(range(1, len(ticks) + 1)), "ticks.log has a gap or a duplicate"
            assert target.container.alive(), target.container.read_log()[-500:]
            figures.append(f"{'lazy' if lazy else 'full'}: -> running {running_ms:.0f} ms "
                           f"(download {restored.download_ms} ms, criu {restored.restore_ms} "
                           f"ms), -> all pages present {all_in_ms:.0f} ms")
        finally:
            destroy_sandbox(target, cni_network)
    print(f"\n{LARGE_MEM_MB} MiB sandbox, {result.image_bytes} image bytes, from MinIO: "
          + "; ".join(figures))


def test_failed_checkpoint_leaves_sandbox_running(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
    minio_server: MinioServer,
) -> None:
    node_a, _ = nodes
    unreachable = StoreSettings(
        bucket="nowhere", endpoint_url="http://127.0.0.1:9", access_key_id="x",
        secret_access_key="y", max_attempts=1, connect_timeout_seconds=0.5,
        read_timeout_seconds=1.0)
    engine = CheckpointEngine(Criu(str(criu_bin)), CheckpointStore(unreachable), node_a.work_dir,
                              cgroup_root=node_a.containerd.cgroup_root)
    sandbox = start_sandbox(node_a, cni_network, "sbx-fail")
    try:
        sandbox.wait_ticks(5)
        with pytest.raises(CheckpointFailed) as failure:
            engine.checkpoint(checkpoint_target(sandbox, str(uuid.uuid4()), "ckpt-x"), stop=True)
        message = str(failure.value)
        assert "\n" not in message and "127.0.0.1:9" in message and "left running" in message
        after = sandbox.ticks()[-1]
        sandbox.wait_ticks(after + 5)
        assert sandbox.container.alive()
    finally:
        destroy_sandbox(sandbox, cni_network)


def test_foreign_or_tampered_checkpoint_is_refused_before_criu(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
    store_settings: StoreSettings,
) -> None:
    node_a, node_b = nodes
    uid = str(uuid.uuid4())
    ckpt_a = engines(node_a, criu_bin, store_settings)[0]
    restore_b = engines(node_b, criu_bin, store_settings)[1]
    source = start_sandbox(node_a, cni_network, "sbx-src")
    target = start_sandbox(node_b, cni_network, "sbx-dst", restore=True)
    try:
        source.wait_ticks(5)
        result = ckpt_a.checkpoint(checkpoint_target(source, uid, "ckpt-t"))
        assert source.container.alive(), "a routine checkpoint leaves the sandbox running"
        wanted = RestoreTarget(pin=Pin(NAMESPACE, "sbx", "ckpt-t", uid=uid),
                               init_pid=target.init_pid, image_digest=node_b.image_digest())

        # A checkpoint of another sandbox (other uid) is refused.
        foreign = dataclasses.replace(wanted, pin=wanted.pin.with_uid(str(uuid.uuid4())))
        with pytest.raises(CheckpointRefused, match="belongs to sandbox"):
            restore_b.restore(foreign)

        # A manifest digest other than the one recorded is refused.
        wrong_digest = dataclasses.replace(
            wanted, pin=dataclasses.replace(wanted.pin, digest="sha256:" + "0" * 64))
        with pytest.raises(CheckpointRefused):
            restore_b.restore(wrong_digest)

        # A manifest rewritten in S3 (its binding intact) is refused by the manifest
        # policy before a byte is downloaded: nothing lands in the node's staging dir.
        _refused_by_policy(store_settings, restore_b, wanted, restore_b.local_dir(wanted))

        # A tampered chunk is refused, naming the chunk.
        store = CheckpointStore(store_settings)
        manifest_files = store.download(Pin(NAMESPACE, "sbx", "ckpt-t", uid=uid),
                                        node_b.work_dir / "peek")
        digest = next(iter(sorted(manifest_files.chunk_digests())))
        client = make_s3_client(store_settings)
        key = store.chunk_key(NAMESPACE, "sbx", digest)
        evil = zstandard.ZstdCompressor().compress(b"not what was checkpointed")
        client.put_object(Bucket=store_settings.bucket, Key=key, Body=evil)
        with pytest.raises(CheckpointRefused, match=digest[:12]):
            restore_b.restore(wanted)

        # The CLI says the same in one line.
        env = {**os.environ, "HERMIT_S3_BUCKET": store_settings.bucket,
               "HERMIT_S3_ENDPOINT": str(store_settings.endpoint_url),
               "HERMIT_S3_ACCESS_KEY_ID": str(store_settings.access_key_id),
               "HERMIT_S3_SECRET_ACCESS_KEY": str(store_settings.secret_access_key),
               "HERMIT_CRIU_PATH": str(criu_bin), "HERMIT_WORK_DIR": str(node_b.work_dir)}
        for uid_arg, expected in ((uid, digest[:12]), ("someone-else", "belongs to sandbox")):
            proc = subprocess.run(
                [sys.executable, "-m", "hermit_node.cli", "restore", "--pid",
                 str(target.init_pid), "--namespace", NAMESPACE, "--sandbox", "sbx",
                 "--uid", uid_arg, "--name", "ckpt-t"],
                env=env, capture_output=True, text=True, timeout=120, check=False)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 1 and len(lines) == 1, proc.stderr
            assert lines[0].startswith("hermit-node: error: ") and expected in lines[0]

        # Nothing reached the new container: no restored tree, files untouched.
        assert Path(f"/proc/{target.init_pid}/task/{target.init_pid}/children").read_text() == ""
        assert not (target.container.rootfs() / "state/created.txt").exists()
        assert result.manifest_digest.startswith("sha256:")
    finally:
        destroy_sandbox(source, cni_network)
        destroy_sandbox(target, cni_network)


def _wipe_etc(doc: dict[str, Any]) -> None:
    doc["restore"]["workspace"] = "/etc"


def _criu_symlink(doc: dict[str, Any]) -> None:
    doc["sections"]["criu"].append({"path": "pages-9.img", "kind": "symlink", "mode": 0o777,
                                    "uid": 0, "gid": 0, "mtime_ns": 0,
                                    "target": "/etc/shadow"})


def _small_totals(doc: dict[str, Any]) -> None:
    doc["totals"]["image_bytes"] = 1


def _refused_by_policy(settings: StoreSettings, engine: RestoreEngine, target: RestoreTarget,
                       staging: Path) -> None:
    """Rewrites the checkpoint's manifest in S3 three ways; each restore is refused with
    the policy's reason and leaves no staging dir behind. The original is put back."""
    client = make_s3_client(settings)
    key = CheckpointStore(settings).manifest_key(NAMESPACE, target.sandbox, target.checkpoint)
    original = client.get_object(Bucket=settings.bucket, Key=key)["Body"].read()
    engine_client = engine._store.client
    read: list[str] = []  # keys the engine's (real) client GETs
    real_get = engine_client.get_object

    def get_object(**kwargs: Any) -> Any:
        read.append(kwargs["Key"])
        return real_get(**kwargs)

    engine_client.get_object = get_object
    try:
        for change, reason in (
                (_wipe_etc, "restore.workspace names /etc, but the new pod's workspace is "
                            "/workspace"),
                (_criu_symlink, "criu/pages-9.img is a symlink"),
                (_small_totals, "its totals do not match its entries: image_bytes 1")):
            doc = json.loads(original)
            change(doc)
            client.put_object(Bucket=settings.bucket, Key=key, Body=json.dumps(doc).encode())
            with pytest.raises(CheckpointRefused, match=re.escape(reason)):
                engine.restore(target)
            assert [k for k in read if "/chunks/" in k] == [], \
                "downloaded before the policy check"
            # A failed restore removes its staging dir (CRIU never ran: no log is kept).
            assert not staging.exists(), "a refused restore left its staging dir"
            assert not staging.with_name(f"{staging.name}.restore.log").exists()
    finally:
        del engine_client.get_object
        client.put_object(Bucket=settings.bucket, Key=key, Body=original)


def test_cli_prints_one_line_errors_and_the_sandbox_keeps_running(
    nodes: tuple[Node, Node], cni_network: CniNetwork, criu_bin: Path,
) -> None:
    node_a, _ = nodes
    sandbox = start_sandbox(node_a, cni_network, "sbx-cli")
    try:
        sandbox.wait_ticks(3)
        env = {**os.environ, "HERMIT_S3_BUCKET": "b", "HERMIT_S3_ENDPOINT": "http://127.0.0.1:9",
               "HERMIT_S3_ACCESS_KEY_ID": "x", "HERMIT_S3_SECRET_ACCESS_KEY": "y",
               "HERMIT_S3_MAX_ATTEMPTS": "1", "HERMIT_S3_CONNECT_TIMEOUT_SECONDS": "0.5",
               "HERMIT_CRIU_PATH": str(criu_bin), "HERMIT_WORK_DIR": str(node_a.work_dir),
               "HERMIT_CGROUP_ROOT": str(node_a.containerd.cgroup_root)}
        proc = subprocess.run(
            [sys.executable, "-m", "hermit_node.cli", "checkpoint", "--pid",
             str(sandbox.init_pid), "--namespace", NAMESPACE, "--sandbox", "sbx-cli",
             "--uid", "u-1", "--name", "c-1"],
            env=env, capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hermit-node: error: "), proc.stderr
        assert "127.0.0.1:9" in lines[0]
        after = sandbox.ticks()[-1]
        sandbox.wait_ticks(after + 3)

        bad = subprocess.run(
            [sys.executable, "-m", "hermit_node.cli", "restore", "--pid", "1", "--namespace",
             NAMESPACE, "--sandbox", "x", "--uid", "u", "--name", "c"],
            env={**env, "HERMIT_S3_CONCURRENCY": "many"}, capture_output=True, text=True,
            timeout=60, check=False)
        assert bad.returncode == 1
        assert bad.stderr.strip() == (
            "hermit-node: error: HERMIT_S3_CONCURRENCY='many' is not an integer")
    finally:
        destroy_sandbox(sandbox, cni_network)
