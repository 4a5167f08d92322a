from __future__ import annotations

import pytest

from hermit_common.errors import SettingsError
from hermit_common.settings import NodeSettings, StoreSettings, WatcherSettings, redacted

BASE = {"HERMIT_S3_BUCKET": "ckpts", "HERMIT_NODE_NAME": "node-1"}


def test_defaults() -> None:
    s = NodeSettings.from_env(BASE)
    assert s.store.bucket == "ckpts" and s.store.prefix == "hermit"
    assert s.store.endpoint_url is None and s.watcher.provider == "aws"
    assert s.watcher.poll_interval_seconds == 1.0
    assert s.cgroup_root == "/sys/fs/cgroup"
    assert NodeSettings.from_env({**BASE, "HERMIT_CGROUP_ROOT": "/host/cgroup"}).cgroup_root \
        == "/host/cgroup"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HERMIT_NODE_NAME": "n"}, "HERMIT_S3_BUCKET is required"),
        ({**BASE, "HERMIT_S3_CONCURRENCY": "lots"}, "HERMIT_S3_CONCURRENCY='lots' is not an"),
        ({**BASE, "HERMIT_S3_CONCURRENCY": "0"}, "HERMIT_S3_CONCURRENCY=0 is below the minimum 1"),
        ({**BASE, "HERMIT_S3_ENDPOINT": "minio:9000"}, "HERMIT_S3_ENDPOINT='minio:9000' is not an"),
        ({**BASE, "HERMIT_CLOUD_PROVIDER": "ibm"}, "HERMIT_CLOUD_PROVIDER='ibm' is not one of"),
        ({**BASE, "HERMIT_POLL_INTERVAL_SECONDS": "5"}, "above the maximum 2.0"),
        ({**BASE, "HERMIT_S3_ACCESS_KEY_ID": "a"}, "must be set together"),
        ({**BASE, "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND": "-1"},
         "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND=-1 is below the minimum 0"),
        ({**BASE, "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND": "50MB"},
         "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND='50MB' is not an integer"),
        ({**BASE, "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND": "1000"},
         "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND=1000 is below the minimum 1048576"),
        ({**BASE, "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND": str(10**12)}, "above the maximum"),
    ],
)
def test_errors_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        NodeSettings.from_env(env)


def test_redacted_masks_credentials() -> None:
    s = StoreSettings.from_env({**BASE, "HERMIT_S3_ACCESS_KEY_ID": "AKIA",
                                "HERMIT_S3_SECRET_ACCESS_KEY": "very-secret"})
    out = redacted(s)
    assert out["secret_access_key"] == "***" and out["access_key_id"] == "***"
    assert "very-secret" not in repr(out)


def test_watcher_urls_are_trimmed() -> None:
    w = WatcherSettings.from_env({"HERMIT_AWS_IMDS_URL": "http://127.0.0.1:1338/"})
    assert w.aws_imds_url == "http://127.0.0.1:1338"


def test_per_sandbox_storage_is_off_unless_turned_on() -> None:
    assert NodeSettings.from_env(BASE).per_sandbox_storage is False
    on = NodeSettings.from_env({**BASE, "HERMIT_PER_SANDBOX_STORAGE": "true"})
    assert on.per_sandbox_storage is True
    with pytest.raises(SettingsError, match="HERMIT_PER_SANDBOX_STORAGE='maybe' is not a "):
        NodeSettings.from_env({**BASE, "HERMIT_PER_SANDBOX_STORAGE": "maybe"})


def test_upload_bandwidth_is_unlimited_unless_set() -> None:
    assert NodeSettings.from_env(BASE).upload_bandwidth_bytes_per_second == 0
    env = {**BASE, "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND": "125000000"}  # 1 Gbit/s
    assert NodeSettings.from_env(env).upload_bandwidth_bytes_per_second == 125_000_000
    env["HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND"] = "0"
    assert NodeSettings.from_env(env).upload_bandwidth_bytes_per_second == 0


def test_the_chunk_cache_is_off_unless_a_size_is_set() -> None:
    assert NodeSettings.from_env(BASE).chunk_cache_bytes == 0
    env = {**BASE, "HERMIT_CHUNK_CACHE_BYTES": str(2 * 1024 ** 3)}
    assert NodeSettings.from_env(env).chunk_cache_bytes == 2 * 1024 ** 3
    with pytest.raises(SettingsError, match="HERMIT_CHUNK_CACHE_BYTES=-1 is below"):
        NodeSettings.from_env({**BASE, "HERMIT_CHUNK_CACHE_BYTES": "-1"})
    with pytest.raises(SettingsError, match="HERMIT_CHUNK_CACHE_BYTES='2G' is not an integer"):
        NodeSettings.from_env({**BASE, "HERMIT_CHUNK_CACHE_BYTES": "2G"})


def test_lazy_restore_is_off_unless_turned_on() -> None:
    assert NodeSettings.from_env(BASE).lazy_restore is False
    assert NodeSettings.from_env({**BASE, "HERMIT_LAZY_RESTORE": "true"}).lazy_restore is True
    with pytest.raises(SettingsError, match="HERMIT_LAZY_RESTORE='soon' is not a "):
        NodeSettings.from_env({**BASE, "HERMIT_LAZY_RESTORE": "soon"})


def test_redacted_masks_a_session_token() -> None:
    s = StoreSettings(bucket="b-1", access_key_id="AKIA", secret_access_key="s",
                      session_token="very-secret-token")
    assert redacted(s)["session_token"] == "***"
