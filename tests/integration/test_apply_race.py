"""The restore-side symlink race, performed for real against fsapply.apply_tree.

A process of the new container (here: a separate process watching the target with
inotify) changes the target while the checkpoint's files are applied:

- ``dir``: the moment the first file appears in directory ``d``, it renames ``d`` away
  and puts a symlink ``d -> /elsewhere`` in its place: a writer that resolves paths
  writes the rest of the tree's files into the container's ``/elsewhere`` (its /etc, its
  ``.ssh``), not where the checkpoint put them;
- ``file``: the moment a setuid-root file of the tree is created, it renames it away and
  puts a symlink to its own program ``/evil`` in its place: a writer that sets owner and
  mode by path (chown follows symlinks) makes ``/evil`` setuid root.

fsapply writes only through directory fds opened with O_NOFOLLOW and sets metadata on
the fd of the file it created, so both end with nothing in ``/elsewhere`` and ``/evil``
unchanged, 20 runs each. Positive control: the same attacker against a writer that
resolves paths (what fsapply did before: parents checked once, then chown/chmod by path,
inside the same chroot, on the same CPU at a lower priority) wins within 40 tries (at
once, in practice).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hermit_common.errors import RestoreFailed
from hermit_common.tree import KIND_DIR, KIND_FILE, Entry
from hermit_node.engine.fsapply import apply_tree
from tests.support import attacks
from tests.support.root import require_root

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _as_root() -> None:
    require_root("the apply chroots, as the node-agent does")


RUNS = 20
FILES = 100  # files of the tree in ``d``: chances the attacker gets per run
CONTENT = b"binary" * (40 << 10)  # 240 KiB: the attacker acts while it is written
CONTROL_TRIES = 40
TENANT = 1000
# The attacker runs on CPU 0; every writer (fsapply and the control's path writer) runs on
# the same CPU at the lowest priority, so that the attacker, woken by the writer's create,
# runs before the writer's next step even on a loaded machine (a tenant can arrange the
# same). The control then shows the window at once instead of by luck, and fsapply faces
# the same attacker.
ATTACK_CPU = 0
PINNED = ["taskset", "-c", str(ATTACK_CPU)]

ATTACKER = r'''
import ctypes, json, os, struct, sys
args = json.loads(sys.argv[1])
d, mode = args["dir"], args["mode"]
IN_CREATE = 0x100
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
if fd < 0 or libc.inotify_add_watch(fd, d.encode(), IN_CREATE) < 0:
    raise OSError(ctypes.get_errno(), "inotify")
print("ready", flush=True)
while True:
    buf = os.read(fd, 65536)
    offset = 0
    while offset < len(buf):
        wd, mask, cookie, length = struct.unpack_from("iIII", buf, offset)
        name = buf[offset + 16:offset + 16 + length].rstrip(b"\0").decode()
        offset += 16 + length
        try:
            if mode == "dir":
                os.rename(d, d + ".moved")
                os.symlink("/elsewhere", d)
                sys.exit(0)
            if not name.endswith(".moved"):
                os.rename(os.path.join(d, name), os.path.join(d, name + ".moved"))
                os.symlink("/evil", os.path.join(d, name))
        except OSError:
            pass
'''

# What fsapply did before: chroot, each parent checked once to be a real directory, then
# every write and every chown/chmod by path.
PATH_WRITER = r'''
import json, os, stat, sys
req = json.load(sys.stdin)
staging = os.open(req["staging"], os.O_RDONLY | os.O_DIRECTORY)
os.chroot(req["target"])
os.chdir("/")
for e in req["entries"]:
    path = "/" + e["path"]
    if e["kind"] == "dir":
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.mkdir(path)
        continue
    src = os.open(e["path"], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=staging)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    dst = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.sendfile(dst, src, None, e["size"])
    os.close(dst)
    os.close(src)
    os.chown(path, e["uid"], e["gid"])
    os.chmod(path, e["mode"])
'''

Attack = Callable[[Path, str], Callable[[], None]]


@pytest.fixture
def attacker() -> Iterator[Attack]:
    procs: list[subprocess.Popen[str]] = []

    def start(d: Path, mode: str) -> Callable[[], None]:
        proc = subprocess.Popen([*PINNED, sys.executable, "-c", ATTACKER,
                                 json.dumps({"dir": str(d), "mode": mode})],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.communicate()

        def halt() -> None:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)

        return halt

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _scene(base: Path, mode: str) -> tuple[list[Entry], Path, Path]:
    """(entries, staging, target): the container has ``d``, ``/elsewhere`` and its own
    program ``/evil``; the tree fills ``d`` (files ``s000``... holding ``binary``)."""
    staging, target = base / "staging", base / "target"
    (staging / "d").mkdir(parents=True)
    (target / "d").mkdir(parents=True)
    (target / "elsewhere").mkdir()
    evil = target / "evil"
    evil.write_bytes(b"#!/bin/sh\nexec /bin/sh\n")
    os.chown(evil, TENANT, TENANT)
    evil.chmod(0o755)
    entries = [Entry("d", KIND_DIR, 0o755)]
    for i in range(FILES):
        # The tenant's empty placeholders: a path writer that follows ``d`` finds the
        # file it just wrote under the same name there, and goes on.
        (target / "elsewhere" / f"s{i:03d}").write_bytes(b"")
        name = f"d/s{i:03d}"
        (staging / name).write_bytes(CONTENT)
        mode_bits = 0o4755 if mode == "file" else 0o644
        entries.append(Entry(name, KIND_FILE, mode_bits, 0, 0, 0, size=len(CONTENT)))
    return entries, staging, target


def _damage(target: Path) -> list[str]:
    """What the attacker obtained: the tree's bytes in /elsewhere, /evil privileged."""
    found = [f"/elsewhere/{p.name}" for p in (target / "elsewhere").iterdir()
             if p.is_symlink() or p.read_bytes() != b""]
    st = os.lstat(target / "evil")
    if (st.st_uid, stat.S_IMODE(st.st_mode)) != (TENANT, 0o755):
        found.append(f"/evil uid={st.st_uid} mode={stat.S_IMODE(st.st_mode):o}")
    return found


