"""The real CNCF Distribution registry (github.com/distribution/distribution/v3, built by
hack/install-registry into $HERMIT_CACHE/bin), on loopback over plain HTTP with htpasswd
(bcrypt) basic auth, its storage in a temporary directory:

    with Registry(tmp_path) as reg:
        reg.host, reg.user, reg.password
        reg.get(f"/v2/hermit/init/manifests/{digest}")  # (status, headers, body), authenticated

A missing binary fails the test naming hack/install-registry.
"""

from __future__ import annotations

import base64
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import pytest

from tests.support import processes
from tests.support.binaries import cached_binary

INSTALL_HINT = "registry not found: run hack/install-registry"
READY_TIMEOUT_SECONDS = 20.0
ACCEPT = ", ".join(["application/vnd.oci.image.manifest.v1+json",
                    "application/vnd.oci.image.index.v1+json",
                    "application/vnd.docker.distribution.manifest.v2+json"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.user = "hermit"
        self.password = secrets.token_hex(12)
        htpasswd = shutil.which("htpasswd")
        if htpasswd is None:
            pytest.fail("htpasswd not found: run hack/install-registry (apache2-utils)")
        users = subprocess.run([htpasswd, "-Bbn", self.user, self.password],
                               capture_output=True, text=True, check=True).stdout
        (workdir / "htpasswd").write_text(users)
        self.port = _free_port()
        self.host = f"127.0.0.1:{self.port}"
        config = workdir / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log: {level: info}\n"
            f"storage: {{filesystem: {{rootdirectory: {workdir / 'data'}}}}}\n"
            f"http: {{addr: '{self.host}', secret: {secrets.token_hex(16)}}}\n"
            f"auth: {{htpasswd: {{realm: hermit-test, path: {workdir / 'htpasswd'}}}}}\n")
        self.log_path = workdir / "registry.log"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [cached_binary("registry", INSTALL_HINT), "serve", str(config)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"registry exited with {self.process.returncode}: {self.log_tail()}")
            status, _, _ = self.get("/v2/", auth=False)
            if status == 401:  # up, and asking for credentials
                return
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"registry did not answer within {READY_TIMEOUT_SECONDS:.0f} s: "
                    f"{self.log_tail()}")

    def get(self, path: str, *, auth: bool = True) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(f"http://{self.host}{path}", headers={"Accept": ACCEPT})
        if auth:
            token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
            req.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()
        except OSError:
            return 0, {}, b""

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        processes.end(self.process)

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
