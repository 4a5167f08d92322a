"""Fixtures for a real CRIU: the binary built by hack/install-criu and its pycriu bindings.

- ``criu_bin``: path of a CRIU >= 4.2 binary ($HERMIT_CRIU_PATH, else $HERMIT_BIN/criu).
- ``pycriu_module``: the imported ``pycriu`` package (its ``images`` submodule loaded too).

Both fail (never skip) with a message that names hack/install-criu.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

MIN_CRIU_VERSION: tuple[int, int] = (4, 2)
INSTALL_HINT = "run hack/install-criu"


def hermit_bin_dir() -> Path:
    """$HERMIT_BIN, defaulting like hack/lib.sh does."""
    cache = Path(os.environ.get("HERMIT_CACHE", str(Path.home() / ".cache" / "hermit")))
    return Path(os.environ.get("HERMIT_BIN", str(cache / "bin")))


def criu_path() -> Path:
    """Where the CRIU binary is expected: $HERMIT_CRIU_PATH, else $HERMIT_BIN/criu."""
    explicit = os.environ.get("HERMIT_CRIU_PATH")
    return Path(explicit) if explicit else hermit_bin_dir() / "criu"


def parse_criu_version(output: str) -> tuple[int, int, int] | None:
    """Parse ``criu --version`` output ("Version: 4.2.1" or "Version: 4.2") into a tuple."""
    match = re.search(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", output, re.MULTILINE)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def criu_version(path: Path) -> tuple[int, int, int] | None:
    """The version of the CRIU binary at ``path``, or None when it cannot be run or parsed."""
    try:
        out = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError:
        return None
    return parse_criu_version(out.stdout)


@pytest.fixture(scope="session")
def criu_bin() -> Path:
    """Path to a CRIU 4.2+ binary; fails the test when it is missing, too old, or not root."""
    path = criu_path()
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"CRIU 4.2+ not found: {INSTALL_HINT} (looked at {path})")
    version = criu_version(path)
    if version is None or version[:2] < MIN_CRIU_VERSION:
        found = ".".join(map(str, version)) if version else "unknown version"
        pytest.fail(f"CRIU 4.2+ not found: {INSTALL_HINT} ({path} is {found})")
    if os.geteuid() != 0:
        pytest.fail("CRIU needs root: run the CRIU integration tests as root")
    return path


@pytest.fixture(scope="session")
def pycriu_module() -> ModuleType:
    """The ``pycriu`` package (RPC client + ``pycriu.images``); fails when not importable."""
    try:
        module = importlib.import_module("pycriu")
        importlib.import_module("pycriu.images")
    except ImportError as exc:
        pytest.fail(f"pycriu not importable ({exc}): {INSTALL_HINT}")
    return module
