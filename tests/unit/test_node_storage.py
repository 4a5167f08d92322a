"""Per-sandbox storage (hermit_node.control.storage): where a checkpoint goes and where it is read,
the Secret parse, the errors, the client cache; and the agent using it."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from hermit_common import api
from hermit_common.errors import CheckpointRefused
from hermit_common.settings import StoreSettings
from hermit_common.storecreds import Credentials as VendedCredentials
from hermit_common.storecreds import StoreCredentialsUnavailable
from hermit_node.control import planner, storage
from hermit_node.control.storage import Credentials, Location, StorageError, Stores
from tests.support.crds import schema_errors
from tests.support.node_agent import (
    DIGEST,
    NOW,
    FakeEngine,
    FakeKube,
    FakeStores,
    as_operator_wrote,
    ckpt,
    make_agent,
    pod,
    with_status,
)

DEFAULTS = StoreSettings(bucket="shared", prefix="hermit", endpoint_url="http://minio:9000",
                         region="us-east-1", access_key_id="AGENT", secret_access_key="agent-s",
                         transfer_concurrency=6, chunk_size_bytes=1 << 20)
DEFAULT = Location(bucket="shared", prefix="hermit", region="us-east-1",
                   endpoint="http://minio:9000")
ACCESS, SECRET_KEY, TOKEN = "AKIATEAMA", "team-a-very-secret", "session-token-xyz"


def sandbox(name: str = "box", namespace: str = "agents",
            store: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"checkpoint": {"onPreemption": True, "retain": 3}}
    if store is not None:
        spec["checkpoint"]["storage"] = store
    return {"apiVersion": api.API_VERSION, "kind": api.SANDBOX_KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-of-{name}"},
            "spec": spec}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def secret(**data: str) -> dict[str, Any]:
    return {"metadata": {"name": "s3", "namespace": "agents"},
            "data": {k: b64(v) for k, v in data.items()}}


GOOD = secret(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET_KEY)


# -- where the next checkpoint goes -------------------------------------------------------

def test_a_sandbox_without_storage_uses_the_default_store() -> None:
    wanted = storage.sandbox_storage(sandbox(), DEFAULTS, allowed=True)
    assert wanted == storage.SandboxStorage(DEFAULT, None)
    # Off or on, a sandbox that asks nothing gets the default.
    assert storage.sandbox_storage(sandbox(), DEFAULTS, allowed=False).location == DEFAULT


def test_unset_fields_come_from_the_default_store() -> None:
    wanted = storage.sandbox_storage(sandbox(store={"bucket": "team-a"}), DEFAULTS,
                                     allowed=True)
    assert wanted.location == Location(bucket="team-a", prefix="hermit", region="us-east-1",
                                       endpoint="http://minio:9000")
    assert wanted.secret is None  # the node-agent's own credentials, on its own endpoint


def test_every_field_of_the_spec_is_used() -> None:
    wanted = storage.sandbox_storage(sandbox(store={
        "bucket": "team-a", "prefix": "org/team-a", "endpoint": "https://s3.example.com/",
        "region": "eu-west-1", "secretRef": {"name": "team-a-s3"}}), DEFAULTS, allowed=True)
    assert wanted.location == Location(bucket="team-a", prefix="org/team-a",
                                       region="eu-west-1", endpoint="https://s3.example.com")
    assert wanted.secret == "team-a-s3"


def test_per_sandbox_storage_off_refuses_a_sandbox_that_asks_for_it() -> None:
    with pytest.raises(StorageError, match=r"nodeAgent\.perSandboxStorage") as err:
        storage.sandbox_storage(sandbox(store={"bucket": "team-a"}), DEFAULTS, allowed=False)
    assert "AgentSandbox agents/box" in str(err.value)


def test_own_credentials_never_go_to_another_endpoint() -> None:
    # The CRD already needs a secretRef with an endpoint; the code holds it too.
    with pytest.raises(StorageError, match="only go to its own endpoint"):
        storage.sandbox_storage(sandbox(store={"bucket": "b-1", "endpoint": "https://evil.io"}),
                                DEFAULTS, allowed=True)
    same = storage.sandbox_storage(sandbox(store={"bucket": "b-1",
                                                  "endpoint": "http://minio:9000"}),
                                   DEFAULTS, allowed=True)
    assert same.location.endpoint == "http://minio:9000" and same.secret is None


def test_an_endpoint_that_is_not_a_url_is_refused() -> None:
    with pytest.raises(StorageError, match="not an http"):
        storage.sandbox_storage(sandbox(store={"bucket": "b-1", "endpoint": "minio:9000",
                                               "secretRef": {"name": "s"}}),
                                DEFAULTS, allowed=True)


# -- where an existing checkpoint is read ------------------------------------------------

def test_the_location_round_trips_through_the_checkpoint_status() -> None:
    where = Location(bucket="team-a", prefix="", region="eu-west-1",
                     endpoint="https://s3.example.com")
    status = planner.status_dumping("node-a", NOW, "box-1-preempt", where.to_status())
    assert status["storage"] == {"bucket": "team-a", "prefix": "", "region": "eu-west-1",
                                 "endpoint": "https://s3.example.com"}
    assert storage.recorded_location(ckpt("c1", status=status)) == where
    aws = Location(bucket="team-a", prefix="p", region="eu-west-1")
    assert "endpoint" not in aws.to_status()
    assert storage.recorded_location(ckpt("c1", status={"storage": aws.to_status()})) == aws
    assert schema_errors(with_status(status)) == []


def test_a_checkpoint_without_a_recorded_location_is_in_the_default_store() -> None:
    assert storage.recorded_location(ckpt("c1", status={"phase": "Completed"})) is None
    wanted = storage.restore_storage(None, sandbox(), DEFAULTS, allowed=True)
    assert wanted == storage.SandboxStorage(DEFAULT, None)


@pytest.mark.parametrize("raw", ["s3://x", {"prefix": "p", "region": "r"},
                                 {"bucket": "b", "region": "r"},
                                 {"bucket": "b", "prefix": "p", "region": "r", "endpoint": 5},
                                 {"bucket": "b", "prefix": "p", "region": "r",
                                  "endpoint": "ftp://x"}])
def test_an_unreadable_recorded_location_refuses_the_checkpoint(raw: object) -> None:
    with pytest.raises(CheckpointRefused, match=r"status\.storage|not an http"):
        storage.recorded_location(ckpt("c1", status={"storage": raw}))


def test_a_checkpoint_is_read_where_it_was_written_whatever_the_spec_says_now() -> None:
    written = Location(bucket="team-a-old", prefix="v1", region="us-east-1",
                       endpoint="http://minio:9000")
    owner_now = sandbox(store={"bucket": "team-a-new", "prefix": "v2",
                               "secretRef": {"name": "team-a-s3"}})
    wanted = storage.restore_storage(written, owner_now, DEFAULTS, allowed=True)
    # The recorded location, with the credentials the owning sandbox names now.
    assert wanted == storage.SandboxStorage(written, "team-a-s3")


def test_a_checkpoint_of_a_sandbox_that_went_back_to_the_default_uses_own_credentials() -> None:
    written = Location(bucket="team-a", prefix="hermit", region="us-east-1",
                       endpoint="http://minio:9000")
    assert storage.restore_storage(written, sandbox(), DEFAULTS, allowed=True) == \
        storage.SandboxStorage(written, None)
    assert storage.restore_storage(written, None, DEFAULTS, allowed=True) == \
        storage.SandboxStorage(written, None)


def test_a_recorded_foreign_endpoint_needs_the_owners_secret() -> None:
    foreign = Location(bucket="team-a", prefix="p", region="r", endpoint="https://s3.other.io")
    with pytest.raises(StorageError, match="only go to its own endpoint"):
        storage.restore_storage(foreign, sandbox(), DEFAULTS, allowed=True)
    assert storage.restore_storage(foreign, sandbox(store={
        "bucket": "x-1", "endpoint": "https://s3.other.io", "secretRef": {"name": "s"}}),
        DEFAULTS, allowed=True).secret == "s"


def test_per_sandbox_storage_off_reads_the_default_store_only() -> None:
    owner = sandbox(store={"bucket": "team-a", "secretRef": {"name": "s"}})
    # A checkpoint in the default store: read with the node-agent's own credentials.
    assert storage.restore_storage(DEFAULT, owner, DEFAULTS, allowed=False) == \
        storage.SandboxStorage(DEFAULT, None)
    elsewhere = Location(bucket="team-a", prefix="hermit", region="us-east-1",
                         endpoint="http://minio:9000")
    with pytest.raises(StorageError, match=r"s3://team-a/hermit at http://minio:9000.*"
                                           r"nodeAgent\.perSandboxStorage"):
        storage.restore_storage(elsewhere, owner, DEFAULTS, allowed=False)


# -- the Secret ---------------------------------------------------------------------------

def test_a_secret_gives_credentials_and_an_optional_session_token() -> None:
    assert storage.parse_credentials(GOOD, "agents/s3") == Credentials(ACCESS, SECRET_KEY)
    with_token = secret(AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
                        AWS_SESSION_TOKEN=TOKEN)
    assert storage.parse_credentials(with_token, "agents/s3").session_token == TOKEN


@pytest.mark.parametrize(("data", "missing"), [
    ({}, "has no AWS_ACCESS_KEY_ID and no AWS_SECRET_ACCESS_KEY"),
    ({"AWS_ACCESS_KEY_ID": ACCESS}, "has no AWS_SECRET_ACCESS_KEY ("),
    ({"AWS_SECRET_ACCESS_KEY": SECRET_KEY}, "has no AWS_ACCESS_KEY_ID ("),
    ({"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": "  "}, "has no AWS_SECRET_ACCESS_KEY"),
    ({"aws_access_key_id": ACCESS, "aws_secret_access_key": SECRET_KEY},
     "has no AWS_ACCESS_KEY_ID and no AWS_SECRET_ACCESS_KEY"),
])
def test_missing_keys_are_named_and_no_value_is_shown(data: dict[str, str],
                                                      missing: str) -> None:
    with pytest.raises(StorageError) as err:
        storage.parse_credentials(secret(**data), "agents/s3")
    message = str(err.value)
    assert f"Secret agents/s3 {missing}" in message
    assert ACCESS not in message and SECRET_KEY not in message


def test_a_value_that_is_not_base64_is_named_not_shown() -> None:
    bad = {"data": {"AWS_ACCESS_KEY_ID": b64(ACCESS), "AWS_SECRET_ACCESS_KEY": "%%" + SECRET_KEY}}
    with pytest.raises(StorageError, match="AWS_SECRET_ACCESS_KEY is not base64") as err:
        storage.parse_credentials(bad, "agents/s3")
    assert SECRET_KEY not in str(err.value)


def test_credentials_stay_out_of_repr_and_settings_logs() -> None:
    creds = Credentials(ACCESS, SECRET_KEY, TOKEN)
    assert ACCESS not in repr(creds) and SECRET_KEY not in repr(creds) and TOKEN not in repr(creds)
    from hermit_common.settings import redacted

    moved = storage.store_settings(DEFAULTS, DEFAULT, creds)
    shown = repr(redacted(moved))
    assert SECRET_KEY not in shown and TOKEN not in shown and ACCESS not in shown


def test_store_settings_move_the_location_and_keep_the_tuning() -> None:
    team = Location(bucket="team-a", prefix="t", region="eu-west-1", endpoint="https://s3.x.io")
    own = storage.store_settings(DEFAULTS, team, None)
    assert (own.bucket, own.prefix, own.region, own.endpoint_url) == (
        "team-a", "t", "eu-west-1", "https://s3.x.io")
    assert (own.access_key_id, own.secret_access_key) == ("AGENT", "agent-s")
    assert (own.transfer_concurrency, own.chunk_size_bytes) == (6, 1 << 20)
    given = storage.store_settings(DEFAULTS, team, Credentials(ACCESS, SECRET_KEY, TOKEN))
    assert (given.access_key_id, given.secret_access_key, given.session_token) == (
        ACCESS, SECRET_KEY, TOKEN)


def test_client_keys_tell_credentials_apart_without_holding_them() -> None:
    a = storage.client_key(DEFAULT, Credentials(ACCESS, SECRET_KEY))
    assert a == storage.client_key(DEFAULT, Credentials(ACCESS, SECRET_KEY))
    assert a != storage.client_key(DEFAULT, Credentials(ACCESS, "rotated"))
    assert a != storage.client_key(DEFAULT, Credentials(ACCESS, SECRET_KEY, TOKEN))
    assert storage.client_key(DEFAULT, None) == ("http://minio:9000", "us-east-1", "default")
    assert SECRET_KEY not in repr(a) and ACCESS not in repr(a)


# -- Stores: credentials from the key service, never a Secret read ------------------------

class Vendor:
    """The key service as far as Stores uses it (keyclient.RemoteKeyWrapper): credentials
    for one sandbox's prefix of its own store; the Secret stays with the operator."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, tuple[str, ...], dict[str, str],
                               dict[str, str]]] = []
        self.error: Exception | None = None
        self.access = ACCESS

    def store_credentials(self, namespace: str, sandbox: str, reads: tuple[str, ...] = (),
                          *, storage: Any = None, location: Any = None) -> VendedCredentials:
        self.asked.append((namespace, sandbox, reads, dict(storage), dict(location)))
        if self.error is not None:
            raise self.error
        return VendedCredentials(self.access, SECRET_KEY, TOKEN, 900.0)


