"""The real local-kms (github.com/nsmithuk/local-kms, an AWS KMS API mock), started by a
fixture with its database in a temporary directory:

    def test_x(local_kms):
        client = local_kms.client()  # boto3 kms client for it

Built by hack/install-local-kms into $HERMIT_CACHE/bin; a missing binary fails the test.
It listens on every interface (it takes no address): on port 0, the one it reports.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from tests.support import processes
from tests.support.binaries import cached_binary

INSTALL_HINT = "local-kms not found: run hack/install-local-kms"
READY_TIMEOUT_SECONDS = 15.0
REGION = "eu-west-2"
_STARTED = re.compile(r"Local KMS started on [0-9.]+:(\d+)")


def local_kms_binary() -> str:
    return cached_binary("local-kms", INSTALL_HINT)


class LocalKms:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / "local-kms.log"
        env = {**os.environ, "PORT": "0", "KMS_REGION": REGION,
               "KMS_ACCOUNT_ID": "111122223333", "KMS_DATA_PATH": str(workdir / "data"),
               "KMS_SEED_PATH": str(workdir / "no-seed.yaml")}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([local_kms_binary()], cwd=workdir, env=env,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.port = self._wait_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _wait_port(self) -> int:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"local-kms exited with {self.process.returncode}: "
                            f"{self.log_tail()}")
            found = _STARTED.search(self.log_path.read_text(errors="replace"))
            if found:
                return int(found.group(1))
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"local-kms did not start within {READY_TIMEOUT_SECONDS:.0f} s: "
                    f"{self.log_tail()}")

    def client(self) -> Any:
        return boto3.session.Session().client(
            "kms", region_name=REGION, endpoint_url=self.endpoint,
            aws_access_key_id="local", aws_secret_access_key="local",
            config=Config(retries={"mode": "standard", "max_attempts": 2},
                          connect_timeout=2, read_timeout=5))

    def stop(self) -> None:
        processes.end(self.process)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="module")
def local_kms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalKms]:
    server = LocalKms(tmp_path_factory.mktemp("local-kms"))
    try:
        yield server
    finally:
        server.stop()
