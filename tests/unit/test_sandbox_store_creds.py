"""Per-sandbox store credentials (docs/storage.md#per-sandbox-store-credentials): the key
service reads a sandbox's Secret for the node that serves it and answers credentials for
that store and prefix only; the vendor's modes (STS, STS or static, static); the bounded
Secret parse; the settings."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from hermit_common import sandboxstore
from hermit_common.errors import SettingsError
from hermit_common.keyclient import PATH_STORE_CREDENTIALS
from hermit_common.kubeapi import KubeForbidden
from hermit_common.sandboxstore import Location, StorageError, parse_credentials
from hermit_common.settings import KeyServiceSettings, StoreSettings
from hermit_common.storecreds import session_policy
from hermit_operator import keyservice, storevend
from tests.support.keyservice_fakes import (
    AGENT,
    AUDIENCE,
    FORK,
    SANDBOXES,
    keyring_wrapper,
    sandbox_pod,
)
from tests.support.keyservice_fakes import FakeKube as BaseKube

DEFAULTS = StoreSettings(bucket="shared", prefix="hermit", endpoint_url="http://minio:9000",
                         region="us-east-1")
OWN = Location(bucket="team-a", prefix="hermit", region="us-east-1",
               endpoint="http://minio:9000")
OLD = Location(bucket="team-a-old", prefix="p", region="eu-west-1",
               endpoint="https://s3.example")
ACCESS, SECRET = "AKIATEAMA", "team-a-very-secret"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def secret(**data: str) -> dict[str, Any]:
    return {"metadata": {"name": "a-s3", "namespace": "team-a"},
            "data": {k: b64(v) for k, v in data.items()}}


GOOD = secret(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET)


def with_storage(obj: dict[str, Any], storage: dict[str, Any] | None) -> dict[str, Any]:
    out = json.loads(json.dumps(obj))
    if storage is not None:
        out["spec"] = {"checkpoint": {"storage": storage}}
    return out


class FakeKube(BaseKube):
    """Box (on node-a) names its own bucket and Secret; other (on node-b) too."""

    def __init__(self) -> None:
        super().__init__()
        store = {"bucket": "team-a", "secretRef": {"name": "a-s3"}}
        self.sandboxes = {name: with_storage(obj, store) for name, obj in SANDBOXES.items()}
        self.checkpoints = {
            "box-1": {"metadata": {"namespace": "team-a", "name": "box-1"},
                      "spec": {"sandboxRef": {"name": "box"}},
                      "status": {"storage": OLD.to_status()}},
            "other-1": {"metadata": {"namespace": "team-a", "name": "other-1"},
                        "spec": {"sandboxRef": {"name": "other"}}}}
        self.secrets: dict[str, dict[str, Any]] = {"a-s3": GOOD}
        self.secret_reads: list[str] = []
        self.forbidden = False

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.sandboxes.get(name)

    def get_checkpoint(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.checkpoints.get(name)

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.secret_reads.append(f"{namespace}/{name}")
        if self.forbidden:
            raise KubeForbidden(f"reading Secret {namespace}/{name} failed: forbidden",
                                status=403, detail="forbidden")
        return self.secrets.get(name)


class Vendor:
    def __init__(self) -> None:
        self.defaults = DEFAULTS
        self.calls: list[tuple[Any, ...]] = []

    def credentials(self, node: str, namespace: str, sandbox: str, *, write: bool,
                    reads: tuple[str, ...], location: Location,
                    secret: sandboxstore.Credentials) -> dict[str, Any]:
        self.calls.append((node, sandbox, write, reads, location, secret.access_key_id))
        return {"accessKeyId": "AK", "secretAccessKey": "SK", "sessionToken": "ST",
                "durationSeconds": 900, "location": location.to_status()}


def _ask(kube: FakeKube, vendor: Vendor | None, token: str, body: dict[str, Any]
         ) -> tuple[int, dict[str, Any]]:
    svc = keyservice.KeyService(keyring_wrapper(), kube, callers=[AGENT], audience=AUDIENCE,
                                sandbox_vendor=vendor)  # type: ignore[arg-type]
    auth = f"Bearer {token}"
    refused = svc.admit(PATH_STORE_CREDENTIALS, auth, "10.0.0.1")
    if refused is not None:
        return refused.status, refused.body
    reply = svc.handle(PATH_STORE_CREDENTIALS, auth, json.dumps(body).encode(), "10.0.0.1")
    return reply.status, reply.body


SPEC = {"namespace": "team-a", "sandbox": "box", "storage": "spec"}


def test_the_node_running_the_sandbox_gets_its_stores_credentials_read_write() -> None:
    kube, vendor = FakeKube(), Vendor()
    status, body = _ask(kube, vendor, "token-a", SPEC)
    assert status == 200 and body["location"] == OWN.to_status()
    assert vendor.calls == [("node-a", "box", True, (), OWN, ACCESS)]
    assert kube.secret_reads == ["team-a/a-s3"]


def test_another_node_is_refused_and_no_secret_is_read() -> None:
    kube, vendor = FakeKube(), Vendor()
    status, body = _ask(kube, vendor, "token-b", SPEC)
    assert status == 403 and "neither runs nor restores" in body["error"]
    status, _ = _ask(kube, vendor, "token-b", {**SPEC, "storage": "checkpoint",
                                                "checkpoint": "box-1"})
    assert status == 403
    assert vendor.calls == [] and kube.secret_reads == []
    assert _ask(kube, vendor, "token-user", SPEC)[0] == 403


def test_a_checkpoints_store_is_the_one_it_recorded_and_read_only() -> None:
    kube, vendor = FakeKube(), Vendor()
    # The spec's endpoint is the Secret's; OLD's endpoint differs: it still needs one.
    status, body = _ask(kube, vendor, "token-a", {**SPEC, "storage": "checkpoint",
                                                   "checkpoint": "box-1"})
    assert status == 200 and body["location"] == OLD.to_status()
    assert vendor.calls == [("node-a", "box", False, (), OLD, ACCESS)]


def test_a_checkpoint_of_another_sandbox_is_refused() -> None:
    kube, vendor = FakeKube(), Vendor()
    status, body = _ask(kube, vendor, "token-a", {**SPEC, "storage": "checkpoint",
                                                   "checkpoint": "other-1"})
    assert status == 403 and "not one of sandbox box's" in body["error"]
    status, _ = _ask(kube, vendor, "token-a", {**SPEC, "storage": "checkpoint",
                                                "checkpoint": "missing"})
    assert status == 403 and vendor.calls == [] and kube.secret_reads == []


def test_a_fork_restoring_gets_its_sources_store_read_only() -> None:
    kube, vendor = FakeKube(), Vendor()
    kube.pods = [sandbox_pod(FORK, "node-a", restore="box-3-manual")]
    kube.checkpoints["box-3-manual"] = {
        "metadata": {"namespace": "team-a", "name": "box-3-manual"},
        "spec": {"sandboxRef": {"name": "box"}}, "status": {"storage": OWN.to_status()}}
    assert _ask(kube, vendor, "token-a", SPEC)[0] == 200
    assert _ask(kube, vendor, "token-a", {**SPEC, "storage": "checkpoint",
                                          "checkpoint": "box-3-manual"})[0] == 200
    assert [c[2] for c in vendor.calls] == [False, False]  # restores only: never write


def test_a_sandbox_replaced_while_asked_gives_nothing(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """Authorized for box's uid; by the time its store is read, box is another sandbox of
    the same name: its Secret is not read."""
    from hermit_operator import keyaccess

    kube, vendor = FakeKube(), Vendor()
    old = kube.sandboxes["box"]
    new = {**old, "metadata": {**old["metadata"], "uid": "uid-new"}}
    decide = keyaccess.decide

    def decide_then_replace(*args: Any, **kwargs: Any) -> str:
        out = decide(*args, **kwargs)
        kube.sandboxes["box"] = new  # from here on, box is another sandbox
        return out

    monkeypatch.setattr(keyaccess, "decide", decide_then_replace)
    status, body = _ask(kube, vendor, "token-a", SPEC)
    assert status == 403 and "gone or was replaced" in body["error"]
    assert vendor.calls == [] and kube.secret_reads == []


@pytest.mark.parametrize(("change", "message"), [
    (lambda k: k.secrets.clear(), "Secret team-a/a-s3, named by"),
    (lambda k: k.secrets.update({"a-s3": secret(AWS_ACCESS_KEY_ID=ACCESS)}),
     "has no AWS_SECRET_ACCESS_KEY"),
    (lambda k: setattr(k, "forbidden", True), "nodeAgent.perSandboxStorageNamespaces"),
    (lambda k: k.sandboxes["box"].update(spec={}), "names no secretRef"),
])
def test_an_unusable_secret_is_400_and_names_no_value(change: Any, message: str) -> None:
    kube, vendor = FakeKube(), Vendor()
    change(kube)
    status, body = _ask(kube, vendor, "token-a", SPEC)
    assert status == 400 and message in body["error"], body
    assert ACCESS not in body["error"] and vendor.calls == []


@pytest.mark.parametrize("body", [
    {**SPEC, "storage": "elsewhere"},
    {**SPEC, "storage": "checkpoint"},
    {**SPEC, "storage": "checkpoint", "checkpoint": "../x"},
    {**SPEC, "storage": "checkpoint", "checkpoint": "c" * 300},
    {**SPEC, "sandbox": "box/../other"},
])
def test_hostile_requests_are_400(body: dict[str, Any]) -> None:
    kube, vendor = FakeKube(), Vendor()
    assert _ask(kube, vendor, "token-a", body)[0] == 400
    assert vendor.calls == [] and kube.secret_reads == []


def test_without_a_sandbox_vendor_it_is_404_naming_the_setting() -> None:
    status, body = _ask(FakeKube(), None, "token-a", SPEC)
    assert status == 404 and "HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS" in body["error"]
    # and the default store's request is still the default vendor's (none here: 404)
    status, body = _ask(FakeKube(), Vendor(), "token-a", {"namespace": "team-a",
                                                          "sandbox": "box"})
    assert status == 404 and "HERMIT_KEY_SERVICE_STORE_CREDENTIALS)" in body["error"]


# -- the vendor's modes ----------------------------------------------------------------


class FakeSts:
    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[StoreSettings, dict[str, Any]]] = []
        self.refuse = refuse

    def make(self, store: StoreSettings) -> Any:
        sts = self

        class Client:
            def assume_role(self, **kw: Any) -> dict[str, Any]:
                sts.calls.append((store, kw))
                if sts.refuse:
                    err = Exception("refused")
                    err.response = {"Error": {"Code": "NotImplemented"}}  # type: ignore[attr-defined]
                    raise err
                return {"Credentials": {"AccessKeyId": "TMP", "SecretAccessKey": "TMPS",
                                        "SessionToken": "TOK", "Expiration": "2030"}}
        return Client()


def _vendor(mode: str, sts: FakeSts) -> storevend.SandboxStoreVendor:
    return storevend.SandboxStoreVendor(
        DEFAULTS, KeyServiceSettings(sandbox_store_credentials=mode,
                                     store_credentials_seconds=900), make_sts=sts.make)


CREDS = sandboxstore.Credentials(ACCESS, SECRET, None, "arn:aws:iam::1:role/team-a")


def test_sts_assumes_the_secrets_role_at_the_stores_endpoint_for_one_prefix() -> None:
    sts = FakeSts()
    out = _vendor("sts", sts).credentials("node-a", "team-a", "box", write=True, reads=(),
                                          location=OLD, secret=CREDS)
    assert (out["mode"], out["accessKeyId"], out["sessionToken"]) == ("sts", "TMP", "TOK")
    assert out["location"] == OLD.to_status() and out["access"] == "read-write"
    [(store, call)] = sts.calls
    assert (store.endpoint_url, store.region, store.access_key_id) == \
        ("https://s3.example", "eu-west-1", ACCESS)
    assert call["RoleArn"] == "arn:aws:iam::1:role/team-a"
    assert json.loads(call["Policy"]) == session_policy("team-a-old", "p", "team-a", "box")
    assert SECRET not in json.dumps(out)


def test_sts_refused_is_a_failure_unless_static_is_allowed() -> None:
    with pytest.raises(storevend.VendFailed, match=r"NotImplemented.*sts-or-static") as info:
        _vendor("sts", FakeSts(refuse=True)).credentials(
            "n", "team-a", "box", write=False, reads=(), location=OWN, secret=CREDS)
    assert SECRET not in str(info.value) and ACCESS not in str(info.value)
    out = _vendor("sts-or-static", FakeSts(refuse=True)).credentials(
        "n", "team-a", "box", write=False, reads=(), location=OWN, secret=CREDS)
    assert (out["mode"], out["accessKeyId"], out["secretAccessKey"], out["sessionToken"]) \
        == ("static", ACCESS, SECRET, "")
    assert out["durationSeconds"] == storevend.STATIC_RECHECK_SECONDS


def test_static_never_calls_sts() -> None:
    sts = FakeSts()
    out = _vendor("static", sts).credentials("n", "team-a", "box", write=True, reads=(),
                                             location=OWN, secret=CREDS)
    assert out["mode"] == "static" and sts.calls == []


# -- the Secret, within bounds -----------------------------------------------------------


def test_the_secret_is_parsed_within_bounds_and_never_shown() -> None:
    with pytest.raises(StorageError, match="at most 4096"):
        parse_credentials({"data": {"AWS_ACCESS_KEY_ID": "A" * 5000,
                                    "AWS_SECRET_ACCESS_KEY": b64("s")}}, "ns/s")
    with pytest.raises(StorageError, match="has no data"):
        parse_credentials({"data": ["x"]}, "ns/s")
    with pytest.raises(StorageError, match="roleArn is not an IAM role ARN"):
        parse_credentials(secret(AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b",
                                 roleArn="not an arn"), "ns/s")
    creds = parse_credentials(secret(AWS_ACCESS_KEY_ID="a", AWS_SECRET_ACCESS_KEY="b",
                                     roleArn="arn:aws:iam::1:role/r"), "ns/s")
    assert creds.role_arn == "arn:aws:iam::1:role/r" and "b" not in repr(creds)


def test_a_hostile_spec_is_refused_within_bounds() -> None:
    base = {"metadata": {"name": "box", "namespace": "team-a"}}
    for storage, message in (({"bucket": "b" * 2000}, "bucket is longer"),
                             ({"bucket": "b", "endpoint": "http://" + "e" * 2000},
                              "longer than"),
                             ({"bucket": "b", "secretRef": {"name": "../x"}},
                              "is not a Secret's name"),
                             ({"bucket": "b", "secretRef": "x"}, None)):
        obj = {**base, "spec": {"checkpoint": {"storage": storage}}}
        if message is None:  # a secretRef that is not an object names no Secret
            assert sandboxstore.sandbox_storage(obj, DEFAULTS, allowed=True).secret is None
            continue
        with pytest.raises(StorageError, match=message):
            sandboxstore.sandbox_storage(obj, DEFAULTS, allowed=True)


def test_location_from_status_round_trips_and_refuses_junk() -> None:
    assert sandboxstore.location_from_status(OLD.to_status()) == OLD
    assert sandboxstore.location_from_status({"bucket": 1}) is None
    assert sandboxstore.location_from_status("x") is None


# -- settings ---------------------------------------------------------------------------


def test_the_setting_names_its_modes() -> None:
    base = {"HERMIT_KEY_SERVICE_PORT": "9443", "HERMIT_KEY_SERVICE_CALLERS": AGENT,
            "HERMIT_SEAL_KEYS_DIR": "/k", "HERMIT_KEY_SERVICE_TLS_CERT_FILE": "/c",
            "HERMIT_KEY_SERVICE_TLS_KEY_FILE": "/k2", "HERMIT_S3_BUCKET": "b"}
    assert KeyServiceSettings.from_env(base).sandbox_store_credentials == "off"
    for mode in ("sts", "sts-or-static", "static"):
        assert KeyServiceSettings.from_env(
            {**base, "HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS": mode}
        ).sandbox_store_credentials == mode
    with pytest.raises(SettingsError, match="HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS="
                                            "'always' must be one of off, sts"):
        KeyServiceSettings.from_env(
            {**base, "HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS": "always"})





def test_a_recorded_location_is_read_within_bounds() -> None:
    from hermit_common.errors import CheckpointRefused

    ckpt = {"metadata": {"name": "c", "namespace": "team-a"},
            "status": {"storage": {**OLD.to_status(), "prefix": "p" * 5000}}}
    with pytest.raises(CheckpointRefused, match=r"unreadable status\.storage"):
        sandboxstore.recorded_location(ckpt)
