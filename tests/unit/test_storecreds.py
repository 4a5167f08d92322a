"""Scoped store credentials (docs/storage.md#scoped-store-credentials): the session policy
(exact JSON; hostile names cannot widen it), the node-agent's credential cache (fake
clock), the key service's endpoint (the data keys' rule, read-only for a sandbox only
restored from), the store's per-key client choice and the settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hermit_common.errors import CheckpointFailed, SettingsError
from hermit_common.keyclient import PATH_STORE_CREDENTIALS
from hermit_common.pin import Pin
from hermit_common.settings import KeyServiceSettings, NodeSettings, StoreSettings
from hermit_common.store import CheckpointStore, check_name
from hermit_common.storecreds import (
    CredentialCache,
    Credentials,
    StoreCredentialsUnavailable,
    session_policy,
)
from hermit_operator import keyaccess, keyservice, storevend
from tests.support.keyservice_fakes import (
    AGENT,
    AUDIENCE,
    FORK,
    A,
    FakeKube,
    Reads,
    keyring_wrapper,
    sandbox_pod,
)

# -- the session policy -----------------------------------------------------------------


def test_the_policy_allows_one_sandboxs_prefix_exactly() -> None:
    assert session_policy("ckpts", "hermit", "team-a", "box") == {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "SandboxObjects", "Effect": "Allow",
             "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
             "Resource": ["arn:aws:s3:::ckpts/hermit/team-a/box/*"]},
            {"Sid": "ListSandboxPrefix", "Effect": "Allow", "Action": ["s3:ListBucket"],
             "Resource": ["arn:aws:s3:::ckpts"],
             "Condition": {"StringLike": {"s3:prefix": ["hermit/team-a/box/*"]}}},
        ]}


def test_read_only_and_a_forks_source() -> None:
    policy = session_policy("ckpts", "/a/b/", "team-a", "fork", write=False,
                            reads=("source", "fork"))
    assert policy["Statement"] == [
        {"Sid": "SandboxObjects", "Effect": "Allow", "Action": ["s3:GetObject"],
         "Resource": ["arn:aws:s3:::ckpts/a/b/team-a/fork/*"]},
        {"Sid": "SourceObjects", "Effect": "Allow", "Action": ["s3:GetObject"],
         "Resource": ["arn:aws:s3:::ckpts/a/b/team-a/source/*"]},
        {"Sid": "ListSandboxPrefix", "Effect": "Allow", "Action": ["s3:ListBucket"],
         "Resource": ["arn:aws:s3:::ckpts"],
         "Condition": {"StringLike": {"s3:prefix": ["a/b/team-a/fork/*",
                                                    "a/b/team-a/source/*"]}}},
    ]
    # No prefix: the sandbox's prefix starts at the namespace.
    assert session_policy("b", "", "ns", "x")["Statement"][0]["Resource"] == \
        ["arn:aws:s3:::b/ns/x/*"]


@pytest.mark.parametrize("name", [
    "*", "box*", "box/../other", "..", ".", "box/", "", "a?", "team-a/other", "$(aws)",
    "box\n", "x" * 254, "${aws:username}",
])
def test_hostile_names_cannot_widen_the_prefix(name: str) -> None:
    """The names are checked by the store's own check_name (one path segment of letters,
    digits, '.', '_' and '-', starting with a letter or digit), so no wildcard, no '/', no
    policy variable reaches the policy."""
    with pytest.raises(CheckpointFailed, match="is not a valid object name"):
        check_name(name, "sandbox")
    with pytest.raises(CheckpointFailed):
        session_policy("b", "hermit", "team-a", name)
    with pytest.raises(CheckpointFailed):
        session_policy("b", "hermit", name, "box")
    with pytest.raises(CheckpointFailed):
        session_policy("b", "hermit", "team-a", "box", reads=(name,))


def test_a_sandbox_name_that_prefixes_another_does_not_reach_it() -> None:
    """'box' must not reach 'box-2': every resource and list prefix ends with '/'."""
    text = json.dumps(session_policy("b", "hermit", "team-a", "box"))
    assert "hermit/team-a/box/*" in text and "hermit/team-a/box*" not in text


# -- the credential cache ---------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fetcher:
    def __init__(self, lifetime: float = 900.0) -> None:
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self.lifetime = lifetime
        self.fail: StoreCredentialsUnavailable | None = None

    def __call__(self, namespace: str, sandbox: str, reads: tuple[str, ...]) -> Credentials:
        self.calls.append((namespace, sandbox, reads))
        if self.fail is not None:
            raise self.fail
        n = len(self.calls)
        return Credentials(f"AK{n}", f"SK{n}", f"ST{n}", self.lifetime)


def _cache(fetch: Fetcher, clock: Clock, **kw: Any) -> CredentialCache:
    return CredentialCache(fetch, lambda c: ("client", c.access_key_id), clock=clock, **kw)


def test_a_client_is_reused_until_shortly_before_its_credentials_expire() -> None:
    clock, fetch = Clock(), Fetcher(lifetime=900.0)
    cache = _cache(fetch, clock)
    assert cache.client("ns", "box") == ("client", "AK1")
    clock.now += 900 - 225 - 1  # a quarter of the lifetime (225 s) before expiry: reused
    assert cache.client("ns", "box") == ("client", "AK1")
    clock.now += 1  # refreshed from then on
    assert cache.client("ns", "box") == ("client", "AK2")
    assert fetch.calls == [("ns", "box", ()), ("ns", "box", ())]
    # Another sandbox, or the same one with a read-only source, is another scope.
    assert cache.client("ns", "other") == ("client", "AK3")
    assert cache.client("ns", "box", ("src", "box", "src")) == ("client", "AK4")
    assert fetch.calls[-1] == ("ns", "box", ("src",))
    assert cache.client("ns", "box", ("src",)) == ("client", "AK4")


def test_long_credentials_are_refreshed_five_minutes_before_expiry() -> None:
    clock, fetch = Clock(), Fetcher(lifetime=3600.0)
    cache = _cache(fetch, clock)
    cache.client("ns", "box")
    clock.now += 3600 - 300 - 0.5
    assert cache.client("ns", "box") == ("client", "AK1")
    clock.now += 1
    assert cache.client("ns", "box") == ("client", "AK2")


def test_while_the_service_does_not_answer_valid_credentials_stay_in_use() -> None:
    clock, fetch = Clock(), Fetcher(lifetime=900.0)
    cache = _cache(fetch, clock)
    cache.client("ns", "box")
    clock.now += 800  # due for a refresh, still valid
    fetch.fail = StoreCredentialsUnavailable("the key service did not answer")
    assert cache.client("ns", "box") == ("client", "AK1")
    clock.now += 100  # expired now: no client
    with pytest.raises(StoreCredentialsUnavailable):
        cache.client("ns", "box")


def test_a_refusal_is_remembered_briefly() -> None:
    """A fork's chunk copies each ask for its source's read access: a refusal is asked
    for once per FAILURE_TTL_SECONDS, not once per chunk."""
    clock, fetch = Clock(), Fetcher()
    fetch.fail = StoreCredentialsUnavailable("403")
    cache = _cache(fetch, clock)
    for _ in range(5):
        with pytest.raises(StoreCredentialsUnavailable):
            cache.client("ns", "fork", ("source",))
    assert len(fetch.calls) == 1
    clock.now += 10
    fetch.fail = None
    assert cache.client("ns", "fork", ("source",)) == ("client", "AK2")


def test_the_cache_is_bounded() -> None:
    clock, fetch = Clock(), Fetcher()
    cache = _cache(fetch, clock, max_clients=2)
    for name in ("a", "b", "c"):
        cache.client("ns", name)
    cache.client("ns", "a")  # evicted: fetched again
    assert len(fetch.calls) == 4


# -- the store picks the sandbox's client per request ------------------------------------


class Recorder:
    """An S3 client that records which scope's client made which call."""

    def __init__(self, scope: tuple[str, str, tuple[str, ...]], log: list[Any]) -> None:
        self.scope, self.log = scope, log

    def __getattr__(self, name: str) -> Any:
        def call(**kw: Any) -> Any:
            self.log.append((self.scope, name, kw.get("Key") or kw.get("Prefix")))
            if name == "list_objects_v2":
                return {"Contents": []}
            return {}
        return call