class Clients:
    def __init__(self) -> None:
        self.made: list[StoreSettings] = []

    def __call__(self, settings: StoreSettings) -> object:
        self.made.append(settings)
        return object()


def stores(vendor: Vendor | None, *, allowed: bool = True, max_clients: int = 32
           ) -> tuple[Stores, Clients]:
    clients = Clients()
    return Stores(DEFAULTS, vendor, allowed=allowed, make_client=clients,
                  max_clients=max_clients), clients


def reach(store: Any, sandbox_name: str = "box", namespace: str = "agents") -> Any:
    """What an S3 call on ``sandbox_name``'s prefix of ``store`` uses (and so fetches)."""
    return store._objects.s3(f"{store.settings.prefix}/{namespace}/{sandbox_name}/chunks/x")


def team_sandbox(bucket: str = "team-a", secret_name: str | None = "team-a-s3"
                 ) -> dict[str, Any]:
    spec: dict[str, Any] = {"bucket": bucket}
    if secret_name:
        spec["secretRef"] = {"name": secret_name}
    return sandbox(store=spec)


def test_the_default_location_with_own_credentials_is_the_default_store() -> None:
    vendor = Vendor()
    s, clients = stores(vendor)
    store, where = s.for_sandbox(sandbox())
    assert store is s.default and where == DEFAULT
    assert s.for_checkpoint(ckpt("c1", status={"storage": DEFAULT.to_status()}), sandbox()) \
        is s.default
    assert vendor.asked == [] and len(clients.made) == 1  # the default store's client


