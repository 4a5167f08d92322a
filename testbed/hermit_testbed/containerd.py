"""A private containerd daemon (overlayfs + runc v2 shim, no CRI) for real containers.

Everything it writes lives under ``base_dir`` (config, root, state, socket, runc
root, log), except the shim sockets containerd keeps under /run/containerd/s.
``stop`` kills every task and shim it started and unmounts what it mounted.

Two runtime flavours (``RUNTIME_FLAVOURS``): "debian" is the containerd 1.6, its shim,
``ctr`` and runc on PATH (hack/install-containerd); "ctrd2" is containerd 2.x and a
current runc built from the Go module proxy by hack/install-containerd2, found in
``$HERMIT_CACHE/bin/containerd2`` (or ``$HERMIT_CONTAINERD2_BIN``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from hermit_testbed.cni import NETNS_DIR
from hermit_testbed.container import Container, Mount
from hermit_testbed.errors import TestbedError
from hermit_testbed.image import image_ref
from hermit_testbed.proc import pid_alive, run, wait_for, which
from hermit_testbed.procfs import parse_mountinfo, read_text

SHIM_SOCKET_ROOT = Path("/run/containerd/s")
# No CRI: containerd 1.6 has it in one plugin; 2.x splits it in three (an unknown name is
# ignored by either).
DISABLED_PLUGINS = (
    "io.containerd.grpc.v1.cri",
    "io.containerd.cri.v1.images",
    "io.containerd.cri.v1.runtime",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
)


CGROUP_FLAVOURS = ("v1", "v2")
RUNTIME_FLAVOURS = ("debian", "ctrd2")
CONTAINERD2_HINT = "run hack/install-containerd2"


def containerd2_bin_dir() -> Path:
    """Where hack/install-containerd2 links containerd 2.x, its shim, ``ctr`` and runc."""
    explicit = os.environ.get("HERMIT_CONTAINERD2_BIN")
    if explicit:
        return Path(explicit)
    cache = Path(os.environ.get("HERMIT_CACHE", str(Path.home() / ".cache" / "hermit")))
    return cache / "bin" / "containerd2"
CGROUP2_ROOT = Path("/sys/fs/cgroup/unified")
# The v2 flavour: containerd, its shims, runc and the containers live in a mount namespace
# of their own where /sys/fs/cgroup is the cgroup2 hierarchy, so runc takes its v2 path
# (it looks at the filesystem type of /sys/fs/cgroup). The new namespace keeps the
# host's propagation ("unchanged"): the base dir and /run/netns are shared mounts, so
# the rootfs mounts containerd makes there show on the host, and the network namespaces
# the host adds later show in the daemon's namespace; only the cgroup2 mount, on the
# private /sys/fs/cgroup, stays inside.
V2_WRAPPER = 'mount -t cgroup2 none /sys/fs/cgroup && exec "$0" "$@"'
# On cgroup v2 the kubelet's containers (containerd's CRI) get a cgroup namespace of their
# own and cgroup2 mounted read-only on /sys/fs/cgroup; ``ctr run`` gives neither, so the
# v2 flavour runs runc through this wrapper, which adds both to the bundle's config.json
# before ``runc create`` (runc mounts cgroup2 there, rooted at the container's group).
CRI_RUNC = """#!{python} -I
import json, os, sys
args = sys.argv[1:]
if "create" in args and "--bundle" in args:
    path = os.path.join(args[args.index("--bundle") + 1], "config.json")
    with open(path) as f:
        spec = json.load(f)
    namespaces = spec.setdefault("linux", {{}}).setdefault("namespaces", [])
    if not any(ns.get("type") == "cgroup" for ns in namespaces):
        namespaces.append({{"type": "cgroup"}})
    mounts = spec.setdefault("mounts", [])
    if not any(m.get("destination") == "/sys/fs/cgroup" for m in mounts):
        mounts.append({{"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
                       "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}})
    with open(path, "w") as f:
        json.dump(spec, f)
os.execv({runc!r}, [{runc!r}, *args])
"""


def _toml_str(value: str | Path) -> str:
    return json.dumps(str(value))


def render_config(base: Path) -> str:
    """config.toml (version 2) for a daemon rooted at ``base``."""
    disabled = ", ".join(_toml_str(p) for p in DISABLED_PLUGINS)
    return (
        "version = 2\n"
        f"root = {_toml_str(base / 'root')}\n"
        f"state = {_toml_str(base / 'state')}\n"
        f"disabled_plugins = [{disabled}]\n"
        "\n[grpc]\n"
        f"  address = {_toml_str(base / 'containerd.sock')}\n"
        "\n[ttrpc]\n"
        f"  address = {_toml_str(base / 'containerd.sock.ttrpc')}\n"
        "\n[debug]\n"
        '  level = "info"\n'
        "\n[metrics]\n"
        '  address = ""\n'
        "\n[plugins]\n"
        '  [plugins."io.containerd.internal.v1.opt"]\n'
        f"    path = {_toml_str(base / 'opt')}\n"
    )


def make_shared(path: Path) -> None:
    """Make ``path`` a mount point (a bind onto itself if need be) with shared propagation,
    so what is mounted below it in a namespace copied from this one shows in both."""
    path.mkdir(parents=True, exist_ok=True)
    points = {m.mount_point for m in parse_mountinfo(read_text("/proc/self/mountinfo"))}
    if str(path) not in points:
        run(["mount", "--bind", str(path), str(path)])
    run(["mount", "--make-shared", str(path)])


def parse_task_ls(text: str) -> dict[str, tuple[int, str]]:
    """``ctr task ls`` output -> {id: (pid, status)}."""
    tasks: dict[str, tuple[int, str]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3:
            tasks[fields[0]] = (int(fields[1]), fields[2])
    return tasks


def shim_socket(address: Path, namespace: str, container_id: str) -> Path:
    """Where containerd (1.6 and 2.x alike) puts the runc v2 shim's socket for a container."""
    digest = hashlib.sha256(os.path.join(str(address), namespace, container_id).encode())
    return SHIM_SOCKET_ROOT / digest.hexdigest()


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


class Containerd:
    """A private containerd. Use ``with Containerd(base) as cd:`` or start()/stop()."""

    def __init__(
        self,
        base_dir: Path,
        *,
        namespace: str = "hermit",
        cgroup_parent: str | None = None,
        snapshotter: str = "overlayfs",
        start_timeout: float = 30.0,
        cgroup: str = "v1",
        runtime: str = "debian",
    ) -> None:
        if cgroup not in CGROUP_FLAVOURS:
            raise TestbedError(f"cgroup flavour {cgroup!r} is not one of {CGROUP_FLAVOURS}")
        if runtime not in RUNTIME_FLAVOURS:
            raise TestbedError(f"runtime flavour {runtime!r} is not one of {RUNTIME_FLAVOURS}")
        self.base_dir = base_dir.resolve()
        self.cgroup = cgroup
        self.runtime = runtime
        self.namespace = namespace
        tag = hashlib.sha256(str(self.base_dir).encode()).hexdigest()[:8]
        self.cgroup_parent = cgroup_parent or f"/hermit-{tag}"
        self.snapshotter = snapshotter
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_ids: set[str] = set()

    # -- paths ---------------------------------------------------------------------

    @property
    def address(self) -> Path:
        return self.base_dir / "containerd.sock"

    @property
    def config_path(self) -> Path:
        return self.base_dir / "config.toml"

    @property
    def log_file(self) -> Path:
        return self.base_dir / "containerd.log"

    @property
    def runc_root(self) -> Path:
        """The runc ``--root`` the shims use; runc state is under ``<runc_root>/<namespace>``."""
        return self.base_dir / "runc"

    @property
    def cgroup_root(self) -> Path:
        """Where the host (this process) reaches the cgroup filesystem the runtime uses:
        /sys/fs/cgroup for v1, the host's cgroup2 mount for v2 (the same hierarchy the
        daemon's namespace has on /sys/fs/cgroup)."""
        return CGROUP2_ROOT if self.cgroup == "v2" else Path("/sys/fs/cgroup")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def bin_dir(self) -> Path | None:
        """The directory of the flavour's binaries (None: the ones on PATH)."""
        return containerd2_bin_dir() if self.runtime == "ctrd2" else None

    def binary(self, name: str) -> str:
        """Absolute path of the flavour's ``name`` (containerd, ctr, the shim or runc)."""
        bin_dir = self.bin_dir
        if bin_dir is None:
            return which(name)
        path = bin_dir / name
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise TestbedError(
                f"{name} of the {self.runtime} flavour not found at {path}: {CONTAINERD2_HINT}")
        return str(path)

    def version(self) -> tuple[str, str]:
        """(containerd version, runc version) of this flavour, e.g. ("v2.2.9", "1.5.3")."""
        cd = run([self.binary("containerd"), "--version"]).stdout.split()
        rc = run([self.binary("runc"), "--version"]).stdout.split()
        return (cd[2] if len(cd) > 2 else "?", rc[2] if len(rc) > 2 else "?")

    def _daemon_env(self) -> dict[str, str] | None:
        """The daemon's environment: the flavour's directory first on PATH, so containerd
        starts that shim and the shim that runc (None: inherit ours)."""
        bin_dir = self.bin_dir
        if bin_dir is None:
            return None
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "/usr/bin:/bin")])
        return env

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> Containerd:
        """Write the config and start the daemon; returns when it answers ``ctr version``."""
        if self._proc is not None:
            return self
        binary = self.binary("containerd")
        self.binary("containerd-shim-runc-v2")
        self.binary("runc")
        self.binary("ctr")
        if len(str(self.address)) > 100:
            raise TestbedError(f"containerd socket path too long for a unix socket: {self.address}")
        for sub in ("root", "state", "opt", "runc", "logs"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(render_config(self.base_dir), encoding="utf-8")
        argv = [binary, "--config", str(self.config_path)]
        if self.cgroup == "v2":
            argv = self._v2_argv(argv)
        log = self.log_file.open("ab")
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env=self._daemon_env(),
            )
        finally:
            log.close()
        proc = self._proc
        try:
            wait_for(
                lambda: (
                    proc.poll() is not None
                    or (self.address.exists() and self.ctr("version", check=False).returncode == 0)
                ),
                self.start_timeout,
                f"containerd at {self.address}",
                interval=0.1,
            )
        except TestbedError:
            self.stop()
            raise
        if proc.poll() is not None:
            tail = self.log_file.read_text(errors="replace").strip().splitlines()[-1:]
            self._proc = None
            raise TestbedError(f"containerd exited with {proc.returncode}: {''.join(tail)}")
        return self

    def _v2_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run in a new mount namespace with cgroup2 on /sys/fs/cgroup."""
        if not (CGROUP2_ROOT / "cgroup.controllers").is_file():
            raise TestbedError(
                f"the cgroup v2 flavour needs the cgroup2 hierarchy at {CGROUP2_ROOT} on the "
                "host (the hybrid layout), to reach the containers' v2 groups from there")
        for shared in (self.base_dir, NETNS_DIR):
            make_shared(shared)
        return [which("unshare"), "--mount", "--propagation", "unchanged", "--",
                "sh", "-c", V2_WRAPPER, *argv]

    def _cri_runc(self) -> Path:
        """The runc wrapper of the v2 flavour (``CRI_RUNC``), written once."""
        path = self.base_dir / "runc-cri"
        if not path.exists():
            path.write_text(CRI_RUNC.format(python=sys.executable, runc=self.binary("runc")),
                            encoding="utf-8")
            path.chmod(0o755)
        return path

    def stop(self) -> None:
        """Kill and delete every task and container, stop the daemon, leave nothing behind."""
        errors: list[str] = []
        if self._proc is not None and self._proc.poll() is None:
            for cid in self.container_ids():
                try:
                    self.delete(cid)
                except TestbedError as exc:
                    errors.append(str(exc))
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._proc = None
        self._force_cleanup()
        left = self.leftovers()
        if left:
            errors.append("left behind: " + "; ".join(left))
        if errors:
            raise TestbedError(f"stopping containerd at {self.base_dir} failed: {errors[0]}")

    def _force_cleanup(self) -> None:
        """Fallback after the daemon is gone: runc delete, kill shims, unmount, rmdir cgroups."""
        runc_ns_root = self.runc_root / self.namespace
        if runc_ns_root.is_dir():
            runc = self.binary("runc")
            for cid in sorted(os.listdir(runc_ns_root)):
                run([runc, "--root", str(runc_ns_root), "delete", "--force", cid], check=False)
        for pid in self.shim_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.shim_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        for cid in self._started_ids:
            sock = shim_socket(self.address, self.namespace, cid)
            sock.unlink(missing_ok=True)
        for mount_point in self.mounts():
            run(["umount", mount_point], check=False)
            if mount_point in self.mounts():
                run(["umount", "-l", mount_point], check=False)
        for controller in Path("/sys/fs/cgroup").iterdir():
            parent = controller / self.cgroup_parent.strip("/")
            if parent.is_dir():
                # rmdir only succeeds when empty: container cgroups are gone by now
                with contextlib.suppress(OSError):
                    parent.rmdir()

    def __enter__(self) -> Containerd:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- what is left ----------------------------------------------------------------

    def shim_pids(self) -> list[int]:
        """Pids of runc v2 shims serving this daemon."""
        address = str(self.address)
        pids = []
        for pid in _all_pids():
            args = _cmdline(pid)
            if args and "containerd-shim" in args[0] and address in args and pid_alive(pid):
                pids.append(pid)
        return pids

    def mounts(self) -> list[str]:
        """Mount points under ``base_dir`` in our mount namespace, deepest first."""
        prefix = str(self.base_dir) + "/"
        points = [
            m.mount_point
            for m in parse_mountinfo(read_text("/proc/self/mountinfo"))
            if m.mount_point.startswith(prefix) or m.mount_point == str(self.base_dir)
        ]
        return sorted(points, key=lambda p: p.count("/"), reverse=True)

    def leftovers(self) -> list[str]:
        """What would survive ``stop``: mounts under base_dir, shims, the daemon itself."""
        left = [f"mount {m}" for m in self.mounts()]
        left += [f"shim pid {p}" for p in self.shim_pids()]
        if self._proc is not None and self._proc.poll() is None:
            left.append(f"containerd pid {self._proc.pid}")
        return left

    # -- ctr -------------------------------------------------------------------------

    def ctr_argv(self, *args: str) -> list[str]:
        """The full ``ctr`` command line for ``args`` against this daemon and namespace."""
        return [self.binary("ctr"), "--address", str(self.address), "--namespace",
                self.namespace, *args]

    def ctr(
        self, *args: str, timeout: float = 60.0, check: bool = True, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against this daemon; raises TestbedError on failure when ``check``."""
        return run(self.ctr_argv(*args), timeout=timeout, check=check, input_text=input_text)

    def import_image(self, tar_path: Path) -> str:
        """Import an OCI/docker archive, unpack it for the snapshotter; return its name."""
        ref = image_ref(tar_path)
        base = ref.split("@", 1)[0]
        if ":" in base.rsplit("/", 1)[-1]:
            base = base.rsplit(":", 1)[0]
        self.ctr(
            "images",
            "import",
            "--snapshotter",
            self.snapshotter,
            "--base-name",
            base,
            str(tar_path),
            timeout=300,
        )
        if ref not in self.ctr("images", "ls", "-q").stdout.split():
            raise TestbedError(f"ctr images import {tar_path} did not create image {ref}")
        return ref

    def image_digest(self, ref: str) -> str:
        """The digest containerd records for image ``ref`` (its manifest or index digest)."""
        for line in self.ctr("images", "ls").stdout.splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] == ref:
                return fields[2]
        raise TestbedError(f"image {ref} not found in containerd at {self.address}")

    # -- containers ------------------------------------------------------------------

    def run(
        self,
        container_id: str,
        image_ref: str,
        args: Sequence[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        mounts: Sequence[Mount] = (),
        netns_path: Path | str | None = None,
        log_path: Path | None = None,
        cwd: str | None = None,
        privileged: bool = False,
        extra_args: Sequence[str] = (),
    ) -> Container:
        """Start a detached container; its stdout/stderr are pipes to the shim, logged to a file.

        ``args`` replaces the image's entrypoint+cmd (None keeps the image's).
        ``netns_path`` joins an existing network namespace (e.g. from CniNetwork.add);
        without it the container gets a fresh, unconnected one. ``log_path`` (emptied
        first) defaults to ``<base>/logs/<id>.log``.
        """
        log = (log_path or self.base_dir / "logs" / f"{container_id}.log").resolve()
        log.parent.mkdir(parents=True, exist_ok=True)
        # The shim appends to the file: a container run again under the same name (the
        # next test on a module's nodes) would start with the last one's output.
        log.unlink(missing_ok=True)
        argv = [
            "run",
            "--detach",
            "--snapshotter",
            self.snapshotter,
            "--runc-root",
            str(self.runc_root),
            "--log-uri",
            f"file://{log}",
            "--cgroup",
            f"{self.cgroup_parent}/{container_id}",
        ]
        for key, value in (env or {}).items():
            argv += ["--env", f"{key}={value}"]
        for mount in mounts:
            argv += ["--mount", mount.ctr_arg()]
        if netns_path is not None:
            argv += ["--with-ns", f"network:{netns_path}"]
        if cwd is not None:
            argv += ["--cwd", cwd]
        if privileged:
            argv.append("--privileged")
        if self.cgroup == "v2":
            # ctr asks for cpu shares 1024 unless told 0, which runc writes to cpu.weight on
            # v2; the cpu controller is bound to v1 on this kernel, so v2 has no such file.
            argv += ["--cpu-shares", "0", "--runc-binary", str(self._cri_runc())]
        elif self.bin_dir is not None:
            argv += ["--runc-binary", self.binary("runc")]
        argv += [*extra_args, image_ref, container_id, *(args or [])]
        self._started_ids.add(container_id)
        self.ctr(*argv, timeout=120)
        pid = self.task_pid(container_id)
        if pid is None:
            tail = (
                " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
                if log.exists()
                else ""
            )
            raise TestbedError(f"container {container_id} exited right after start; log: {tail}")
        return Container(container_id, pid, log, self.namespace, image_ref)

    def tasks(self) -> dict[str, tuple[int, str]]:
        """{container id: (host pid of init, status)} for every task in the namespace."""
        return parse_task_ls(self.ctr("tasks", "ls").stdout)

    def task_pid(self, container_id: str) -> int | None:
        """Host pid of the container's init while its task is RUNNING or PAUSED, else None."""
        task = self.tasks().get(container_id)
        if task is None or task[1] not in ("RUNNING", "PAUSED", "PAUSING"):
            return None
        return task[0]

    def container_ids(self) -> list[str]:
        return self.ctr("containers", "ls", "-q").stdout.split()

    def kill(
        self, container_id: str, sig: str | int = "SIGTERM", *, all_processes: bool = False
    ) -> None:
        """Send a signal to the container's init (or every process of it with all_processes)."""
        signame = sig if isinstance(sig, str) else signal.Signals(sig).name
        argv = ["tasks", "kill", "--signal", signame]
        if all_processes:
            argv.append("--all")
        self.ctr(*argv, container_id)

    def exec(
        self,
        container_id: str,
        args: Sequence[str],
        *,
        exec_id: str | None = None,
        timeout: float = 60.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run a process in the container (``ctr task exec``) and capture its output."""
        eid = exec_id or f"exec-{time.monotonic_ns()}"
        return self.ctr(
            "tasks", "exec", "--exec-id", eid, container_id, *args, timeout=timeout, check=check
        )

    def wait_exit(self, container_id: str, timeout: float) -> None:
        """Wait until the task is STOPPED (or gone)."""
        wait_for(
            lambda: self.tasks().get(container_id, (0, "STOPPED"))[1] == "STOPPED",
            timeout,
            f"task {container_id} to stop",
            interval=0.1,
        )

    def delete(self, container_id: str, *, timeout: float = 15.0) -> None:
        """SIGKILL every process of the task if it runs, delete the task and the container
        with its snapshot. (ctr 1.6 does not report the exit code; see the log instead.)
        """
        task = self.tasks().get(container_id)
        if task is not None:
            if task[1] != "STOPPED":
                self.ctr("tasks", "kill", "--signal", "SIGKILL", "--all", container_id, check=False)
                self.wait_exit(container_id, timeout)
            proc = self.ctr("tasks", "delete", container_id, check=False)
            if container_id in self.tasks():
                raise TestbedError(f"ctr tasks delete {container_id} failed: {proc.stderr.strip()}")
        if container_id in self.container_ids():
            self.ctr("containers", "delete", container_id)
