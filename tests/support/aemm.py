"""The real amazon-ec2-metadata-mock (AEMM), started on 127.0.0.1 by a fixture.

    def test_x(aemm):
        server = aemm("spot", "--imdsv2", "--mock-delay-sec", "2")
        server.url  # http://127.0.0.1:<port>

Built by hack/install-aemm into $HERMIT_CACHE/bin; a missing binary fails the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.support import processes
from tests.support.binaries import cached_binary

INSTALL_HINT = "amazon-ec2-metadata-mock not found: run hack/install-aemm"
READY_TIMEOUT_SECONDS = 15.0


def aemm_binary() -> str:
    return cached_binary("ec2-metadata-mock", INSTALL_HINT)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class AemmServer:
    """One AEMM process; ``stop()``/``start()`` keep the port, so clients can reconnect."""

    def __init__(self, binary: str, args: tuple[str, ...], workdir: Path) -> None:
        self.binary = binary
        self.args = args
        self.workdir = workdir
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"aemm-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AemmServer:
        if self.process is not None and self.process.poll() is None:
            return self
        # HOME points at an empty directory so no ~/aemm-config.json is picked up.
        env = {**os.environ, "HOME": str(self.workdir)}
        cmd = [self.binary, *self.args, "--hostname", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdout=log,
                                            stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"ec2-metadata-mock exited with {self.process.returncode}: "
                            f"{self.log_tail()}")
            try:
                requests.get(self.url + "/latest/meta-data", timeout=0.5)
                return
            except requests.RequestException:
                time.sleep(0.05)
        self.stop()
        pytest.fail(f"ec2-metadata-mock did not answer on {self.url} within "
                    f"{READY_TIMEOUT_SECONDS:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        processes.end(self.process)

    def restart(self) -> AemmServer:
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class AemmFactory:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.servers: list[AemmServer] = []

    def __call__(self, *args: str) -> AemmServer:
        """Starts AEMM with ``args`` (a subcommand such as ``spot`` and its flags)."""
        server = AemmServer(aemm_binary(), args, self.workdir)
        self.servers.append(server)
        return server.start()

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def aemm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AemmFactory]:
    factory = AemmFactory(tmp_path_factory.mktemp("aemm"))
    try:
        yield factory
    finally:
        factory.stop_all()
