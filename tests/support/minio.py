"""A real MinIO server for integration tests (built by hack/install-minio).

``minio_server`` (session scope) starts ``$HERMIT_BIN/minio`` on 127.0.0.1 with
a free port and a temporary data dir, waits for /minio/health/live, and stops
it at the end. ``MinioServer.settings(bucket)`` gives StoreSettings for it.
Missing binary: the test fails (never skips) and names the script to run.
The process handling itself lives in hermit_testbed.minio (the demo uses it too).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hermit_testbed import minio as _minio
from hermit_testbed.errors import TestbedError
from hermit_testbed.minio import MinioServer, stop_minio

__all__ = ["MinioServer", "minio_server", "start_minio", "stop_minio"]


def start_minio(workdir: Path, port: int | None = None) -> MinioServer:
    """Starts MinIO (see hermit_testbed.minio.start_minio); fails the test when it cannot."""
    try:
        return _minio.start_minio(workdir, port)
    except TestbedError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def minio_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MinioServer]:
    """A real MinIO on 127.0.0.1, shared by the session's tests."""
    server = start_minio(tmp_path_factory.mktemp("minio"))
    try:
        yield server
    finally:
        stop_minio(server)
