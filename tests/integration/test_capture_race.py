"""The capture symlink race of issue 17, performed for real against the node-agent's copier.

A tenant process (here: a separate process, as a sidecar would be) watches, with
inotify, the directories of the tree being captured; the moment the copier opens one, it
renames that directory away and puts in its place a symlink to a directory of the node:

- the agent's sealing key directory (a stand-in laid out as the kubelet lays out a
  Secret volume: ``1 -> ..data/1``, ``..data -> ..<timestamp>``; the symlink names
  ``..data``, as in the issue), file ``1`` holding a random marker;
- the agent's service-account token directory (projected-volume layout, ``token``,
  ``ca.crt``, ``namespace``, a random token; the symlink names its ``..data``);
- the real host ``/etc`` (victim directories hold a file named ``hostname``: a copier
  that follows the symlink copies the host's ``/etc/hostname``).

Every file of the tenant's tree holds ``src:`` + its own path, so "nothing from outside
ever appears" is checked for every byte of the copy, not just for the markers.

``safecopy.copy_tree`` is attacked at least 20 times per target by that attacker, and 20
times per target by a second one that flips every victim directory between itself and
the symlink as fast as it can (aiming at the window between a listing and an open). Each
run ends copied-and-clean or refused (CheckpointFailed); never with a foreign byte.

Positive control: the SAME inotify attacker against the previous copier (``cp -a
--reflink=auto SRC/. DEST``) must win (cp exits 0, so the old engine would have uploaded
it, and the copy holds the marker) at least once per target in 40 tries: the test can see
the leak. Each try offers cp 40 victim directories, as a sidecar can.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hermit_common.errors import CheckpointFailed
from hermit_common.store import CheckpointStore
from hermit_node.engine import safecopy
from hermit_node.engine.checkpoint import SECTION_WORKSPACE, CheckpointEngine, CheckpointTarget
from hermit_node.host.criu import Criu
from hermit_testbed.cni import CniNetwork
from hermit_testbed.container import Mount
from hermit_testbed.containerd import Containerd
from hermit_testbed.errors import TestbedError
from hermit_testbed.scenario import Node, build_sandbox_image, destroy_sandbox, start_sandbox
from tests.support import attacks
from tests.support.containerd import CGROUP_FLAVOURS, require_containerd
from tests.support.minio import MinioServer
from tests.support.root import require_root
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _as_root() -> None:
    require_root("the node-agent copies as root")


RUNS = 20  # per target and attacker, as the acceptance asks
VICTIMS = 40  # directories of the tenant's tree the attacker may swap, per run
CONTROL_TRIES = 40  # stops at the first win
PINNED = ["taskset", "-c", "0"]  # the attacker, and the old copier of the control

ATTACKER = r'''
import ctypes, json, os, struct, sys
args = json.loads(sys.argv[1])
dirs, target, mode = args["dirs"], args["target"], args["mode"]
if mode == "flip":
    # Every victim directory flips between itself and the symlink, as fast as it can.
    print("ready", flush=True)
    while not os.path.exists(args["stop"]):
        for d in dirs:
            try:
                os.rename(d, d + ".real")
                os.symlink(target, d)
            except OSError:
                pass
        for d in dirs:
            try:
                os.unlink(d)
                os.rename(d + ".real", d)
            except OSError:
                pass
    sys.exit(0)
IN_OPEN = 0x20
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
if fd < 0:
    raise OSError(ctypes.get_errno(), "inotify_init1")
watches = {}
for d in dirs:
    wd = libc.inotify_add_watch(fd, d.encode(), IN_OPEN)
    if wd < 0:
        raise OSError(ctypes.get_errno(), "inotify_add_watch " + d)
    watches[wd] = d
print("ready", flush=True)
pending = set(dirs)
while pending:
    buf = os.read(fd, 65536)
    offset = 0
    while offset < len(buf):
        wd, mask, cookie, length = struct.unpack_from("iIII", buf, offset)
        offset += 16 + length
        d = watches.get(wd)
        if d in pending:  # the copier opened it (or a file in it): swap it now
            pending.discard(d)
            os.rename(d, d + ".moved")
            os.symlink(target, d)
'''


@dataclass(frozen=True)
class Target:
    """A directory of the node the attacker points the symlink at."""

    name: str
    link: Path  # what the symlink names
    names: tuple[str, ...]  # file names a victim directory holds (all exist in link)
    markers: tuple[bytes, ...]  # bytes that must never appear in the copy


def _sealing(base: Path) -> Target:
    key = b"sealing-key-" + secrets.token_hex(16).encode()
    sealing = base / "etc-hermit" / "sealing"
    stamp = sealing / "..2026_12_02_09_00_00.123456789"
    stamp.mkdir(parents=True)
    (stamp / "1").write_bytes(key)
    os.symlink(stamp.name, sealing / "..data")
    os.symlink("..data/1", sealing / "1")
    return Target("sealing key dir", sealing / "..data", ("1",), (key,))


def _token(base: Path) -> Target:
    token = b"eyJhbGciOiJSUzI1NiJ9." + secrets.token_hex(24).encode()
    sa = base / "serviceaccount"
    stamp = sa / "..2026_12_02_09_00_00.987654321"
    stamp.mkdir(parents=True)
    (stamp / "token").write_bytes(token)
    (stamp / "ca.crt").write_bytes(b"-----BEGIN CERTIFICATE-----\n" + token[-16:])
    (stamp / "namespace").write_bytes(b"hermit-system")
    os.symlink(stamp.name, sa / "..data")
    for name in ("token", "ca.crt", "namespace"):
        os.symlink(f"..data/{name}", sa / name)
    return Target("service-account token dir", sa / "..data", ("token", "ca.crt", "namespace"),
                  (token,))


def _host_etc(_: Path) -> Target:
    hostname = Path("/etc/hostname").read_bytes()
    assert hostname, "/etc/hostname is empty: nothing to recognise"
    return Target("host /etc", Path("/etc"), ("hostname",), (hostname,))


TARGETS: dict[str, Callable[[Path], Target]] = {
    "sealing": _sealing, "token": _token, "host-etc": _host_etc,
}


def _tenant_tree(root: Path, target: Target) -> list[str]:
    """The tenant's tree: VICTIMS directories each holding the target's file names, and
    some ordinary content; every file holds ``src:`` and its path. Returns the victims."""
    root.mkdir()
    (root / "notes.txt").write_bytes(b"src:notes.txt")
    victims = []
    for i in range(VICTIMS):
        d = root / f"v{i:02d}"
        d.mkdir()
        for name in target.names:
            (d / name).write_bytes(f"src:v{i:02d}/{name}".encode())
        victims.append(str(d))
    return victims


def _foreign(copy: Path, target: Target) -> list[str]:
    """Regular files of the copy holding anything but the tenant's own bytes."""
    found = []
    for dirpath, _, files in os.walk(copy):  # never follows a symlink of the copy
        for name in files:
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            data = path.read_bytes()
            if not data.startswith(b"src:") or any(m in data for m in target.markers):
                found.append(f"{path.relative_to(copy)}: {data[:40]!r}")
    return found


