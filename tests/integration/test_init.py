"""hermit-init and hermit-stateful as real processes on the host.

The binaries are built by hack/build-init and hack/build-init stateful (cached, so
a second run takes well under a second). Restore mode runs hermit-init as PID 1 of
a real pid namespace (unshare) and makes a process tree appear under it from the
outside (nsenter + a parent that exits), as `criu restore --restore-detached` does.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.support import ledger
from tests.support.wait import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


def _build(script: str, *args: str) -> Path:
    what = " ".join(["hack/" + script, *args])
    result = subprocess.run(
        [str(ROOT / "hack" / script), *args],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"{what} failed (exit {result.returncode}): {result.stderr[-2000:]}")
    path = Path(result.stdout.strip().splitlines()[-1])
    if not os.access(path, os.X_OK):
        pytest.fail(f"{what} printed {path}, which is not an executable")
    return path


@pytest.fixture(scope="module")
def init_bin() -> Path:
    return _build("build-init")


@pytest.fixture(scope="module")
def stateful_bin() -> Path:
    return _build("build-init", "stateful")


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, or None when it no longer exists."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def spawn(argv: Sequence[str | Path], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(a) for a in argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 15.0) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args!r} did not exit within {timeout}s; stderr: {err}")
    return proc.returncode, out, err


Cleanup = list[subprocess.Popen[str] | int]


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    """Processes (process groups) and bare pids (pid-namespace inits) to kill after a test."""
    procs: Cleanup = []
    yield procs
    for p in procs:
        if isinstance(p, int):
            with contextlib.suppress(OSError):  # only if the pid is still one of our inits
                if Path(f"/proc/{p}/exe").resolve().name == "hermit-init":
                    os.kill(p, signal.SIGKILL)
        elif p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


# --- fresh start --------------------------------------------------------------------------


def test_binaries_are_static(init_bin: Path, stateful_bin: Path) -> None:
    for binary in (init_bin, stateful_bin):
        headers = subprocess.run(
            ["readelf", "-l", str(binary)], capture_output=True, text=True, check=True
        ).stdout
        assert "INTERP" not in headers, f"{binary} is dynamically linked"


def test_cli(init_bin: Path) -> None:
    version = subprocess.run([init_bin, "--version"], capture_output=True, text=True, check=False)
    assert version.returncode == 0 and version.stdout.startswith("hermit-init ")
    usage = subprocess.run([init_bin, "--help"], capture_output=True, text=True, check=False)
    assert usage.returncode == 0 and "--restore-timeout" in usage.stdout
    for bad in ([], ["--bogus"], ["--grace", "x", "--", "true"], ["--restore-timeout"]):
        r = subprocess.run([init_bin, *bad], capture_output=True, text=True, check=False)
        assert r.returncode == 2, (bad, r.stderr)
        assert r.stderr.startswith("hermit-init: ")


def test_install_copies_itself(init_bin: Path, tmp_path: Path) -> None:
    """The init image carries only hermit-init: its init container runs `hermit-init
    --install /.hermit/hermit-init` (no cp in the image)."""
    dest = tmp_path / "hermit-init"
    r = subprocess.run([init_bin, "--install", str(dest)], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == init_bin.read_bytes()
    assert dest.stat().st_mode & 0o777 == 0o755
    # never over an existing file or through a symlink (a fresh emptyDir has neither)
    again = subprocess.run([init_bin, "--install", str(dest)], capture_output=True, text=True,
                           check=False)
    assert again.returncode == 1 and "File exists" in again.stderr
    (tmp_path / "link").symlink_to(tmp_path / "target")
    link = subprocess.run([init_bin, "--install", str(tmp_path / "link")], capture_output=True,
                          text=True, check=False)
    assert link.returncode == 1 and not (tmp_path / "target").exists()
    for bad in (["--install"], ["--install", str(tmp_path / "a"), "extra"]):
        u = subprocess.run([init_bin, *bad], capture_output=True, text=True, check=False)
        assert u.returncode == 2, (bad, u.stderr)


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["sh", "-c", "exit 7"], 7),
        (["sh", "-c", "kill -KILL $$"], 137),
        (["true"], 0),
        (["/nonexistent/command"], 127),
    ],
)
def test_exit_code_propagates(init_bin: Path, command: list[str], code: int) -> None:
    rc, _, _ = finish(spawn([init_bin, "--", *command]))
    assert rc == code


def test_signals_are_forwarded(init_bin: Path, tmp_path: Path, cleanup: Cleanup) -> None:
    child = script(
        tmp_path / "child.sh",
        "trap 'echo USR1 >> \"$1/signals\"' USR1\n"
        "trap 'echo TERM >> \"$1/signals\"; exit 0' TERM\n"
        'echo ready > "$1/ready"\n'
        "while :; do sleep 0.02; done\n",
    )
    proc = spawn([init_bin, "--", child, tmp_path])
    cleanup.append(proc)
    wait_until("the child to start", 10.0, lambda: (tmp_path / "ready").exists(), 0.02)
    proc.send_signal(signal.SIGUSR1)
    wait_until("USR1 to be forwarded", 10.0,
               lambda: "USR1" in (read_text(tmp_path / "signals") or ""), 0.02)
    proc.send_signal(signal.SIGTERM)
    rc, _, _ = finish(proc)
    assert rc == 0
    assert (tmp_path / "signals").read_text().split() == ["USR1", "TERM"]


def test_orphans_are_reparented_and_reaped(
    init_bin: Path, tmp_path: Path, cleanup: Cleanup
) -> None:
    script(tmp_path / "orphan.sh", 'echo $$ > "$1/orphan.pid"\nexec sleep 3\n')
    main = script(
        tmp_path / "main.sh",
        '( sh "$1/orphan.sh" "$1" & )\nwhile [ ! -e "$1/stop" ]; do sleep 0.02; done\n',
    )
    proc = spawn([init_bin, "--", main, tmp_path])
    cleanup.append(proc)
    orphan = int(wait_until("the orphan to start", 10.0,
                            lambda: read_text(tmp_path / "orphan.pid") or None, 0.02))
    first = wait_until("the orphan's /proc entry", 10.0, lambda: proc_stat(orphan), 0.02)
    # Its parent is the ( ... & ) subshell until that exits, which a loaded machine may
    # take a moment to do; then the orphan must be hermit-init's, no one else's.
    def reparented() -> tuple[str, int] | None:
        stat = proc_stat(orphan)
        moved = stat is not None and (stat[1] != first[1] or first[1] == proc.pid)
        return stat if moved else None

    stat = wait_until("the orphan's first parent to exit", 10.0, reparented, 0.02)
    assert stat[1] == proc.pid, \
        "the orphan was not reparented to hermit-init (subreaper)"
    wait_until("the orphan to exit and be reaped", 10, lambda: proc_stat(orphan) is None, 0.02)
    (tmp_path / "stop").touch()
    rc, _, _ = finish(proc)
    assert rc == 0


def test_leftovers_get_sigterm_then_sigkill(init_bin: Path, tmp_path: Path) -> None:
    script(tmp_path / "stubborn.sh", 'trap "" TERM\necho $$ > "$1/stubborn.pid"\nexec sleep 100\n')
    script(tmp_path / "polite.sh", 'echo $$ > "$1/polite.pid"\nexec sleep 100\n')
    main = script(
        tmp_path / "main.sh",
        '( sh "$1/stubborn.sh" "$1" & )\n( sh "$1/polite.sh" "$1" & )\n'
        'while [ ! -s "$1/stubborn.pid" ] || [ ! -s "$1/polite.pid" ]; do sleep 0.02; done\n'
        "exit 3\n",
    )
    start = time.monotonic()
    rc, _, err = finish(spawn([init_bin, "--grace", "1", "--", main, tmp_path]))
    elapsed = time.monotonic() - start
    assert rc == 3
    assert 0.9 < elapsed < 5, f"exit took {elapsed:.2f}s with --grace 1"
    assert "sending SIGKILL" in err
    for name in ("stubborn.pid", "polite.pid"):
        pid = int((tmp_path / name).read_text())
        assert proc_stat(pid) is None, f"{name} process {pid} survived hermit-init"


def test_leftovers_that_obey_sigterm_end_quickly(init_bin: Path, tmp_path: Path) -> None:
    script(tmp_path / "polite.sh", 'echo $$ > "$1/polite.pid"\nexec sleep 100\n')
    main = script(
        tmp_path / "main.sh",
        '( sh "$1/polite.sh" "$1" & )\nwhile [ ! -s "$1/polite.pid" ]; do sleep 0.02; done\n',
    )
    start = time.monotonic()
    rc, _, err = finish(spawn([init_bin, "--grace", "30", "--", main, tmp_path]))
    assert rc == 0
    assert time.monotonic() - start < 5
    assert "SIGKILL" not in err


# --- restore mode -------------------------------------------------------------------------


def _require(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} is missing: apt-get install util-linux")


def start_restore_ns(
    init_bin: Path, extra: list[str], cleanup: Cleanup
) -> tuple[subprocess.Popen[str], int]:
    """hermit-init --restore as PID 1 of a new pid namespace; returns (unshare, init host pid)."""
    _require("unshare")
    _require("nsenter")
    proc = spawn(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            init_bin,
            "--restore",
            *extra,
        ]
    )
    cleanup.append(proc)

    def init_pid() -> int | None:
        for pid in children(proc.pid):
            try:
                if Path(f"/proc/{pid}/exe").resolve() == init_bin.resolve():
                    return pid
            except OSError:
                pass
        return None

    pid = wait_until("hermit-init to start in its pid namespace", 10.0, init_pid, 0.02)
    cleanup.append(pid)
    # A namespace's PID 1 drops SIGTERM while it neither handles nor blocks it, so a signal
    # sent between exec and hermit-init's sigprocmask would be lost: wait for its signal loop.
    wait_until("hermit-init to wait for signals", 10.0, lambda: waits_for_signals(pid), 0.02)
    return proc, pid


def waits_for_signals(pid: int) -> bool:
    """The process sleeps in sigtimedwait (while it does, /proc shows its mask as empty)."""
    return "sigtimedwait" in (read_text(Path(f"/proc/{pid}/wchan")) or "")


def detach_into(init_pid: int, argv: list[str | Path]) -> None:
    """Starts argv in init's pid namespace with a parent that exits at once."""
    cmd = ["nsenter", "-t", str(init_pid), "--pid", "--mount", "--", "sh", "-c", '("$@" &)', "sh"]
    subprocess.run([*cmd, *map(str, argv)], check=True, timeout=10)


