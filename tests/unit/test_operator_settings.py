from __future__ import annotations

import os
from pathlib import Path

import pytest

from hermit_common.errors import SettingsError
from hermit_common.settings import OperatorSettings, redacted


def test_defaults_need_no_environment() -> None:
    s = OperatorSettings.from_env({})
    assert s.clusterwide and s.watch_namespaces == () and s.peering_name is None
    assert (s.metrics_port, s.log_level) == (9102, "INFO")
    assert s.init_image == "hermit.local/init:dev", "the small init image, not the node-agent's"
    assert s.init_path == "/usr/local/bin/hermit-init" and s.store is None
    assert s.overlap_moves, "a move's replacement pod overlaps its checkpoint by default"


def test_values_from_the_environment() -> None:
    s = OperatorSettings.from_env({
        "HERMIT_WATCH_NAMESPACE": "team-a, team-b,team-a", "HERMIT_PEERING_NAME": "hermit",
        "HERMIT_METRICS_PORT": "9300", "HERMIT_LOG_LEVEL": "DEBUG",
        "HERMIT_INIT_IMAGE": "reg/hermit:2", "HERMIT_INIT_PATH": "/usr/local/bin/hermit-init",
        "HERMIT_S3_BUCKET": "ckpts", "HERMIT_S3_ACCESS_KEY_ID": "AKIA",
        "HERMIT_S3_SECRET_ACCESS_KEY": "very-secret",
    })
    assert s.watch_namespaces == ("team-a", "team-b") and not s.clusterwide
    assert (s.peering_name, s.metrics_port, s.log_level) == ("hermit", 9300, "DEBUG")
    assert (s.init_image, s.init_path) == ("reg/hermit:2", "/usr/local/bin/hermit-init")
    pinned = "reg/init@sha256:" + "0" * 64
    assert OperatorSettings.from_env({"HERMIT_INIT_IMAGE": pinned}).init_image == pinned
    assert s.store is not None and s.store.bucket == "ckpts"
    assert "very-secret" not in repr(redacted(s))
    assert not OperatorSettings.from_env({"HERMIT_OVERLAP_MOVES": "false"}).overlap_moves


def test_watch_namespaces_blank_is_every_namespace() -> None:
    for raw in ("", " ", " , ,"):
        s = OperatorSettings.from_env({"HERMIT_WATCH_NAMESPACE": raw})
        assert s.watch_namespaces == () and s.clusterwide
    s = OperatorSettings.from_env({"HERMIT_WATCH_NAMESPACE": "team-a," + "n" * 63})
    assert s.watch_namespaces == ("team-a", "n" * 63) and not s.clusterwide


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HERMIT_METRICS_PORT": "0"}, "HERMIT_METRICS_PORT=0 is below the minimum 1"),
        ({"HERMIT_LOG_LEVEL": "LOUD"}, "HERMIT_LOG_LEVEL='LOUD' is not one of"),
        ({"HERMIT_OVERLAP_MOVES": "sometimes"}, "HERMIT_OVERLAP_MOVES='sometimes' is not a"),
        ({"HERMIT_INIT_PATH": "bin/init"}, "HERMIT_INIT_PATH='bin/init' is not an absolute"),
        ({"HERMIT_INIT_PULL_POLICY": "Sometimes"}, "HERMIT_INIT_PULL_POLICY='Sometimes' is not"),
        ({"HERMIT_INIT_IMAGE": "@sha256:" + "0" * 64}, "a pinned image is REPOSITORY@sha256"),
        ({"HERMIT_INIT_IMAGE": "reg/init:1 x"}, "HERMIT_INIT_IMAGE='reg/init:1 x' is not an"),
        ({"HERMIT_INIT_IMAGE": "reg/init@sha256:abc"},
         r"HERMIT_INIT_IMAGE='reg/init@sha256:abc': a pinned image is REPOSITORY@sha256"),
        ({"HERMIT_S3_BUCKET": "b", "HERMIT_S3_ACCESS_KEY_ID": "a"}, "must be set together"),
        ({"HERMIT_WATCH_NAMESPACE": "team-a,Team_B"},
         r"^HERMIT_WATCH_NAMESPACE: 'Team_B' not namespace names \(DNS-1123 labels"),
        ({"HERMIT_WATCH_NAMESPACE": "-a, team-a/x," + "n" * 64},
         r"^HERMIT_WATCH_NAMESPACE: '-a', 'team-a/x', 'n{64}' not namespace names"),
    ],
)
def test_errors_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        OperatorSettings.from_env(env)


def _run_main(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> int:
    from hermit_operator.main import main

    for name in [n for n in os.environ if n.startswith("HERMIT_") or n == "KUBECONFIG"]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main()
    return int(exit_info.value.code or 0)


def test_cli_prints_one_line_and_exits_2_on_a_bad_setting(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_main(monkeypatch, {"HERMIT_METRICS_PORT": "lots"}) == 2
    assert capsys.readouterr().err == (
        "hermit-operator: HERMIT_METRICS_PORT='lots' is not an integer\n")


def test_cli_without_credentials_says_so_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _run_main(monkeypatch, {"KUBECONFIG": str(tmp_path / "none")}) == 1
    err = capsys.readouterr().err
    assert err.startswith("hermit-operator: no Kubernetes credentials") and err.count("\n") == 1


@pytest.mark.parametrize("peering", [None, "hermit"])
def test_kopf_is_configured_from_the_settings(peering: str | None) -> None:
    import logging

    import kopf

    from hermit_operator import kopfconfig

    ks = kopf.OperatorSettings()
    kopfconfig.configure(ks, OperatorSettings(peering_name=peering))
    assert ks.peering.standalone is (peering is None)
    if peering is not None:
        assert (ks.peering.name, ks.peering.mandatory) == ("hermit", True)
    assert ks.posting.level == logging.WARNING
    assert isinstance(ks.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert ks.persistence.finalizer.startswith("hermit.dev/")
    assert ks.watching.server_timeout == kopfconfig.WATCH_SERVER_TIMEOUT