def test_every_request_uses_the_client_of_the_sandbox_its_key_is_under() -> None:
    log: list[Any] = []
    store = CheckpointStore(StoreSettings(bucket="b", prefix="hermit"),
                            scoped=lambda ns, sb, reads: Recorder((ns, sb, reads), log))
    assert store.client is None and store.scoped
    store.list_chunks("team-a", "box")
    store.delete_checkpoint("team-a", "other", "c1")
    assert log == [(("team-a", "box", ()), "list_objects_v2", "hermit/team-a/box/chunks/"),
                   (("team-a", "other", ()), "delete_object",
                    "hermit/team-a/other/checkpoints/c1/manifest.json")]
    # A key under no sandbox's prefix has no client; nor is there a bucket-wide one.
    with pytest.raises(CheckpointFailed, match="under no sandbox's prefix"):
        store._s3("hermit/team-a")
    with pytest.raises(CheckpointFailed, match="under no sandbox's prefix"):
        store._s3("elsewhere/team-a/box/x")
    with pytest.raises(Exception, match="scoped store credentials"):
        store.ensure_bucket()


# -- the key service's endpoint ---------------------------------------------------------


class Vendor:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, bool, tuple[str, ...]]] = []

    def credentials(self, node: str, namespace: str, sandbox: str, *, write: bool,
                    reads: tuple[str, ...]) -> dict[str, Any]:
        self.calls.append((node, namespace, sandbox, write, reads))
        return {"accessKeyId": "AK", "secretAccessKey": "SK", "sessionToken": "ST",
                "durationSeconds": 900}