def test_restore_adopts_a_reparented_tree(init_bin: Path, tmp_path: Path, cleanup: Cleanup) -> None:
    adopted = script(
        tmp_path / "adopted.sh",
        "trap 'echo TERM >> \"$1/signals\"; exit 0' TERM\n"
        'echo ready > "$1/ready"\nwhile :; do sleep 0.02; done\n',
    )
    proc, init_pid = start_restore_ns(init_bin, ["--restore-timeout", "30"], cleanup)
    detach_into(init_pid, ["sh", adopted, tmp_path])
    wait_until("the adopted process to start", 10.0, lambda: (tmp_path / "ready").exists(), 0.02)
    wait_until("the process to be reparented to hermit-init", 10.0,
               lambda: children(init_pid) or None, 0.02)
    os.kill(init_pid, signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 0, err
    assert "adopted restored process" in err
    assert (tmp_path / "signals").read_text().split() == ["TERM"]


def test_restore_propagates_exit_code_of_a_nested_init(
    init_bin: Path, tmp_path: Path, cleanup: Cleanup
) -> None:
    # The shape of a real restore: the adopted root is (a copy of) hermit-init running as
    # PID 1 of a nested pid namespace, with the user's command under it.
    user = script(tmp_path / "user.sh", 'while [ ! -e "$1/stop" ]; do sleep 0.02; done\nexit 5\n')
    proc, init_pid = start_restore_ns(init_bin, [], cleanup)
    detach_into(init_pid, ["unshare", "--pid", "--fork", init_bin, "--", "sh", user, tmp_path])
    wait_until("the nested tree to be reparented to hermit-init", 10.0,
               lambda: children(init_pid) or None, 0.02)
    (tmp_path / "stop").touch()
    rc, _, err = finish(proc)
    assert rc == 5, err


def test_restore_timeout_exits_75(init_bin: Path) -> None:
    start = time.monotonic()
    rc, _, err = finish(spawn([init_bin, "--restore", "--restore-timeout", "1"]))
    assert rc == 75
    assert 0.9 < time.monotonic() - start < 5
    assert err.startswith("hermit-init: no restored process appeared within 1 s")


def test_restore_fallback_starts_the_command(init_bin: Path) -> None:
    argv: list[str | Path] = [
        init_bin,
        "--restore",
        "--restore-timeout",
        "1",
        "--",
        "sh",
        "-c",
        "exit 4",
    ]
    rc, _, _ = finish(spawn(argv, env={**os.environ, "HERMIT_RESTORE_FALLBACK": "start"}))
    assert rc == 4
    rc, _, _ = finish(spawn(argv))
    assert rc == 75, "without HERMIT_RESTORE_FALLBACK=start the command must not run"


def test_sigterm_while_waiting_for_restore(init_bin: Path, cleanup: Cleanup) -> None:
    proc, init_pid = start_restore_ns(init_bin, [], cleanup)
    os.kill(init_pid, signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 128 + signal.SIGTERM, err


# --- the stateful workload ----------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    (tmp_path / "workspace").mkdir(exist_ok=True)
    (tmp_path / "delete-me").write_text("from the image\n")
    return {
        **os.environ,
        "HERMIT_STATE_DIR": str(tmp_path / "state"),
        "HERMIT_TICK_LOG": str(tmp_path / "workspace" / "ticks.log"),
        "HERMIT_DELETE_PATH": str(tmp_path / "delete-me"),
        "HERMIT_LISTEN_ADDR": "127.0.0.1",
        "PORT": str(free_port()),
        "HERMIT_TICK_MS": "20",
        "HERMIT_CHILD_MS": "30",
        **extra,
    }


def counter(tmp_path: Path) -> int:
    text = read_text(tmp_path / "state" / "counter.txt")
    return int(text) if text and text.strip().isdigit() else 0


def try_ask(port: int) -> tuple[int, int] | None:
    try:
        return ask(port)
    except OSError:
        return None


def ask(port: int) -> tuple[int, int]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        data = b""
        while chunk := s.recv(256):
            data += chunk
    m = re.fullmatch(rb"counter=(\d+) child=(\d+)\n", data)
    assert m, data
    return int(m.group(1)), int(m.group(2))


def ticks(text: str) -> list[int]:
    return [int(line.split()[1]) for line in text.splitlines() if line.startswith("tick ")]


def test_stateful_workload(
    init_bin: Path, stateful_bin: Path, tmp_path: Path, cleanup: Cleanup
) -> None:
    env = workload_env(tmp_path)
    proc = spawn([init_bin, "--", stateful_bin], env=env)
    cleanup.append(proc)
    wait_until("the counter to reach 10", 10.0, lambda: counter(tmp_path) >= 10, 0.02)
    workload = children(proc.pid)[0]

    (tmp_path / "state" / "counter.txt").write_text("100000\n")
    wait_until("the next tick", 10.0, lambda: 0 < counter(tmp_path) < 100000, 0.02)
    value, child = ask(int(env["PORT"]))
    assert 10 <= value < 100000, "the counter must live in memory, not on disk"
    assert (tmp_path / "state" / "child.pid").read_text().strip() == str(child)
    stat = proc_stat(child)
    assert stat is not None and stat[1] == workload, "the TCP answer must name the live child"
    beats = (tmp_path / "state" / "child.txt").read_text()
    wait_until("a child heartbeat", 10.0,
               lambda: read_text(tmp_path / "state" / "child.txt") != beats, 0.02)
    assert not (tmp_path / "delete-me").exists()
    assert (tmp_path / "state" / "created.txt").exists()

    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 0, err
    logged = ticks((tmp_path / "workspace" / "ticks.log").read_text())
    assert logged == list(range(1, len(logged) + 1))
    assert ticks(out) == logged
    assert proc_stat(child) is None, "the background child outlived the workload"


def test_stateful_max_ticks(stateful_bin: Path, tmp_path: Path) -> None:
    rc, out, err = finish(spawn([stateful_bin], env=workload_env(tmp_path, HERMIT_MAX_TICKS="5")))
    assert rc == 0, err
    assert ticks(out) == [1, 2, 3, 4, 5]


def test_stateful_fails_when_its_child_is_lost(stateful_bin: Path, tmp_path: Path) -> None:
    proc = spawn([stateful_bin], env=workload_env(tmp_path, HERMIT_TICK_MS="10"))
    child = int(wait_until("child.pid", 10.0,
                           lambda: read_text(tmp_path / "state" / "child.pid") or None, 0.02))
    os.kill(child, signal.SIGKILL)
    rc, _, err = finish(proc)
    assert rc == 4, "losing the background child must fail the workload"
    assert "background child" in err


def test_stateful_memory_is_verified(stateful_bin: Path, tmp_path: Path) -> None:
    env = workload_env(tmp_path, HERMIT_WORKLOAD_MEM_MB="8")
    proc = spawn([stateful_bin], env=env)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    m = re.fullmatch(r"mem addr=0x([0-9a-f]+) mb=8\n", first)
    assert m, first
    wait_until("ticks with memory verification", 10.0, lambda: counter(tmp_path) >= 3, 0.02)
    rss_kib = int(re.findall(r"VmRSS:\s+(\d+)", Path(f"/proc/{proc.pid}/status").read_text())[0])
    assert rss_kib >= 8 * 1024
    with open(f"/proc/{proc.pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(int(m.group(1), 16) + 5 * 4096 + 8)
        mem.write(b"\xde\xad\xbe\xef")
    rc, _, err = finish(proc)
    assert rc == 3
    assert "memory corrupted" in err


# --- the whole shape of a migration, with real CRIU ----------------------------------------


def criu_binary() -> Path:
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache" / "hermit"))
    candidates = (os.environ.get("HERMIT_CRIU_PATH"), cache / "bin" / "criu", shutil.which("criu"))
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    pytest.fail("criu is not installed: run hack/install-criu")


def run_criu(argv: Sequence[str | Path | int], log: Path) -> None:
    result = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        tail = log.read_text()[-3000:] if log.exists() else result.stderr
        pytest.fail(f"{Path(str(argv[0])).name} {argv[1]} failed: {tail}")


@pytest.fixture
def tick_ledger() -> Iterator[ledger.Collector]:
    with ledger.collecting("127.0.0.1") as collector:
        yield collector


def test_workload_migrates_with_criu_under_hermit_init(
    init_bin: Path, stateful_bin: Path, tmp_path: Path, cleanup: Cleanup,
    tick_ledger: ledger.Collector,
) -> None:
    """Dump hermit-init + workload (PID 1 of a pid namespace), restore the tree under a
    new `hermit-init --restore` in another pid namespace, as the node-agent does."""
    criu = criu_binary()
    _require("unshare")
    _require("nsenter")
    images = tmp_path / "images"
    images.mkdir()
    # Every tick also goes to an external tick ledger: CRIU must carry its UDP socket.
    env = workload_env(tmp_path, HERMIT_WORKLOAD_MEM_MB="16", HERMIT_LEDGER=tick_ledger.address)
    port = int(env["PORT"])
    # The dumped tree writes to files (a pipe to pytest would not survive a restore).
    redirect = 'exec "$@" </dev/null >"$0/tree.out" 2>"$0/tree.err"'
    source = spawn(
        [
            "unshare",
            "--pid",
            "--fork",
            "sh",
            "-c",
            redirect,
            tmp_path,
            init_bin,
            "--",
            stateful_bin,
        ],
        env=env,
    )
    cleanup.append(source)
    source_init = wait_until("the source hermit-init", 10.0,
                             lambda: children(source.pid) or None, 0.02)[0]
    cleanup.append(source_init)
    wait_until("the workload to tick", 10.0, lambda: counter(tmp_path) >= 10, 0.02)
    _, child_before = ask(port)

    run_criu([criu, "dump", "-t", source_init, "-D", images, "-o", "dump.log"], images / "dump.log")
    finish(source)
    dumped = ticks((tmp_path / "workspace" / "ticks.log").read_text())[-1]

    target, target_init = start_restore_ns(init_bin, ["--restore-timeout", "60"], cleanup)
    restore: list[str | Path] = ["restore", "-D", images, "-o", "restore.log", "--restore-detached"]
    nsenter = ["nsenter", "-t", str(target_init), "--pid", "--mount", "--"]
    run_criu([*nsenter, criu, *restore], images / "restore.log")

    value, child_after = wait_until("the restored workload to answer", 10.0,
                                    lambda: try_ask(port), 0.02)
    assert value >= dumped and child_after == child_before
    wait_until("the restored workload to keep ticking", 10.0,
               lambda: counter(tmp_path) >= dumped + 10, 0.02)
    os.kill(target_init, signal.SIGTERM)
    rc, _, err = finish(target)
    assert rc == 0, err
    assert "adopted restored process" in err
    logged = ticks((tmp_path / "workspace" / "ticks.log").read_text())
    assert logged == list(range(1, len(logged) + 1)), "ticks were lost or repeated"
    assert ticks((tmp_path / "tree.out").read_text()) == logged
    assert "memory corrupted" not in (tmp_path / "tree.err").read_text()
    v = tick_ledger.verdict(socket.gethostname())
    assert v.clean() and v.first == 1 and v.last >= logged[-1], v.summary()
    assert [c.gen for c in v.copies] == [0, 1], v.summary()
    # the dump may catch a tick between its report and its log line: the old copy reported
    # it, the restored one logs it and reports the next (each tick once: the verdict is clean)
    assert v.copies[1].first_tick in (dumped + 1, dumped + 2), v.summary()