def test_a_sandbox_store_asks_the_key_service_for_that_sandbox_and_store() -> None:
    vendor = Vendor()
    s, clients = stores(vendor)
    store, where = s.for_sandbox(team_sandbox())
    assert where.bucket == "team-a" and store.settings.bucket == "team-a" and store.scoped
    assert vendor.asked == []  # nothing until S3 is called
    client = reach(store)
    assert reach(store) is client  # cached until shortly before it expires
    assert vendor.asked == [("agents", "box", (), {"storage": "spec"}, where.to_status())]
    made = clients.made[-1]
    assert (made.bucket, made.access_key_id, made.session_token) == ("team-a", ACCESS, TOKEN)
    # A restore asks for the store its Checkpoint recorded, by the Checkpoint's name.
    old = Location(bucket="team-a-old", prefix="hermit", region="us-east-1",
                   endpoint="http://minio:9000")
    reading = s.for_checkpoint(ckpt("c1", status={"storage": old.to_status()}),
                               team_sandbox())
    reach(reading)
    assert vendor.asked[-1] == ("agents", "box", (),
                                {"storage": "checkpoint", "checkpoint": "c1"},
                                old.to_status())


def test_static_credentials_without_a_session_token_make_a_client_without_one() -> None:
    vendor = Vendor()
    s, clients = stores(vendor)
    store, _ = s.for_sandbox(team_sandbox())
    vendor.store_credentials = lambda *a, **k: VendedCredentials(  # type: ignore[method-assign]
        ACCESS, SECRET_KEY, "", 900.0)
    reach(store)
    assert clients.made[-1].session_token is None