def _ask(kube: FakeKube, vendor: Vendor | None, token: str, body: dict[str, Any]
         ) -> tuple[int, dict[str, Any]]:
    svc = keyservice.KeyService(keyring_wrapper(), kube, callers=[AGENT], audience=AUDIENCE,
                                vendor=vendor)
    auth = f"Bearer {token}"
    refused = svc.admit(PATH_STORE_CREDENTIALS, auth, "10.0.0.1")
    if refused is not None:
        return refused.status, refused.body
    reply = svc.handle(PATH_STORE_CREDENTIALS, auth, json.dumps(body).encode(), "10.0.0.1")
    return reply.status, reply.body


def test_store_credentials_follow_the_data_keys_rule() -> None:
    kube, vendor = FakeKube(), Vendor()
    # node-a runs box: read-write.
    assert _ask(kube, vendor, "token-a", {"namespace": "team-a", "sandbox": "box"})[0] == 200
    # node-a is refused other (on node-b), alone or as a read-only source.
    status, body = _ask(kube, vendor, "token-a", {"namespace": "team-a", "sandbox": "other"})
    assert status == 403 and "neither runs nor restores" in body["error"]
    status, _ = _ask(kube, vendor, "token-a", {"namespace": "team-a", "sandbox": "box",
                                                "reads": ["other"]})
    assert status == 403
    # A fork on node-a restores box-3-manual (a checkpoint of box): read-only for box
    # where node-a only restores it, and box as the fork's read-only source.
    kube.pods = [sandbox_pod(FORK, "node-a", restore="box-3-manual")]
    assert _ask(kube, vendor, "token-a", {"namespace": "team-a", "sandbox": "box"})[0] == 200
    assert _ask(kube, vendor, "token-a", {"namespace": "team-a", "sandbox": "fork",
                                          "reads": ["box"]})[0] == 200
    assert vendor.calls == [("node-a", "team-a", "box", True, ()),
                            ("node-a", "team-a", "box", False, ()),
                            ("node-a", "team-a", "fork", True, ("box",))]
    # Not a node-agent: refused before the body is read.
    assert _ask(kube, vendor, "token-user", {"namespace": "team-a", "sandbox": "box"})[0] \
        == 403
    assert len(vendor.calls) == 3


@pytest.mark.parametrize("body", [
    {"namespace": "team-a", "sandbox": "*"},
    {"namespace": "team-a", "sandbox": "box/../other"},
    {"namespace": "team-a/x", "sandbox": "box"},
    {"namespace": "team-a", "sandbox": "box", "reads": ["*"]},
    {"namespace": "team-a", "sandbox": "box", "reads": "other"},
    {"namespace": "team-a", "sandbox": "box", "reads": ["a", "b", "c", "d", "e"]},
    {"sandbox": "box"},
])
def test_hostile_requests_are_400(body: dict[str, Any]) -> None:
    vendor = Vendor()
    status, _ = _ask(FakeKube(), vendor, "token-a", body)
    assert status == 400 and vendor.calls == []


def test_without_a_vendor_the_endpoint_is_404() -> None:
    assert _ask(FakeKube(), None, "token-a", {"namespace": "team-a", "sandbox": "box"})[0] \
        == 404


def test_decide_says_how_a_node_serves_a_sandbox() -> None:

    reads = Reads()
    assert keyaccess.decide("node-a", A, [sandbox_pod(A, "node-a")], sandbox_of=reads.sandbox,
                            checkpoint_of=reads.checkpoint) == keyaccess.RUNS
    assert keyaccess.decide("node-a", A, [sandbox_pod(FORK, "node-a", restore="box-3-manual")],
                            sandbox_of=reads.sandbox, checkpoint_of=reads.checkpoint) \
        == keyaccess.RESTORES