Attack = Callable[[list[str], Path, str], Callable[[], None]]


@pytest.fixture
def attacker(tmp_path: Path) -> Iterator[Attack]:
    """``attacker(dirs, link, mode)`` starts an attacking process, waits until its watches
    are in place and returns what stops it (after the copy)."""
    procs: list[subprocess.Popen[str]] = []

    def start(dirs: list[str], link: Path, mode: str) -> Callable[[], None]:
        stop = tmp_path / f"stop-{len(procs)}"
        proc = subprocess.Popen(
            [*PINNED, sys.executable, "-c", ATTACKER,
             json.dumps({"dirs": dirs, "target": str(link), "mode": mode, "stop": str(stop)})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"the attacker did not start: {proc.communicate()}"

        def halt() -> None:
            stop.touch()  # the flipper stops at its next round; the watcher is killed
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            proc.communicate()

        return halt

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _old_copy(source: Path, dest: Path) -> bool:
    """The copier before issue 17 (checkpoint._copy_tree): True if it succeeded."""
    dest.mkdir(parents=True, exist_ok=True)
    # On the attacker's CPU and at the lowest priority, so that the attacker, woken by the
    # copier's open of a directory, runs before the copier's next step even on a loaded
    # machine (a real tenant can arrange the same): the control then sees the leak at once
    # instead of by luck.
    return subprocess.run([*PINNED, "nice", "-n", "19",
                           "cp", "-a", "--reflink=auto", f"{source}/.", str(dest)],
                          capture_output=True, check=False).returncode == 0


def _new_copy(source: Path, dest: Path) -> bool:
    try:
        safecopy.copy_tree(source, dest)
    except CheckpointFailed:
        return False
    return True


def _run(base: Path, target: Target, mode: str, copier: Callable[[Path, Path], bool],
         attack: Attack, i: int) -> tuple[bool, list[str], int]:
    """One copy under attack: (the copier succeeded, foreign files, victims swapped)."""
    src, copy = base / f"src{i}", base / f"copy{i}"
    victims = _tenant_tree(src, target)
    halt = attack(victims, target.link, mode)
    try:
        ok = copier(src, copy)
    finally:
        halt()
    swapped = sum(1 for v in victims if Path(v).is_symlink())
    return ok, _foreign(copy, target), swapped


@pytest.mark.attack
@pytest.mark.parametrize("mode", ["inotify", "flip"])
@pytest.mark.parametrize("which", sorted(TARGETS))
def test_safecopy_never_follows_the_swapped_symlink(
        tmp_path: Path, attacker: Attack, which: str,
        mode: str, attack: attacks.Attack) -> None:
    base = tmp_path / "runs"
    base.mkdir()
    target = TARGETS[which](tmp_path)
    outcomes: Counter[str] = Counter()
    swaps = 0
    for i in range(RUNS):
        ok, foreign, swapped = _run(base, target, "self" if mode == "inotify" else "flip",
                                    _new_copy, attacker, i)
        assert foreign == [], f"run {i}: bytes from {target.name} in the copy: {foreign}"
        outcomes["copied, clean" if ok else "refused (CheckpointFailed)"] += 1
        swaps += swapped
    print(f"\nATTACK capture-race target={which} attacker={mode} copier=safecopy "
          f"tries={RUNS} leaked=0 {dict(outcomes)} "
          f"directories-swapped={swaps if mode == 'inotify' else 'all, continuously'}")
    assert sum(outcomes.values()) == RUNS
    if mode == "inotify":  # the attacker did act: every victim the copier opened
        assert swaps >= RUNS * VICTIMS // 2, f"only {swaps} directories were swapped"
    how = ("swaps each directory for a symlink the moment the copier opens it (inotify)"
           if mode == "inotify" else "flips directories and symlinks continuously")
    attack.record(f"capture symlink race ({mode}) → {target.name}",
                  tried=f"{RUNS} captures of a tenant tree while an attacker process {how}, "
                        f"symlinks to {target.name}", outcome=attacks.CONTAINED,
                  evidence=f"no byte of the target in any copy: {dict(outcomes)}; the same "
                           "attacker beats `cp -a` (test_control_the_same_attack_wins_"
                           "against_cp_a)")


@pytest.mark.parametrize("which", sorted(TARGETS))
def test_control_the_same_attack_wins_against_cp_a(
        tmp_path: Path, attacker: Attack, which: str) -> None:
    """The attack is real: against ``cp -a`` it takes the target's files (and cp exits 0,
    so the old engine uploaded them)."""
    base = tmp_path / "runs"
    base.mkdir()
    target = TARGETS[which](tmp_path)
    wins = 0
    for i in range(CONTROL_TRIES):
        ok, foreign, _ = _run(base, target, "self", _old_copy, attacker, i)
        if ok and foreign:
            wins += 1
            break
    print(f"\nCONTROL capture-race target={which} copier='cp -a' tries={i + 1} "
          f"won={wins}")
    assert wins >= 1, (f"the attacker never got {target.name} through cp -a in "
                       f"{CONTROL_TRIES} tries: this test could not see a leak")


def test_a_file_of_the_tree_swapped_for_a_symlink_between_two_runs(tmp_path: Path) -> None:
    """A symlink that was there before the copy (the deterministic half of the race) is
    copied as a symlink by both copiers; only cp then follows it through a directory
    swapped during the copy, which the tests above show."""
    target = _sealing(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    os.symlink(target.link, src / "keys")
    assert _new_copy(src, tmp_path / "copy")
    assert _foreign(tmp_path / "copy", target) == []
    assert os.readlink(tmp_path / "copy" / "keys") == str(target.link)


def test_attacker_starts(tmp_path: Path,
                         attacker: Attack) -> None:
    """The attacker really swaps a directory the moment it is opened."""
    d = tmp_path / "victim"
    d.mkdir()
    halt = attacker([str(d)], tmp_path, "self")
    os.close(os.open(d, os.O_RDONLY | os.O_DIRECTORY))
    wait_until("the attacker's swap", 10, d.is_symlink, 0.01)
    halt()
    assert (tmp_path / "victim.moved").is_dir()


# -- the same route through a real container and a real Hermit checkpoint ----------------

SIDECAR_VICTIMS = 20
# A second container of the pod mounting the sandbox's workspace (the route of the issue;
# the operator's pod policy now refuses it, the agent must not depend on that): it fills
# the workspace with directories holding a file ``1``, then flips each between itself and
# a symlink to the agent's key directory (a host path, as the agent would resolve it) for
# as long as it runs. The sandbox container is frozen during the capture; this one is not.
SIDECAR = r'''
cd /workspace || exit 1
i=0
while [ $i -lt {n} ]; do mkdir -p v$i && echo src:v$i/1 > v$i/1; i=$((i+1)); done
touch sidecar-ready
while true; do
  i=0
  while [ $i -lt {n} ]; do mv v$i v$i.real && ln -s {target} v$i; i=$((i+1)); done
  i=0
  while [ $i -lt {n} ]; do rm v$i && mv v$i.real v$i; i=$((i+1)); done
done
'''


@pytest.fixture(scope="module", params=CGROUP_FLAVOURS)
def node(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """A cgroup v1 or cgroup v2 node (the test id says which)."""
    require_containerd()
    base = tmp_path_factory.mktemp(f"race-node-{request.param}")
    try:
        image_tar = build_sandbox_image(base)
    except TestbedError as exc:
        pytest.fail(str(exc), pytrace=False)
    with Containerd(base / "node", cgroup=request.param) as cd:
        n = Node("node-race", cd, base / "work")
        n.work_dir.mkdir()
        n.image_ref = cd.import_image(image_tar)
        yield n


@pytest.mark.attack
def test_a_sidecar_swapping_workspace_dirs_during_real_checkpoints(
        tmp_path: Path, node: Node, cni_network: CniNetwork, criu_bin: Path,
        minio_server: MinioServer, attack: attacks.Attack) -> None:
    """Real containerd + runc + CRIU + MinIO: a sidecar container flips workspace
    directories to the agent's key directory during 5 routine checkpoints of the sandbox;
    whatever each checkpoint captured (kept locally: what was uploaded) holds no byte of
    the key, and the sandbox keeps running."""
    target = _sealing(tmp_path)
    settings = minio_server.settings(f"race-{uuid.uuid4().hex[:8]}")
    store = CheckpointStore(settings)
    store.ensure_bucket()
    engine = CheckpointEngine(Criu(str(criu_bin)), store, node.work_dir,
                              cgroup_root=node.containerd.cgroup_root)
    sandbox = start_sandbox(node, cni_network, "sbx-race")
    sidecar_id = "sbx-race-sidecar"
    try:
        node.containerd.run(
            sidecar_id, node.image_ref,
            ["/bin/sh", "-c", SIDECAR.format(n=SIDECAR_VICTIMS, target=target.link)],
            mounts=[Mount(sandbox.workspace, "/workspace")])
        wait_until("the sidecar's directories", 30,
                   (sandbox.workspace / "sidecar-ready").exists, 0.01)
        sandbox.wait_ticks(3)
        outcomes: Counter[str] = Counter()
        uid = str(uuid.uuid4())
        for i in range(5):
            ckpt = CheckpointTarget(namespace="agents", sandbox="sbx-race", sandbox_uid=uid,
                                    checkpoint=f"race-{i}", init_pid=sandbox.init_pid,
                                    image_digest=node.image_digest())
            try:
                engine.checkpoint(ckpt, keep_local=True)
            except CheckpointFailed as exc:
                # Refused because the tree changed under the copy, nothing else.
                assert "left running" in str(exc) and "during the copy" in str(exc), exc
                outcomes["refused (CheckpointFailed)"] += 1
                continue
            local = engine.local_dir(ckpt)
            foreign = [f for f in _foreign(local / SECTION_WORKSPACE, target)
                       if f.startswith("v")]
            assert foreign == [], f"checkpoint {i} captured the key: {foreign}"
            for dirpath, _, files in os.walk(local):
                for name in files:
                    path = Path(dirpath) / name
                    if path.is_file() and not path.is_symlink():
                        assert target.markers[0] not in path.read_bytes(), path
            outcomes["taken, clean"] += 1
        after = sandbox.ticks()[-1]
        sandbox.wait_ticks(after + 2)  # the sandbox runs on
        print(f"\nATTACK capture-race route=sidecar-container checkpoints=5 leaked=0 "
              f"{dict(outcomes)}")
        attack.record("capture symlink race from a sidecar container → key dir",
                      tried="5 real checkpoints (containerd, runc, CRIU, MinIO) while a second "
                            "container sharing the workspace flips its directories to symlinks "
                            "to the agent's key directory", outcome=attacks.CONTAINED,
                      evidence=f"no key byte captured, the sandbox ran on: {dict(outcomes)} "
                               "(on the cluster such a sidecar is refused: test_policy)")
    finally:
        with contextlib.suppress(TestbedError):
            node.containerd.delete(sidecar_id)
        destroy_sandbox(sandbox, cni_network)