def test_without_a_secret_another_bucket_uses_own_credentials() -> None:
    s, clients = stores(Vendor())
    store, _ = s.for_sandbox(team_sandbox(secret_name=None))
    assert store is not s.default and store.settings.bucket == "team-a"
    assert store.settings.access_key_id == "AGENT"
    assert store.client is s.default.client and len(clients.made) == 1


def test_the_caches_of_vended_credentials_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage, "MAX_VENDED", 2)
    vendor = Vendor()
    s, _ = stores(vendor)
    for n in range(4):
        reach(s.for_sandbox(team_sandbox(bucket=f"b{n}"))[0])
    assert len(s._vended) == 2
    reach(s.for_sandbox(team_sandbox(bucket="b0"))[0])  # evicted: asked again
    assert len(vendor.asked) == 5


def test_a_refusal_of_the_key_service_is_the_stores_failure_and_names_no_secret() -> None:
    vendor = Vendor()
    vendor.error = StoreCredentialsUnavailable(
        "no store credentials for agents/box: the key service refused: node n neither runs "
        "nor restores sandbox agents/box")
    s, _ = stores(vendor)
    store, _ = s.for_sandbox(team_sandbox())
    with pytest.raises(StoreCredentialsUnavailable, match="neither runs nor restores"):
        reach(store)


