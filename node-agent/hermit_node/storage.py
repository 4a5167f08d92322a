"""Where a sandbox's checkpoints are stored: the default store, or the sandbox's own.

``spec.checkpoint.storage`` of an AgentSandbox names a bucket, and optionally a key
prefix, an endpoint, a region and a Secret (in the sandbox's namespace) holding S3
credentials; what it leaves out comes from the node-agent's default store (HERMIT_S3_*,
the chart's ``s3.*`` values). The node-agent records where each checkpoint is written in
the Checkpoint's ``status.storage``, and a restore reads the checkpoint from there,
whatever the sandbox's spec says by then; the credentials are the ones the sandbox that
owns the checkpoint names when the restore runs (its Secret, or the node-agent's own).
docs/storage.md tells the whole story.

The pure part decides: ``sandbox_storage`` (a sandbox's spec and the defaults -> where
its next checkpoint goes), ``recorded_location`` and ``restore_storage`` (where an
existing checkpoint is read, with which Secret), ``parse_credentials`` (a Secret ->
credentials) and ``client_key``. ``Stores`` applies it: it reads the one Secret it needs
with a single GET when a checkpoint or restore needs it (never a list or a watch), and
keeps a few S3 clients, keyed by endpoint, region and a hash of the credentials.
Credentials are never logged nor put in a message.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlparse

from hermit_common import api, protocol
from hermit_common.chunkcache import ChunkCache
from hermit_common.errors import CheckpointRefused, HermitError
from hermit_common.protocol import KubeObject
from hermit_common.seal import Sealing
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore, make_s3_client
from hermit_node.kube import KubeForbidden

# S3 clients kept at once (one per endpoint, region and set of credentials); the least
# recently used goes first, so rotated credentials do not pile up.
MAX_CLIENTS = 32
SPEC_PATH = "spec.checkpoint.storage"


class StorageError(HermitError):
    """A sandbox's storage cannot be used as it is configured: its Secret is missing or
    incomplete, the node-agent may not read it, per-sandbox storage is off, or it would
    send the node-agent's own credentials to another endpoint. Someone can fix it, so a
    restore that fails this way is tried again."""


@dataclass(frozen=True)
class Location:
    """Where checkpoints are written: ``s3://<bucket>/<prefix>/<namespace>/<sandbox>/``."""

    bucket: str
    prefix: str
    region: str
    endpoint: str | None = None  # None: AWS S3

    @classmethod
    def of(cls, settings: StoreSettings) -> Location:
        return cls(bucket=settings.bucket, prefix=settings.prefix.strip("/"),
                   region=settings.region, endpoint=settings.endpoint_url)

    def to_status(self) -> dict[str, str]:
        """The Checkpoint's ``status.storage``."""
        out = {"bucket": self.bucket, "prefix": self.prefix, "region": self.region}
        if self.endpoint is not None:
            out["endpoint"] = self.endpoint
        return out

    def describe(self) -> str:
        path = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        return f"s3://{path} at {self.endpoint or 'AWS S3'}"


@dataclass(frozen=True)
class SandboxStorage:
    """Where a sandbox's next checkpoint goes, and with which credentials."""

    location: Location
    secret: str | None  # a Secret in the sandbox's namespace; None: the node-agent's own


@dataclass(frozen=True)
class Credentials:
    """S3 credentials from a sandbox's Secret (kept out of repr and messages)."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    def fingerprint(self) -> str:
        """A hash that tells two sets of credentials apart (a cache key, never logged)."""
        raw = "\0".join((self.access_key_id, self.secret_access_key, self.session_token or ""))
        return hashlib.sha256(raw.encode()).hexdigest()


# -- pure: what a sandbox asks for, what a checkpoint recorded ------------------------

def _spec_storage(sandbox: Mapping[str, Any]) -> Mapping[str, Any] | None:
    checkpoint = (sandbox.get("spec") or {}).get("checkpoint") or {}
    storage = checkpoint.get("storage")
    return storage if isinstance(storage, Mapping) and storage else None


def _sandbox_name(sandbox: Mapping[str, Any]) -> str:
    meta = protocol.meta(sandbox)
    return f"AgentSandbox {meta.get('namespace') or '?'}/{meta.get('name') or '?'}"


def _endpoint(value: object, where: str,
              error: type[HermitError] = StorageError) -> str:
    text = str(value).strip().rstrip("/")
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise error(f"{where}: endpoint {text!r:.200} is not an http(s) URL")
    return text


def _check_credentials_stay_home(location: Location, secret: str | None, default: Location,
                                 where: str) -> None:
    """The node-agent's own credentials are only ever sent to its own endpoint."""
    if secret is None and location.endpoint != default.endpoint:
        raise StorageError(
            f"{where}: endpoint {location.endpoint or 'AWS S3'} is not the node-agent's own "
            f"({default.endpoint or 'AWS S3'}) and no secretRef names credentials for it; "
            "the node-agent's own credentials only go to its own endpoint")


