"""The testbed's node flavours: Debian's containerd 1.6, or containerd 2 and a current runc
(hack/install-containerd2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermit_testbed.containerd import Containerd, containerd2_bin_dir
from hermit_testbed.errors import TestbedError
from tests.support.containerd import CTRD2_FLAVOURS, split_flavour


def test_a_node_flavour_names_its_runtime_and_cgroup_mode() -> None:
    assert split_flavour("v1") == ("debian", "v1")
    assert split_flavour("v2") == ("debian", "v2")
    assert split_flavour("ctrd2-v2") == ("ctrd2", "v2")
    assert [split_flavour(f) for f in CTRD2_FLAVOURS] == [("ctrd2", "v2")]


def test_an_unknown_runtime_flavour_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TestbedError, match="runtime flavour 'containerd3'"):
        Containerd(tmp_path, runtime="containerd3")


def test_the_ctrd2_binaries_come_from_the_cache_or_the_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HERMIT_CONTAINERD2_BIN", raising=False)
    monkeypatch.setenv("HERMIT_CACHE", str(tmp_path / "cache"))
    assert containerd2_bin_dir() == tmp_path / "cache" / "bin" / "containerd2"
    monkeypatch.setenv("HERMIT_CONTAINERD2_BIN", str(tmp_path / "bin"))
    assert containerd2_bin_dir() == tmp_path / "bin"
    assert Containerd(tmp_path / "node").bin_dir is None


def test_a_missing_ctrd2_binary_names_the_script_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HERMIT_CONTAINERD2_BIN", str(tmp_path / "bin"))
    daemon = Containerd(tmp_path / "node", runtime="ctrd2")
    with pytest.raises(TestbedError, match="hack/install-containerd2"):
        daemon.binary("containerd")
    with pytest.raises(TestbedError, match="hack/install-containerd2"):
        daemon.start()


def test_a_ctrd2_daemon_finds_its_shim_and_runc_first_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    runc = bin_dir / "runc"
    runc.write_text("#!/bin/sh\n")
    runc.chmod(0o755)
    monkeypatch.setenv("HERMIT_CONTAINERD2_BIN", str(bin_dir))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    daemon = Containerd(tmp_path / "node", runtime="ctrd2")
    assert daemon.binary("runc") == str(runc)
    env = daemon._daemon_env()
    assert env is not None and env["PATH"] == f"{bin_dir}:/usr/bin:/bin"
    assert Containerd(tmp_path / "other")._daemon_env() is None