def test_without_the_key_service_a_secret_cannot_be_used() -> None:
    s, _ = stores(None)
    with pytest.raises(StorageError, match=r"only the operator's key service hands out.*"
                                           r"nodeAgent\.sealing\.keyService\.enabled"):
        s.for_sandbox(team_sandbox())


def test_the_node_agent_has_no_way_to_read_a_secret() -> None:
    import inspect

    from hermit_node.control import kube

    assert not hasattr(kube.Kube, "get_secret")
    assert "get_secret" not in inspect.getsource(storage)


def test_off_never_asks_for_store_credentials() -> None:
    vendor = Vendor()
    s, _ = stores(vendor, allowed=False)
    with pytest.raises(StorageError, match="per-sandbox storage is off"):
        s.for_sandbox(team_sandbox())
    assert s.for_checkpoint(ckpt("c1"), team_sandbox()) is s.default
    assert vendor.asked == []


# -- the agent: record the location, use the store, fail clearly -----------------------------

class SandboxKube(FakeKube):
    """FakeKube whose sandboxes have a spec (get_sandbox returns them)."""

    def __init__(self, pods: list[dict[str, Any]], checkpoints: list[dict[str, Any]],
                 sandboxes: dict[str, dict[str, Any]]) -> None:
        super().__init__(pods, checkpoints)
        self.sandboxes = sandboxes

    def get_sandbox(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.sandboxes.get(name)
        return None if found is None else as_operator_wrote(found, self.pods)


def real_stores(vendor: Vendor | None) -> Stores:
    return Stores(DEFAULTS, vendor, allowed=True, make_client=Clients())


def test_a_checkpoint_records_where_it_goes_and_uses_that_store(tmp_path: Path) -> None:
    kube = SandboxKube([pod("box-1")], [ckpt("manual")], {"box": team_sandbox()})
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine, stores=real_stores(Vendor()))
    agent.reconcile_once()
    agent.shutdown()
    dumping = kube.statuses[0][1]
    assert dumping["phase"] == "Dumping"
    assert dumping["storage"] == {"bucket": "team-a", "prefix": "hermit", "region": "us-east-1",
                                  "endpoint": "http://minio:9000"}
    [store] = engine.stores
    assert store.settings.bucket == "team-a" and store.scoped  # the key service's credentials
    assert kube.checkpoints["manual"]["status"]["phase"] == "Completed"


