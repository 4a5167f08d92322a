"""Where a sandbox's checkpoints are stored: the default store, or the sandbox's own.

``spec.checkpoint.storage`` of an AgentSandbox names a bucket, and optionally a key
prefix, an endpoint, a region and a Secret (in the sandbox's namespace) holding S3
credentials; what it leaves out comes from the node-agent's default store (HERMIT_S3_*,
the chart's ``s3.*`` values). The node-agent records where each checkpoint is written in
the Checkpoint's ``status.storage``, and a restore reads the checkpoint from there,
whatever the sandbox's spec says by then; the credentials are the ones the sandbox that
owns the checkpoint names when the restore runs. docs/storage.md tells the whole story.

The pure part (hermit_common.sandboxstore, shared with the operator) decides where.
``Stores`` applies it. The node-agent never reads a Secret: for a store whose sandbox
names a ``secretRef`` it asks the operator's key service for credentials for that
sandbox's prefix of that store (docs/storage.md#per-sandbox-store-credentials), and the
key service gives them only to the node that runs or restores the sandbox. It keeps a few
S3 clients. Credentials are never logged nor put in a message.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hermit_common import protocol
from hermit_common.chunkcache import ChunkCache
from hermit_common.protocol import KubeObject
from hermit_common.sandboxstore import (
    SPEC_PATH,
    ClientKey,
    Credentials,
    Location,
    SandboxStorage,
    StorageError,
    client_key,
    parse_credentials,
    recorded_location,
    restore_storage,
    sandbox_storage,
    store_settings,
)
from hermit_common.seal import Sealing
from hermit_common.settings import StoreSettings
from hermit_common.store import CheckpointStore, make_s3_client
from hermit_common.storecreds import CredentialCache
from hermit_common.storecreds import Credentials as VendedCredentials
from hermit_node.control.planner import CheckpointView

__all__ = ["CHECKPOINT", "SPEC", "SPEC_PATH", "ClientKey", "Credentials", "Location",
           "SandboxStorage", "SandboxVendor", "StorageError", "Stores", "client_key",
           "parse_credentials", "recorded_location", "restore_storage", "sandbox_storage",
           "store_settings"]

# S3 clients kept at once (one per endpoint, region and set of credentials); the least
# recently used goes first, so rotated credentials do not pile up.
MAX_CLIENTS = 32
# Credential caches of per-sandbox stores kept at once (one per store and selector).
MAX_VENDED = 256

# What the key service is asked for: the store of the sandbox's spec (its next
# checkpoint), or the store a Checkpoint recorded (a restore reads it).
SPEC = "spec"
CHECKPOINT = "checkpoint"


class SandboxVendor(Protocol):
    """The key service's ``/v1/store/credentials`` for a per-sandbox store
    (keyclient.RemoteKeyWrapper.store_credentials)."""

    def store_credentials(self, namespace: str, sandbox: str, reads: tuple[str, ...] = (),
                          *, storage: Mapping[str, str] | None = None,
                          location: Mapping[str, str] | None = None) -> VendedCredentials: ...


class Stores:
    """The store each checkpoint is written to or read from (a CheckpointStore per call,
    sharing cached S3 clients, all sealing with the node-agent's keys when it has them).
    Thread-safe: jobs for several sandboxes use it at once."""

    def __init__(self, defaults: StoreSettings, vendor: SandboxVendor | None, *,
                 allowed: bool,
                 default_store: CheckpointStore | None = None, sealing: Sealing | None = None,
                 make_client: Callable[[StoreSettings], Any] = make_s3_client,
                 max_clients: int = MAX_CLIENTS, cache: ChunkCache | None = None,
                 scoped: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self._defaults = defaults
        # Scoped store credentials (docs/storage.md#scoped-store-credentials): the node-agent
        # has no credentials of its own, only per-sandbox ones for the default store.
        self._scoped = scoped
        self._cache = cache  # the node's chunk cache, shared by every store it makes
        self._default_location = Location.of(defaults)
        self._clock = clock  # when vended credentials are fetched again
        self._vendor = vendor  # None: no key service, so no store that needs a Secret
        self._vended: OrderedDict[tuple[Any, ...], CredentialCache] = OrderedDict()
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
        return self._store(wanted, namespace, {"storage": SPEC}), wanted.location

    def for_checkpoint(self, ckpt: KubeObject, owner: KubeObject | None) -> CheckpointStore:
        """The store to read checkpoint ``ckpt`` from (``owner``: its sandbox, or None)."""
        wanted = restore_storage(recorded_location(ckpt), owner, self._defaults,
                                 allowed=self._allowed)
        view = CheckpointView.from_object(ckpt)
        return self._store(wanted, view.namespace,
                           {"storage": CHECKPOINT, "checkpoint": view.name})

    def _store(self, wanted: SandboxStorage, namespace: str,
               selector: dict[str, str]) -> CheckpointStore:
        if wanted.secret is None and wanted.location == self._default_location:
            return self._default
        if wanted.secret is None and self._scoped:
            raise StorageError(
                f"{wanted.location.describe()} is not the default store, and this node-agent "
                "has no credentials of its own (scoped store credentials, chart value "
                "s3.scopedCredentials): name a secretRef in spec.checkpoint.storage")
        settings = store_settings(self._defaults, wanted.location, None)
        if wanted.secret is None:
            return CheckpointStore(settings, sealing=self._sealing,
                                   client=self._client(client_key(wanted.location, None),
                                                       settings), cache=self._cache)
        return CheckpointStore(settings, sealing=self._sealing, cache=self._cache,
                               scoped=self._vended_cache(wanted, namespace, selector,
                                                         settings).client)

    def _vended_cache(self, wanted: SandboxStorage, namespace: str,
                      selector: dict[str, str], settings: StoreSettings) -> CredentialCache:
        """The clients of a per-sandbox store with a Secret: credentials from the key
        service, which reads the Secret (the node-agent may not), for one sandbox's prefix
        of that store only. One cache per store, Secret and selector, so a changed spec
        asks again."""
        vendor = self._vendor
        if vendor is None:
            raise StorageError(
                f"{wanted.location.describe()} needs the credentials of Secret "
                f"{namespace}/{wanted.secret}, which only the operator's key service hands "
                "out, and this node-agent has none (chart value "
                "nodeAgent.sealing.keyService.enabled)")
        key = (namespace, wanted.location, wanted.secret, tuple(sorted(selector.items())))
        with self._lock:
            cache = self._vended.get(key)
            if cache is not None:
                self._vended.move_to_end(key)
                return cache
        expect = wanted.location.to_status()

        def fetch(ns: str, sandbox: str, reads: tuple[str, ...]) -> VendedCredentials:
            return vendor.store_credentials(ns, sandbox, reads, storage=selector,
                                            location=expect)

        def make(creds: VendedCredentials) -> Any:
            return self._make_client(dataclasses.replace(
                settings, access_key_id=creds.access_key_id,
                secret_access_key=creds.secret_access_key,
                session_token=creds.session_token or None))

        cache = CredentialCache(fetch, make, clock=self._clock)
        with self._lock:
            cache = self._vended.setdefault(key, cache)
            self._vended.move_to_end(key)
            while len(self._vended) > MAX_VENDED:
                self._vended.popitem(last=False)
        return cache

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