def sandbox_storage(sandbox: Mapping[str, Any], defaults: StoreSettings, *,
                    allowed: bool) -> SandboxStorage:
    """Where ``sandbox``'s next checkpoint goes: its ``spec.checkpoint.storage`` with the
    default store's prefix, endpoint and region for what it leaves out, or the default
    store. ``allowed``: per-sandbox storage is on (HERMIT_PER_SANDBOX_STORAGE)."""
    default = Location.of(defaults)
    storage = _spec_storage(sandbox)
    if storage is None:
        return SandboxStorage(default, None)
    where = f"{SPEC_PATH} of {_sandbox_name(sandbox)}"
    if not allowed:
        raise StorageError(f"{where} is set, but per-sandbox storage is off in this "
                           "installation (chart value nodeAgent.perSandboxStorage)")
    bucket = str(storage.get("bucket") or "")
    if not bucket:
        raise StorageError(f"{where} names no bucket")
    prefix = storage.get("prefix")
    endpoint = storage.get("endpoint")
    location = Location(
        bucket=bucket,
        prefix=default.prefix if prefix is None else str(prefix).strip("/"),
        region=str(storage.get("region") or default.region),
        endpoint=default.endpoint if endpoint is None else _endpoint(endpoint, where))
    secret = str((storage.get("secretRef") or {}).get("name") or "") or None
    _check_credentials_stay_home(location, secret, default, where)
    return SandboxStorage(location, secret)


def recorded_location(ckpt: Mapping[str, Any]) -> Location | None:
    """Where a checkpoint was written (its ``status.storage``); None when it records
    none (taken before locations were recorded: the default store)."""
    raw = (ckpt.get("status") or {}).get("storage")
    if raw is None:
        return None
    name = f"Checkpoint {protocol.meta(ckpt).get('namespace')}/{protocol.name_of(ckpt)}"
    if not isinstance(raw, Mapping) or not isinstance(raw.get("bucket"), str) \
            or not raw["bucket"] or not isinstance(raw.get("prefix"), str) \
            or not isinstance(raw.get("region"), str) \
            or not isinstance(raw.get("endpoint", ""), str):
        raise CheckpointRefused(f"{name} records an unreadable status.storage: {raw!r:.300}")
    endpoint = raw.get("endpoint")
    return Location(bucket=raw["bucket"], prefix=raw["prefix"], region=raw["region"],
                    endpoint=_endpoint(endpoint, name, CheckpointRefused) if endpoint else None)


def restore_storage(recorded: Location | None, owner: Mapping[str, Any] | None,
                    defaults: StoreSettings, *, allowed: bool) -> SandboxStorage:
    """Where a checkpoint is read, and with which Secret: the location it recorded (the
    default store when it recorded none) with the credentials its owning sandbox names
    now (``owner``: the AgentSandbox of its ``sandboxRef``; None when it is gone)."""
    default = Location.of(defaults)
    location = recorded or default
    if not allowed:
        if location != default:
            raise StorageError(
                f"the checkpoint was written to {location.describe()}, not to the default "
                "store, and per-sandbox storage is off in this installation (chart value "
                "nodeAgent.perSandboxStorage)")
        return SandboxStorage(location, None)
    secret = None
    if owner is not None:
        storage = _spec_storage(owner) or {}
        secret = str((storage.get("secretRef") or {}).get("name") or "") or None
    where = f"the checkpoint at {location.describe()}"
    if owner is not None:
        where += f", read with the credentials {_sandbox_name(owner)} names"
    _check_credentials_stay_home(location, secret, default, where)
    return SandboxStorage(location, secret)


def parse_credentials(secret: Mapping[str, Any], where: str) -> Credentials:
    """The S3 credentials in a Secret (``where``: its namespace/name, for messages).
    StorageError names a missing or unreadable key, never a value."""
    data = secret.get("data") or {}

    def value(key: str) -> str | None:
        raw = data.get(key)
        if raw is None:
            return None
        try:
            return base64.b64decode(str(raw), validate=True).decode("utf-8").strip() or None
        except (binascii.Error, UnicodeDecodeError):
            raise StorageError(f"Secret {where}: {key} is not base64-encoded UTF-8 "
                               "text") from None

    access = value(api.STORAGE_SECRET_ACCESS_KEY_ID)
    secret_key = value(api.STORAGE_SECRET_SECRET_ACCESS_KEY)
    missing = [k for k, v in ((api.STORAGE_SECRET_ACCESS_KEY_ID, access),
                              (api.STORAGE_SECRET_SECRET_ACCESS_KEY, secret_key)) if not v]
    if missing or access is None or secret_key is None:
        raise StorageError(
            f"Secret {where} has no {' and no '.join(missing)} (it needs "
            f"{api.STORAGE_SECRET_ACCESS_KEY_ID} and {api.STORAGE_SECRET_SECRET_ACCESS_KEY}, "
            f"and {api.STORAGE_SECRET_SESSION_TOKEN} with temporary credentials)")
    return Credentials(access, secret_key, value(api.STORAGE_SECRET_SESSION_TOKEN))