def test_a_store_that_needs_a_secret_without_the_key_service_fails_the_checkpoint(
        tmp_path: Path) -> None:
    kube = SandboxKube([pod("box-1")], [ckpt("manual")], {"box": team_sandbox()})
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine, stores=real_stores(None))
    agent.reconcile_once()
    agent.shutdown()
    assert engine.calls == []  # nothing frozen: the sandbox runs on
    status = kube.checkpoints["manual"]["status"]
    assert status["phase"] == "Failed"
    assert status["message"].startswith(
        "checkpoint agents/manual failed, sandbox left running: s3://team-a/hermit at "
        "http://minio:9000 needs the credentials of Secret agents/team-a-s3, which only the "
        "operator's key service hands out")
    assert kube.events == [("manual", "Warning", "CheckpointFailed")]


def test_a_restore_reads_the_recorded_location_with_the_owners_secret(tmp_path: Path) -> None:
    written = Location(bucket="team-a-old", prefix="hermit", region="us-east-1",
                       endpoint="http://minio:9000")
    restoring = pod("box-2", incarnation=2, annotations={"hermit.dev/restore-from": "c1"})
    kube = SandboxKube([restoring], [ckpt("c1", status={
        "phase": "Completed", "manifestDigest": DIGEST, "storage": written.to_status()})],
        {"box": team_sandbox(bucket="team-a-new")})
    engine = FakeEngine()
    vendor = Vendor()
    agent = make_agent(tmp_path, kube, engine, stores=real_stores(vendor))
    agent.reconcile_once()
    agent.shutdown()
    [store] = engine.stores
    assert store.settings.bucket == "team-a-old" and store.scoped
    reach(store)
    assert vendor.asked == [("agents", "box", (), {"storage": "checkpoint", "checkpoint": "c1"},
                             written.to_status())]
    assert kube.annotations[-1][1]["hermit.dev/restore-phase"] == "Restored"


def test_a_fork_reads_with_the_source_sandboxs_location_and_secret(tmp_path: Path) -> None:
    written = Location(bucket="team-a", prefix="hermit", region="us-east-1",
                       endpoint="http://minio:9000")
    fork = pod("fork-1", sandbox="fork", annotations={"hermit.dev/restore-from": "box-1-x"})
    kube = SandboxKube([fork], [ckpt("box-1-x", sandbox="box", status={
        "phase": "Completed", "manifestDigest": DIGEST, "storage": written.to_status()})],
        {"box": team_sandbox(), "fork": sandbox("fork")})
    engine = FakeEngine()
    vendor = Vendor()
    agent = make_agent(tmp_path, kube, engine, stores=real_stores(vendor))
    agent.reconcile_once()
    agent.shutdown()
    [(target, _)] = engine.calls
    assert (target.sandbox, target.pin.uid) == ("box", "uid-of-box")
    [store] = engine.stores
    assert store.settings.bucket == "team-a" and store.scoped
    reach(store)  # the source's prefix, as the fork's node restores it
    assert vendor.asked == [("agents", "box", (),
                             {"storage": "checkpoint", "checkpoint": "box-1-x"},
                             written.to_status())]


