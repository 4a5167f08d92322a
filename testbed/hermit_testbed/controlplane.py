"""A throwaway Kubernetes control plane on 127.0.0.1: etcd, kube-apiserver and (for pods
that must be bound) kube-scheduler, from the binaries hack/install-k8s builds.

Free ports and a directory of its own: it never touches the shared cluster
(hack/cluster). The API server authenticates one static token (group system:masters) and
authorizes everything; its serving certificate is self-signed (the kubeconfig skips
verification). No controller-manager runs: no ServiceAccount controller, no garbage
collector. Used by the node-agent's watch tests (tests/integration) and
bench/operator_scale.py.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from hermit_testbed.errors import TestbedError
from hermit_testbed.minio import free_port

TOKEN = "hermit-testbed-token"
INSTALL_HINT = "run hack/install-k8s"
_REQUEST = re.compile(r'^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$')


def binary(name: str, hint: str = INSTALL_HINT) -> str:
    """A binary from $HERMIT_CACHE/bin (hack/install-*)."""
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache" / "hermit"))
    path = cache / "bin" / name
    if not os.access(path, os.X_OK):
        raise TestbedError(f"{path} is missing: {hint}")
    return str(path)


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TestbedError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.2)


@dataclass
class Processes:
    """Processes started with their output in ``dir/<name>.log``; stopped in reverse order."""

    dir: Path
    started: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        with (self.dir / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.started.append((name, proc))
        return proc

    def check(self) -> None:
        """TestbedError (with the end of its log) when a process has exited."""
        for name, proc in self.started:
            if proc.poll() is not None:
                tail = (self.dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise TestbedError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for _, proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(self.started):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class ControlPlane:
    """A running control plane: its API port, kubeconfig and processes."""

    port: int
    kubeconfig: Path
    processes: Processes

    def get(self, path: str) -> str:
        """GET ``path`` from the API server (``/readyz``, ``/metrics``)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        req = urllib.request.Request(f"https://127.0.0.1:{self.port}{path}",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return str(resp.read().decode())

    def ready(self) -> bool:
        try:
            return self.get("/readyz") == "ok"
        except OSError:
            return False

    def request_counts(self) -> dict[str, float]:
        """``apiserver_request_total`` summed per resource (every verb and code)."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").splitlines():
            m = _REQUEST.match(line)
            if m is None:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
            resource = labels.get("resource") or "(none)"
            out[resource] = out.get(resource, 0.0) + float(m.group("value"))
        return out

    def stop(self) -> None:
        self.processes.stop()


def _keys(d: Path) -> None:
    for argv in (["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"],
                 ["openssl", "rsa", "-in", str(d / "sa.key"), "-pubout", "-out",
                  str(d / "sa.pub")]):
        subprocess.run(argv, check=True, capture_output=True)
    (d / "tokens.csv").write_text(f"{TOKEN},testbed-admin,testbed-admin,system:masters\n")


def _kubeconfig(d: Path, port: int) -> Path:
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "testbed",
        "clusters": [{"name": "testbed", "cluster": {
            "server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "testbed", "user": {"token": TOKEN}}],
        "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": "testbed"}}],
    }
    path = d / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def _etcd(procs: Processes) -> int:
    client, peer = free_port(), free_port()
    procs.start("etcd", [binary("etcd"), "--name", "testbed", "--data-dir",
                         str(procs.dir / "etcd"),
                         "--listen-client-urls", f"http://127.0.0.1:{client}",
                         "--advertise-client-urls", f"http://127.0.0.1:{client}",
                         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-cluster", f"testbed=http://127.0.0.1:{peer}",
                         "--listen-metrics-urls", "", "--unsafe-no-fsync",
                         "--quota-backend-bytes", "4294967296", "--log-level", "warn"])
    return client


def _alive(procs: Processes) -> bool:
    procs.check()
    return True


def start_control_plane(d: Path, *, scheduler: bool = False,
                        authorization: str = "AlwaysAllow") -> ControlPlane:
    """etcd and kube-apiserver (and kube-scheduler) in directory ``d``; TestbedError when one
    does not come up (everything started is stopped then). ``authorization``: the API
    server's --authorization-mode ("RBAC" to hold service accounts to their roles; the
    admin token is in system:masters either way)."""
    procs = Processes(d)
    try:
        _keys(d)
        client, port = _etcd(procs), free_port()
        procs.start("kube-apiserver", [
            binary("kube-apiserver"), "--etcd-servers", f"http://127.0.0.1:{client}",
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
            "--secure-port", str(port), "--cert-dir", str(d / "certs"),
            "--token-auth-file", str(d / "tokens.csv"), "--authorization-mode", authorization,
            "--service-account-key-file", str(d / "sa.pub"),
            "--service-account-signing-key-file", str(d / "sa.key"),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-cluster-ip-range", "10.96.0.0/16", "--profiling=false",
            "--max-requests-inflight", "800", "--max-mutating-requests-inflight", "400"])
        plane = ControlPlane(port, _kubeconfig(d, port), procs)
        wait_for("kube-apiserver /readyz", lambda: _alive(procs) and plane.ready(), 120)
        if scheduler:
            kc = str(plane.kubeconfig)
            procs.start("kube-scheduler", [
                binary("kube-scheduler"), "--kubeconfig", kc, "--authentication-kubeconfig", kc,
                "--authorization-kubeconfig", kc, "--bind-address", "127.0.0.1",
                "--secure-port", "0", "--leader-elect=false", "--kube-api-qps", "200",
                "--kube-api-burst", "400"])
        return plane
    except BaseException:
        procs.stop()
        raise