def store_settings(defaults: StoreSettings, location: Location,
                   credentials: Credentials | None) -> StoreSettings:
    """The default store's settings moved to ``location``; with ``credentials`` when a
    Secret gave them, else the node-agent's own."""
    moved = dataclasses.replace(defaults, bucket=location.bucket, prefix=location.prefix,
                                region=location.region, endpoint_url=location.endpoint)
    if credentials is None:
        return moved
    return dataclasses.replace(moved, access_key_id=credentials.access_key_id,
                               secret_access_key=credentials.secret_access_key,
                               session_token=credentials.session_token)


ClientKey = tuple[str | None, str, str]


def client_key(location: Location, credentials: Credentials | None) -> ClientKey:
    """One S3 client serves every bucket of an endpoint and region with one set of
    credentials ("default": the node-agent's own)."""
    return (location.endpoint, location.region,
            credentials.fingerprint() if credentials is not None else "default")


# -- the adapter ------------------------------------------------------------------------

class SecretReader(Protocol):
    def get_secret(self, namespace: str, name: str) -> KubeObject | None: ...


class Stores:
    """The store each checkpoint is written to or read from (a CheckpointStore per call,
    sharing cached S3 clients, all sealing with the node-agent's keys when it has them).
    Thread-safe: jobs for several sandboxes use it at once."""

    def __init__(self, defaults: StoreSettings, secrets: SecretReader, *, allowed: bool,
                 default_store: CheckpointStore | None = None, sealing: Sealing | None = None,
                 make_client: Callable[[StoreSettings], Any] = make_s3_client,
                 max_clients: int = MAX_CLIENTS, cache: ChunkCache | None = None,
                 scoped: bool = False) -> None:
        self._defaults = defaults
        # Scoped store credentials (docs/storage.md#scoped-store-credentials): the node-agent
        # has no credentials of its own, only per-sandbox ones for the default store.
        self._scoped = scoped
        self._cache = cache  # the node's chunk cache, shared by every store it makes
        self._default_location = Location.of(defaults)
        self._secrets = secrets
        self._allowed = allowed
        self._sealing = sealing
        self._default = default_store or CheckpointStore(
            defaults, client=make_client(defaults), sealing=sealing, cache=cache)
        self._make_client = make_client
        self._max_clients = max_clients
        # The default store's client serves its other buckets too (own credentials).
        self._clients: OrderedDict[ClientKey, Any] = OrderedDict(
            [(client_key(self._default_location, None), self._default.client)]
            if self._default.client is not None else [])
        self._lock = threading.Lock()

    @property
    def default(self) -> CheckpointStore:
        return self._default

    def for_sandbox(self, sandbox: KubeObject) -> tuple[CheckpointStore, Location]:
        """The store ``sandbox``'s next checkpoint goes to, and where that is."""
        wanted = sandbox_storage(sandbox, self._defaults, allowed=self._allowed)
        namespace = str(protocol.meta(sandbox).get("namespace") or "")
        return self._store(wanted, namespace), wanted.location

    def for_checkpoint(self, ckpt: KubeObject, owner: KubeObject | None) -> CheckpointStore:
        """The store to read checkpoint ``ckpt`` from (``owner``: its sandbox, or None)."""
        wanted = restore_storage(recorded_location(ckpt), owner, self._defaults,
                                 allowed=self._allowed)
        return self._store(wanted, str(protocol.meta(ckpt).get("namespace") or ""))

    def _store(self, wanted: SandboxStorage, namespace: str) -> CheckpointStore:
        if wanted.secret is None and wanted.location == self._default_location:
            return self._default
        if wanted.secret is None and self._scoped:
            raise StorageError(
                f"{wanted.location.describe()} is not the default store, and this node-agent "
                "has no credentials of its own (scoped store credentials, chart value "
                "s3.scopedCredentials): name a secretRef in spec.checkpoint.storage")
        credentials = (self._credentials(namespace, wanted.secret)
                       if wanted.secret is not None else None)
        settings = store_settings(self._defaults, wanted.location, credentials)
        return CheckpointStore(settings, sealing=self._sealing,
                               client=self._client(client_key(wanted.location, credentials),
                                                   settings), cache=self._cache)

    def _credentials(self, namespace: str, name: str) -> Credentials:
        """One GET of the Secret; KubeTransient (retry later) passes through."""
        try:
            secret = self._secrets.get_secret(namespace, name)
        except KubeForbidden as exc:
            raise StorageError(
                f"the node-agent may not read Secret {namespace}/{name} ({exc.detail}); the "
                "chart grants it with nodeAgent.perSandboxStorage, in the namespaces listed "
                f"in nodeAgent.perSandboxStorageNamespaces (is {namespace} one?)") from None
        if secret is None:
            raise StorageError(f"Secret {namespace}/{name}, named by {SPEC_PATH}.secretRef, "
                               "does not exist")
        return parse_credentials(secret, f"{namespace}/{name}")

    def _client(self, key: ClientKey, settings: StoreSettings) -> Any:
        with self._lock:
            client = self._clients.get(key)
            if client is not None:
                self._clients.move_to_end(key)
                return client
        client = self._make_client(settings)  # outside the lock: it may take a moment
        with self._lock:
            self._clients[key] = client
            self._clients.move_to_end(key)
            while len(self._clients) > self._max_clients:
                self._clients.popitem(last=False)
        return client