class FakeSts:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def assume_role(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(kw)
        return {"Credentials": {"AccessKeyId": "AK", "SecretAccessKey": "SK",
                                "SessionToken": "ST", "Expiration": "2030-01-01T00:00:00Z"}}


def test_the_vendor_assumes_the_role_with_the_session_policy() -> None:
    sts = FakeSts()
    vendor = storevend.StoreVendor(
        StoreSettings(bucket="ckpts", prefix="hermit"),
        KeyServiceSettings(store_credentials=True, store_role_arn="arn:aws:iam::1:role/r",
                           store_credentials_seconds=1200), make_sts=lambda _: sts)
    out = vendor.credentials("ip-10-0-0-1.ec2.internal", "team-a", "box", write=True,
                             reads=())
    assert out["durationSeconds"] == 1200 and out["access"] == "read-write"
    [call] = sts.calls
    assert call["RoleArn"] == "arn:aws:iam::1:role/r"
    assert call["RoleSessionName"] == "hermit-ip-10-0-0-1.ec2.internal"
    assert call["DurationSeconds"] == 1200
    assert json.loads(call["Policy"]) == session_policy("ckpts", "hermit", "team-a", "box")
    assert storevend.session_name("n" * 100) == "hermit-" + "n" * 57


# -- settings ---------------------------------------------------------------------------


def test_settings(tmp_path: Path) -> None:
    base = {"HERMIT_KEY_SERVICE_PORT": "9443", "HERMIT_KEY_SERVICE_CALLERS": AGENT,
            "HERMIT_SEAL_KEYS_DIR": "/k", "HERMIT_KEY_SERVICE_TLS_CERT_FILE": "/c",
            "HERMIT_KEY_SERVICE_TLS_KEY_FILE": "/k2", "HERMIT_S3_BUCKET": "b"}
    assert not KeyServiceSettings.from_env(base).store_credentials
    on = {**base, "HERMIT_KEY_SERVICE_STORE_CREDENTIALS": "true"}
    with pytest.raises(SettingsError, match="HERMIT_KEY_SERVICE_STORE_ROLE_ARN"):
        KeyServiceSettings.from_env(on)  # AWS S3 needs a role
    minio = KeyServiceSettings.from_env({**on, "HERMIT_S3_ENDPOINT": "http://minio:9000"})
    assert minio.store_credentials and minio.store_credentials_seconds == 3600
    with pytest.raises(SettingsError, match="HERMIT_KEY_SERVICE_STORE_CREDENTIALS_SECONDS"):
        KeyServiceSettings.from_env({**on, "HERMIT_S3_ENDPOINT": "http://m:9000",
                                     "HERMIT_KEY_SERVICE_STORE_CREDENTIALS_SECONDS": "60"})
    node = {"HERMIT_NODE_NAME": "n", "HERMIT_S3_BUCKET": "b",
            "HERMIT_S3_SCOPED_CREDENTIALS": "true"}
    with pytest.raises(SettingsError, match="needs the key service"):
        NodeSettings.from_env(node)
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    ks = {**node, "HERMIT_SEAL_KEY_SERVICE_URL": "https://keys:9443",
          "HERMIT_SEAL_KEY_SERVICE_CA_FILE": str(ca)}
    assert NodeSettings.from_env(ks).scoped_store_credentials
    with pytest.raises(SettingsError, match="holds no bucket-wide credential"):
        NodeSettings.from_env({**ks, "HERMIT_S3_ACCESS_KEY_ID": "a",
                               "HERMIT_S3_SECRET_ACCESS_KEY": "b"})


class Denying(Recorder):
    """AWS S3's answer to a GET of a missing key without an unconditional ListBucket:
    403, not 404."""

    def __init__(self, scope: tuple[str, str, tuple[str, ...]], log: list[Any],
                 listed: list[str]) -> None:
        super().__init__(scope, log)
        self.listed = listed

    def get_object(self, **kw: Any) -> Any:
        from botocore.exceptions import ClientError

        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "denied"}},
                          "GetObject")

    def list_objects_v2(self, **kw: Any) -> Any:
        self.log.append(("list", kw["Prefix"], kw.get("MaxKeys")))
        return {"Contents": [{"Key": k} for k in self.listed if k.startswith(kw["Prefix"])]}


def test_a_refused_get_of_a_missing_key_is_not_found_when_a_listing_says_so() -> None:
    from hermit_common.errors import HermitError
    from hermit_common.s3errors import CheckpointNotFound

    log: list[Any] = []
    listed: list[str] = []
    store = CheckpointStore(StoreSettings(bucket="b", prefix="hermit"),
                            scoped=lambda ns, sb, reads: Denying((ns, sb, reads), log, listed))
    key = "hermit/team-a/box/checkpoints/c1/manifest.json"
    with pytest.raises(CheckpointNotFound):
        store.read_manifest(Pin("team-a", "box", "c1"))
    assert log == [("list", key, 1)]
    # The object is there: the refusal is a refusal, not a missing object.
    listed.append(key)
    with pytest.raises(HermitError) as refused:
        store.read_manifest(Pin("team-a", "box", "c1"))
    assert not isinstance(refused.value, CheckpointNotFound)
    assert "AccessDenied" in str(refused.value)