def _path_writer(entries: list[Entry], staging: Path, target: Path) -> bool:
    request = {"staging": str(staging), "target": str(target),
               "entries": [e.to_dict() for e in entries]}
    return subprocess.run([*PINNED, "nice", "-n", "19", sys.executable, "-c", PATH_WRITER],
                          input=json.dumps(request),
                          capture_output=True, text=True, timeout=120,
                          check=False).returncode == 0


@contextmanager
def _outranked_by_the_attacker() -> Iterator[None]:
    """This thread on the attacker's CPU at the lowest priority, as the control's writer."""
    affinity = os.sched_getaffinity(0)
    priority = os.getpriority(os.PRIO_PROCESS, 0)
    os.sched_setaffinity(0, {ATTACK_CPU})
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, priority)  # root: may raise it back
        os.sched_setaffinity(0, affinity)


def _fsapply(entries: list[Entry], staging: Path, target: Path) -> bool:
    try:
        with _outranked_by_the_attacker():
            apply_tree(entries, staging, target)
    except RestoreFailed:
        return False
    return True


def _run(base: Path, mode: str, attack: Attack,
         writer: Callable[[list[Entry], Path, Path], bool]) -> tuple[bool, list[str]]:
    base.mkdir()
    entries, staging, target = _scene(base, mode)
    halt = attack(target / "d", mode)
    try:
        ok = writer(entries, staging, target)
    finally:
        halt()
    return ok, _damage(target)


@pytest.mark.attack
@pytest.mark.parametrize("mode", ["dir", "file"])
def test_fsapply_is_not_redirected_by_the_new_container(
        tmp_path: Path, attacker: Attack, mode: str, attack: attacks.Attack) -> None:
    outcomes = {"applied": 0, "refused": 0}
    for i in range(RUNS):
        ok, damage = _run(tmp_path / f"run{i}", mode, attacker, _fsapply)
        assert damage == [], f"run {i}: the attacker redirected the apply: {damage}"
        outcomes["applied" if ok else "refused"] += 1
        if ok and mode == "dir":  # every file went into the directory the apply opened
            assert len(list((tmp_path / f"run{i}" / "target" / "d.moved").iterdir())) \
                == FILES
    print(f"\nATTACK apply-race attacker={mode} tries={RUNS} redirected=0 {outcomes}")
    what = ("a directory being filled" if mode == "dir"
            else "a setuid file being written")
    attack.record(f"restore symlink race ({mode})",
                  tried=f"{RUNS} restores' file applies while a process of the new container "
                        f"swaps {what} for a symlink (inotify)", outcome=attacks.CONTAINED,
                  evidence=f"no write redirected: {outcomes}; the same attacker redirects a "
                           "path-based writer (test_control_the_same_attack_redirects_a_"
                           "path_writer)")


@pytest.mark.parametrize("mode", ["dir", "file"])
def test_control_the_same_attack_redirects_a_path_writer(
        tmp_path: Path, attacker: Attack, mode: str) -> None:
    wins = 0
    for i in range(CONTROL_TRIES):
        _, damage = _run(tmp_path / f"run{i}", mode, attacker, _path_writer)
        if damage:
            wins += 1
            break
    print(f"\nCONTROL apply-race attacker={mode} writer=by-path tries={i + 1} won={wins} "
          f"{damage}"[:300])
    assert wins >= 1, "the attacker never redirected a path writer: the test sees nothing"
