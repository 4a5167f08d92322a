"""A real MinIO server process on 127.0.0.1 (built by hack/install-minio).

Used by the integration tests (through tests/support/minio.py), the demo and bench/.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from hermit_common.settings import StoreSettings
from hermit_testbed.errors import TestbedError

START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 15.0
INSTALL_HINT = "MinIO not found: run hack/install-minio"


def minio_binary() -> Path:
    """The MinIO binary built by hack/install-minio."""
    cache = Path(os.environ.get("HERMIT_CACHE", Path.home() / ".cache" / "hermit"))
    candidates = [cache / "bin" / "minio"]
    found = shutil.which("minio")
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise TestbedError(INSTALL_HINT)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _live(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/minio/health/live", timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class MinioServer:
    """A running MinIO: where it listens and how to log in."""

    endpoint: str
    access_key: str
    secret_key: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    def settings(self, bucket: str, **overrides: object) -> StoreSettings:
        """StoreSettings pointing at this server; keyword arguments override fields."""
        base = StoreSettings(
            bucket=bucket, prefix="hermit", endpoint_url=self.endpoint, region="us-east-1",
            access_key_id=self.access_key, secret_access_key=self.secret_key,
            transfer_concurrency=4, max_attempts=3, connect_timeout_seconds=2.0,
            read_timeout_seconds=30.0,
        )
        return replace(base, **overrides)  # type: ignore[arg-type]

    def is_live(self) -> bool:
        return self.process.poll() is None and _live(self.endpoint)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_minio(
    workdir: Path, port: int | None = None, host: str = "127.0.0.1",
) -> MinioServer:
    """Starts MinIO in ``workdir`` and waits (with a deadline) until it is live.

    Reusing a ``workdir`` (and ``port``) restarts a stopped server with its data.
    ``host`` is the address to listen on: loopback, or the local cluster's host bridge
    so that pods reach it.
    """
    binary = minio_binary()
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    port, console_port = port or free_port(host), free_port()
    endpoint = f"http://{host}:{port}"
    access, secret = "hermit-test", "hermit-test-secret-key"
    env = dict(os.environ)
    env.update(MINIO_ROOT_USER=access, MINIO_ROOT_PASSWORD=secret,
               MINIO_BROWSER="off", MINIO_UPDATE="off", MINIO_CI_CD="1")
    log_path = workdir / "minio.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [os.fspath(binary), "server", "--quiet", "--address", f"{host}:{port}",
             "--console-address", f"127.0.0.1:{console_port}", os.fspath(data)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    server = MinioServer(endpoint, access, secret, data, process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise TestbedError(
                f"MinIO exited with {process.returncode} at start:\n{server.log_tail()}")
        if _live(endpoint):
            return server
        time.sleep(0.1)
    stop_minio(server)
    raise TestbedError(f"MinIO at {endpoint} not live after {START_TIMEOUT_SECONDS:.0f}s:\n"
                       f"{server.log_tail()}")


def stop_minio(server: MinioServer) -> None:
    if server.process.poll() is not None:
        return
    server.process.send_signal(signal.SIGTERM)
    try:
        server.process.wait(timeout=STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=STOP_TIMEOUT_SECONDS)