def test_a_restore_whose_secret_is_unusable_fails_as_retryable(tmp_path: Path) -> None:
    retryable = "true"  # the key service can be switched on: try again later
    restoring = pod("box-2", incarnation=2, annotations={"hermit.dev/restore-from": "c1"})
    kube = SandboxKube([restoring], [ckpt("c1", status={
        "phase": "Completed", "manifestDigest": DIGEST,
        "storage": {"bucket": "team-a", "prefix": "hermit", "region": "us-east-1",
                    "endpoint": "http://minio:9000"}})], {"box": team_sandbox()})
    engine = FakeEngine()
    agent = make_agent(tmp_path, kube, engine, stores=real_stores(None))
    agent.reconcile_once()
    agent.shutdown()
    assert engine.calls == []
    last = kube.annotations[-1][1]
    assert last["hermit.dev/restore-phase"] == "Failed"
    assert last["hermit.dev/restore-retryable"] == retryable
    assert "Secret agents/team-a-s3" in str(last["hermit.dev/restore-message"])


def test_a_garbled_recorded_location_is_refused_for_good(tmp_path: Path) -> None:
    restoring = pod("box-2", incarnation=2, annotations={"hermit.dev/restore-from": "c1"})
    kube = SandboxKube([restoring], [ckpt("c1", status={
        "phase": "Completed", "manifestDigest": DIGEST, "storage": {"bucket": 7}})],
        {"box": sandbox()})
    agent = make_agent(tmp_path, kube, FakeEngine(), stores=real_stores(Vendor()))
    agent.reconcile_once()
    agent.shutdown()
    assert kube.annotations[-1][1]["hermit.dev/restore-retryable"] == "false"


def test_a_restarted_agent_looks_for_the_manifest_where_it_was_being_written(
        tmp_path: Path) -> None:
    from tests.support.node_agent import FakeManifests, FakeTrees

    where = Location(bucket="team-a", prefix="hermit", region="us-east-1").to_status()
    uploading = ckpt("box-1-preempt", reason="Preemption",
                     status={"phase": "Uploading", "nodeName": "node-a", "storage": where})
    kube = SandboxKube([pod("box-1")], [uploading], {"box": team_sandbox()})
    fake = FakeStores(FakeManifests({"box-1-preempt"}))
    from hermit_node.control.agent import NodeAgent
    from tests.support.node_agent import fake_proc

    agent = NodeAgent("node-a", kube, FakeEngine(), FakeEngine(), view=kube,  # type: ignore[arg-type]
                      stores=fake, trees=FakeTrees(), proc_root=fake_proc(tmp_path),
                      clock=lambda: NOW)
    agent.reconcile_once()
    agent.shutdown()
    # its record and its owner (as the API returns it: with the operator's status)
    assert fake.asked[0] == ("box-1-preempt", kube.get_sandbox("agents", "box"))
    assert kube.checkpoints["box-1-preempt"]["status"]["phase"] == "Completed"
    assert kube.checkpoints["box-1-preempt"]["status"]["storage"] == where


def test_with_scoped_credentials_only_the_default_store_is_reached_without_a_secret() -> None:
    """Scoped store credentials (docs/storage.md#scoped-store-credentials): the node-agent
    has no credentials of its own; a sandbox's Secret still works, another location of
    the default endpoint without one does not."""
    from hermit_common.store import CheckpointStore

    clients = Clients()
    default = CheckpointStore(DEFAULTS, scoped=lambda ns, sb, reads: object())
    s = Stores(DEFAULTS, Vendor(), allowed=True, make_client=clients, default_store=default,
               scoped=True)
    assert s.for_sandbox(sandbox())[0] is default and default.client is None
    assert s.for_checkpoint(ckpt("c1", status={"storage": DEFAULT.to_status()}), sandbox()) \
        is default
    own, _ = s.for_sandbox(team_sandbox())
    assert own.scoped and own.client is None
    reach(own)
    assert clients.made[-1].access_key_id == ACCESS
    with pytest.raises(StorageError, match="has no credentials of its own"):
        s.for_sandbox(team_sandbox(secret_name=None))
    assert len(clients.made) == 1  # from the key service's credentials; none of its own
