"""The key service: node-agents wrap, unwrap, sign and verify here, each only for the
sandboxes its node serves (docs/security.md#the-key-service).

Only the operator mounts the sealing Secret (the key-encryption keys); the node-agents
hold a ``hermit_common.keyclient.RemoteKeyWrapper`` instead. ``KeyService.handle``
serves ``POST /v1/keys/{current,wrap,unwrap,sign,verify}`` (keyclient's paths) with a
bearer token, through ``hermit_common.hardhttp`` (TLS, connection caps, one deadline
per request, bounded heads and bodies):

0. ``admit``, before the body is read: the source address is rate-limited (429), the
   token is reviewed (a TokenReview, cached briefly by a hash of the token) and must be
   a node-agent's, bound to its node (keyaccess.caller_of: 401, 403); the node is
   rate-limited (429);
1. the body is parsed within bounds (400), and the sandbox the request is for is read
   from the data key's context (wrap, unwrap) or from the signed manifest's context
   (sign, verify), bounded, before anything is decided (400);
2. the node must serve that sandbox (keyaccess.decide, from the node's sandbox pods
   read now; an allowance is cached for ``ALLOW_TTL_SECONDS``): 403 otherwise, logged,
   and counted in ``hermit_operator_key_requests_total{op,result="denied"}``;
3. the keyring (the sealing Secret, or a cloud KMS: kms.py, keyvault.py, cloudkms.py)
   answers; what it refuses (an unknown key id, a data key that does not open for this
   context) is 422, which the client raises as ``CheckpointRefused``; a KMS that does
   not answer is 503.

``POST /v1/store/credentials`` (``{"namespace", "sandbox", "reads": [...]}``) answers,
under the same rule, temporary S3 credentials for that sandbox's prefix only
(storevend.py; docs/storage.md#scoped-store-credentials): read-write when the node runs
the sandbox, read-only when it only restores from it; each of ``reads`` (a fork's source,
whose chunks its first checkpoint copies) must be served too and is read-only. 404 when
the operator vends none (HERMIT_KEY_SERVICE_STORE_CREDENTIALS), 503 when STS fails.

The same request with ``"storage": "spec"`` (the store of the sandbox's
spec.checkpoint.storage) or ``"storage": "checkpoint", "checkpoint": <name>`` (the store
that Checkpoint of the sandbox recorded; read-only) is for a sandbox's own store with a
secretRef (docs/storage.md#per-sandbox-store-credentials): under the same rule, the
operator reads the Secret the sandbox names (one GET; the node-agent may not read
Secrets) and answers credentials for that store's bucket and the sandbox's prefix
(storevend.SandboxStoreVendor), with the store's ``location`` so the node-agent checks it
agrees. 404 when HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS is off; 400 when the
sandbox's storage cannot be used as it is (the message names why, never a value).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Final, Protocol

from hermit_common import bounded, hardhttp, turnlimits
from hermit_common.errors import CheckpointRefused, HermitError, SettingsError
from hermit_common.hardhttp import HardenedHTTPServer, Reply, TlsFiles
from hermit_common.keyclient import (
    PATH_CURRENT,
    PATH_SIGN,
    PATH_STORE_CREDENTIALS,
    PATH_UNWRAP,
    PATH_VERIFY,
    PATH_WRAP,
    PATHS,
    REFUSED,
)
from hermit_common.kubeapi import KubeApiError, KubeForbidden
from hermit_common.protocol import KubeObject, one_line
from hermit_common.sandboxstore import (
    SandboxStorage,
    StorageError,
    parse_credentials,
    recorded_location,
    restore_storage,
    sandbox_storage,
)
from hermit_common.seal import (
    KEY_BYTES,
    Bound,
    KeyringWrapper,
    KeyWrapper,
    Wrapped,
    b64,
    bound_of_context,
    bound_of_signed,
    unb64,
)
from hermit_common.settings import KeyServiceSettings, StoreSettings
from hermit_common.store import check_name
from hermit_common.storecreds import MAX_READS
from hermit_operator import keyaccess, metrics
from hermit_operator.storevend import SandboxStoreVendor, StoreVendor, VendFailed

log = logging.getLogger("hermit.operator.keys")

# A sealed manifest's signed bytes, in base64, plus the rest of the request. A manifest
# larger than about 3/4 of this cannot be signed or verified through the key service.
MAX_BODY: Final = 48 * 1024 * 1024
ALLOW_TTL_SECONDS: Final = 10.0  # a node's allowance for a sandbox is reused this long
MAX_ALLOWANCES: Final = 4096
# A node seals all its sandboxes at a notice: a few requests each, at once.
SOURCE_RATE: Final = 100.0
SOURCE_BURST: Final = 400
NODE_RATE: Final = 50.0
NODE_BURST: Final = 200
USAGE: Final = ("POST /v1/keys/{current,wrap,unwrap,sign,verify} or /v1/store/credentials "
                "(docs/security.md)")

# The metric's op and result label values (small, fixed sets).
OPS: Final = {p: p.rsplit("/", 1)[1] for p in PATHS}
OK: Final = "ok"
REFUSED_RESULT: Final = "refused"  # the keyring refused (422)
DENIED: Final = "denied"  # the caller or the sandbox (401, 403)
INVALID: Final = "invalid"  # 400, 404
LIMITED: Final = "limited"  # 429
ERROR: Final = "error"  # the Kubernetes API did not answer (503)
RESULTS: Final = (OK, REFUSED_RESULT, DENIED, INVALID, LIMITED, ERROR)


class KeyKube(Protocol):
    """The API calls the key service makes (``hermit_operator.kube.Kube``)."""

    def review_token(self, token: str, audiences: list[str]) -> KubeObject: ...
    def list_node_sandbox_pods(self, node: str, namespace: str) -> list[KubeObject]: ...
    def get_checkpoint(self, namespace: str, name: str) -> KubeObject | None: ...
    def get_sandbox(self, namespace: str, name: str) -> KubeObject | None: ...
    def get_secret(self, namespace: str, name: str) -> KubeObject | None: ...


# What a request for a sandbox's own store names: the store of its spec, or the one a
# Checkpoint recorded.
STORAGE_SPEC: Final = "spec"
STORAGE_CHECKPOINT: Final = "checkpoint"


class _Refused(Exception):
    def __init__(self, status: int, result: str, message: str) -> None:
        super().__init__(message)
        self.status, self.result = status, result


def _bearer(header: str | None) -> str:
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise _Refused(401, DENIED, "an Authorization: Bearer <service-account token> "
                                    "header is needed")
    return token.strip()


class Vendor(Protocol):
    """storevend.StoreVendor: temporary credentials for one sandbox's prefix."""

    def credentials(self, node: str, namespace: str, sandbox: str, *, write: bool,
                    reads: tuple[str, ...]) -> dict[str, Any]: ...


class KeyService:
    def __init__(self, wrapper: KeyWrapper, kube: KeyKube, *, callers: Iterable[str],
                 audience: str, clock: turnlimits.Clock = time.monotonic,
                 vendor: Vendor | None = None,
                 sandbox_vendor: SandboxStoreVendor | None = None) -> None:
        self._wrapper, self._kube, self._vendor = wrapper, kube, vendor
        self._sandbox_vendor = sandbox_vendor
        self._callers, self._audience, self._clock = frozenset(callers), audience, clock
        self.sources = turnlimits.RateLimiter(SOURCE_RATE, SOURCE_BURST, clock=clock)
        self.nodes = turnlimits.RateLimiter(NODE_RATE, NODE_BURST, clock=clock)
        self.reviews: turnlimits.ReviewCache[KubeObject] = turnlimits.ReviewCache(
            lambda r: bool(r.get("authenticated")), clock=clock)
        self._allowed: dict[tuple[str, Bound], tuple[float, str]] = {}
        self._lock = threading.Lock()

    # -- the two steps hardhttp calls ---------------------------------------------------

    def admit(self, path: str, authorization: str | None, source: str) -> Reply | None:
        """Step 0, before the body is read: None to go on, else the refusal."""
        try:
            self._admit(path, authorization, source)
            return None
        except _Refused as exc:
            return self._refusal(path, exc)

    def handle(self, path: str, authorization: str | None, body: bytes,
               source: str) -> Reply:
        """Answers one request that ``admit`` let in (the caller is authenticated again,
        from the review cache, so ``handle`` alone lets no one in); never raises."""
        op = OPS.get(path.split("?", 1)[0], "")
        try:
            caller = self._caller(path, authorization, source)
            out = self._serve(path.split("?", 1)[0], caller, body)
        except _Refused as exc:
            return self._refusal(path, exc)
        except CheckpointRefused as exc:
            metrics.record_key_request(op, REFUSED_RESULT)
            return Reply(REFUSED, {"error": one_line(str(exc))})
        except KubeApiError as exc:
            log.warning("key service: %s", exc)
            metrics.record_key_request(op, ERROR)
            return Reply(503, {"error": f"the Kubernetes API did not answer: {exc}"})
        except VendFailed as exc:
            log.warning("key service: %s", exc)
            metrics.record_key_request(op, ERROR)
            return Reply(503, {"error": one_line(str(exc))})
        except HermitError as exc:  # the keyring cannot be read (a Secret being rotated)
            log.warning("key service: %s", exc)
            metrics.record_key_request(op, ERROR)
            return Reply(503, {"error": one_line(str(exc))})
        metrics.record_key_request(op, OK)
        return Reply(200, out)

    # -- the rest -----------------------------------------------------------------------

    def _refusal(self, path: str, exc: _Refused) -> Reply:
        metrics.record_key_request(OPS.get(path.split("?", 1)[0], ""), exc.result)
        body: dict[str, Any] = {"error": str(exc)}
        if exc.status == 429:
            body["retryAfterSeconds"] = 1
        return Reply(exc.status, body)

    def _admit(self, path: str, authorization: str | None, source: str) -> keyaccess.Caller:
        """The caller, rate-limited by source address and by node."""
        if not self.sources.allow(source):
            raise _Refused(429, LIMITED, f"too many requests from {source}")
        caller = self._caller(path, authorization, source)
        if not self.nodes.allow(caller.node):
            raise _Refused(429, LIMITED, f"too many requests from node {caller.node}")
        return caller

    def _caller(self, path: str, authorization: str | None, source: str) -> keyaccess.Caller:
        if path.split("?", 1)[0] not in OPS:
            raise _Refused(404, INVALID, f"not found: {USAGE}")
        token = _bearer(authorization)
        key = turnlimits.token_key(token, (self._audience,))
        try:
            review = self.reviews.get_or_compute(
                key, lambda: dict(self._kube.review_token(token, [self._audience])))
        except KubeApiError as exc:
            log.warning("key service: %s", exc)
            raise _Refused(503, ERROR, f"the Kubernetes API did not answer: {exc}") from None
        try:
            caller = keyaccess.caller_of(review, self._callers, self._audience)
        except keyaccess.Denied as exc:
            log.warning("key service: refused a caller from %s: %s", source, exc)
            raise _Refused(exc.status, DENIED, str(exc)) from None
        return caller

    def _serve(self, path: str, caller: keyaccess.Caller, body: bytes) -> dict[str, Any]:
        request = _parse(body)
        if path == PATH_STORE_CREDENTIALS:
            return self._store_credentials(caller, request)
        if path == PATH_CURRENT:
            return {"keyId": self._wrapper.current_key_id()}
        if path in (PATH_WRAP, PATH_UNWRAP):
            context = _field(request, "context")
            self._authorize(caller, _bound(bound_of_context, context), path)
            if path == PATH_WRAP:
                dek = _field(request, "dek")
                if len(dek) != KEY_BYTES:
                    raise _Refused(400, INVALID, f'"dek" must be {KEY_BYTES} bytes')
                wrapped = self._wrapper.wrap(dek, context)
                return {"keyId": wrapped.key_id, "blob": b64(wrapped.blob)}
            dek = self._wrapper.unwrap(
                Wrapped(_key_id(request), _field(request, "blob")), context)
            return {"dek": b64(dek)}
        data = _field(request, "data")
        self._authorize(caller, _bound(bound_of_signed, data), path)
        if path == PATH_SIGN:
            return {"signature": b64(self._wrapper.sign(_key_id(request), data))}
        assert path == PATH_VERIFY
        return {"valid": self._wrapper.verify(_key_id(request), data,
                                              _field(request, "signature"))}

    def _store_credentials(self, caller: keyaccess.Caller,
                           request: dict[str, Any]) -> dict[str, Any]:
        """Credentials for one sandbox's prefix: the same rule as its data key (read-only
        when the node only restores from it), and each of ``reads`` served too."""
        kind = request.get("storage")
        if kind is not None and kind not in (STORAGE_SPEC, STORAGE_CHECKPOINT):
            raise _Refused(400, INVALID, f'"storage" must be "{STORAGE_SPEC}" or '
                                         f'"{STORAGE_CHECKPOINT}"')
        if kind is None and self._vendor is None:
            raise _Refused(404, INVALID, "this key service vends no store credentials "
                                         "(HERMIT_KEY_SERVICE_STORE_CREDENTIALS)")
        if kind is not None and self._sandbox_vendor is None:
            raise _Refused(404, INVALID, "this key service vends no credentials for "
                                         "per-sandbox stores "
                                         "(HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS)")
        namespace = _name(request.get("namespace"), "namespace")
        sandbox = _name(request.get("sandbox"), "sandbox")
        checkpoint = _name(request.get("checkpoint"), "checkpoint") \
            if kind == STORAGE_CHECKPOINT else None
        raw = request.get("reads") or []
        if not isinstance(raw, list) or len(raw) > MAX_READS:
            raise _Refused(400, INVALID, f'"reads" must list at most {MAX_READS} sandboxes')
        reads = tuple(sorted({_name(r, "sandbox") for r in raw} - {sandbox}))
        path = PATH_STORE_CREDENTIALS
        bound = self._bound_now(caller, namespace, sandbox)
        access = self._authorize(caller, bound, path)
        for name in reads:
            self._authorize(caller, self._bound_now(caller, namespace, name), path)
        write = access == keyaccess.RUNS
        if kind is None:
            assert self._vendor is not None
            return self._vendor.credentials(caller.node, namespace, sandbox, write=write,
                                            reads=reads)
        assert self._sandbox_vendor is not None
        # A restore only reads: the store a Checkpoint recorded is never written through.
        wanted = self._sandbox_store(self._sandbox_vendor, bound, checkpoint)
        if checkpoint is not None:
            write, reads = False, ()
        secret = self._secret(namespace, wanted)
        return self._sandbox_vendor.credentials(
            caller.node, namespace, sandbox, write=write, reads=reads,
            location=wanted.location, secret=secret)

    def _sandbox_store(self, vendor: SandboxStoreVendor, bound: Bound,
                       checkpoint: str | None) -> SandboxStorage:
        """The store and Secret of the sandbox's spec, or of one of its Checkpoints (the
        location it recorded, the Secret the sandbox names now: the node-agent's rule),
        as the sandbox the caller was authorized for (its uid) has them."""
        namespace, sandbox = bound.namespace, bound.sandbox
        obj = self._kube.get_sandbox(namespace, sandbox)
        if obj is None or str((obj.get("metadata") or {}).get("uid") or "") \
                != bound.sandbox_uid:
            raise _Refused(403, DENIED, f"sandbox {namespace}/{sandbox} is gone or was "
                                        "replaced")
        try:
            if checkpoint is None:
                wanted = sandbox_storage(obj, vendor.defaults, allowed=True)
            else:
                ckpt = self._kube.get_checkpoint(namespace, checkpoint)
                if keyaccess.source_bound(ckpt, obj) is None:
                    raise _Refused(403, DENIED, f"Checkpoint {namespace}/{checkpoint} is not "
                                                f"one of sandbox {sandbox}'s")
                assert ckpt is not None
                wanted = restore_storage(recorded_location(ckpt), obj, vendor.defaults,
                                         allowed=True)
        except (StorageError, CheckpointRefused) as exc:
            raise _Refused(400, INVALID, one_line(str(exc))) from None
        if wanted.secret is None:
            raise _Refused(400, INVALID, f"the store of {namespace}/{sandbox} "
                                         f"({wanted.location.describe()}) names no "
                                         "secretRef: its credentials are not the key "
                                         "service's to give")
        return wanted

    def _secret(self, namespace: str, wanted: SandboxStorage) -> Any:
        """The Secret's credentials: one GET by the operator, parsed within bounds; its
        values never reach a log or a message."""
        assert wanted.secret is not None
        where = f"{namespace}/{wanted.secret}"
        try:
            secret = self._kube.get_secret(namespace, wanted.secret)
        except KubeForbidden:
            log.warning("key service: may not read Secret %s", where)
            raise _Refused(400, INVALID, f"the operator may not read Secret {where}: it "
                                         "reads Secrets only in the namespaces of chart "
                                         "value nodeAgent.perSandboxStorageNamespaces (is "
                                         f"{namespace} one?)") from None
        if secret is None:
            raise _Refused(400, INVALID, f"Secret {where}, named by "
                                         "spec.checkpoint.storage.secretRef, does not exist")
        try:
            return parse_credentials(secret, where)
        except StorageError as exc:
            raise _Refused(400, INVALID, one_line(str(exc))) from None

    def _bound_now(self, caller: keyaccess.Caller, namespace: str, name: str) -> Bound:
        """The sandbox named so as it exists now (its prefix is named by its name; the
        rule binds its uid)."""
        sandbox = self._kube.get_sandbox(namespace, name)
        uid = str(((sandbox or {}).get("metadata") or {}).get("uid") or "")
        if not uid:
            log.warning("key service: store credentials refused for node %s: no sandbox "
                        "%s/%s", caller.node, namespace, name)
            raise _Refused(403, DENIED, f"node {caller.node} neither runs nor restores "
                                        f"sandbox {namespace}/{name}: there is none")
        return Bound(namespace, name, uid)

    def _authorize(self, caller: keyaccess.Caller, want: Bound, path: str) -> str:
        key = (caller.node, want)
        now = self._clock()
        with self._lock:
            allowed = self._allowed.get(key)
            if allowed is not None and allowed[0] > now:
                return allowed[1]
        try:
            pods = self._kube.list_node_sandbox_pods(caller.node, want.namespace)
            access = keyaccess.decide(caller.node, want, pods,
                                      sandbox_of=self._kube.get_sandbox,
                                      checkpoint_of=self._kube.get_checkpoint)
        except keyaccess.Denied as exc:
            log.warning("key service: %s refused for node %s: %s", OPS[path], caller.node,
                        exc)
            raise _Refused(exc.status, DENIED, str(exc)) from None
        with self._lock:
            if len(self._allowed) >= MAX_ALLOWANCES:
                self._allowed = {k: t for k, t in self._allowed.items() if t[0] > now}
                if len(self._allowed) >= MAX_ALLOWANCES:
                    self._allowed.clear()
            self._allowed[key] = (now + ALLOW_TTL_SECONDS, access)
        return access


def _parse(body: bytes) -> dict[str, Any]:
    try:
        data = bounded.load_json(body or b"{}", limit=MAX_BODY, what="the request body",
                                 max_containers=2)
    except CheckpointRefused as exc:
        raise _Refused(400, INVALID, str(exc)) from None
    if not isinstance(data, dict):
        raise _Refused(400, INVALID, "the request body must be a JSON object")
    return data


def _field(request: dict[str, Any], name: str) -> bytes:
    try:
        return unb64(request.get(name), f'"{name}"', "the field")
    except CheckpointRefused as exc:
        raise _Refused(400, INVALID, str(exc)) from None


def _name(value: object, what: str) -> str:
    try:
        return check_name(value, what)  # type: ignore[arg-type]
    except HermitError as exc:
        raise _Refused(400, INVALID, str(exc)) from None


def _key_id(request: dict[str, Any]) -> str:
    key_id = request.get("keyId")
    if not isinstance(key_id, str) or not key_id or len(key_id) > 63:
        raise _Refused(400, INVALID, '"keyId" must name a sealing key')
    return key_id


def _bound(parse: Any, data: bytes) -> Bound:
    try:
        bound: Bound = parse(data)
    except CheckpointRefused as exc:
        raise _Refused(400, INVALID, f"cannot tell which sandbox the request is for: "
                                     f"{one_line(str(exc))}") from None
    return bound


def serve(settings: KeyServiceSettings, kube: KeyKube, *, host: str = "0.0.0.0",
          clock: turnlimits.Clock = time.monotonic,
          store: StoreSettings | None = None) -> HardenedHTTPServer:
    """Starts the key service of ``settings`` (port > 0) in daemon threads. SettingsError
    naming the setting when the keys or the TLS files cannot be used; OSError when the
    port cannot be bound."""
    assert settings.port and (settings.keys_dir or settings.kms_key_id) \
        and settings.tls_cert_file and settings.tls_key_file
    wrapper: KeyWrapper
    if settings.kms_key_id:
        from hermit_operator import kms  # boto3's KMS client only when it is used

        wrapper = kms.wrapper_from(settings)
    else:
        assert settings.keys_dir
        try:
            wrapper = KeyringWrapper.from_dir(Path(settings.keys_dir))
        except SettingsError as exc:
            raise SettingsError(f"HERMIT_SEAL_KEYS_DIR={settings.keys_dir}: {exc}") from None
    tls = TlsFiles(settings.tls_cert_file, settings.tls_key_file)
    try:
        tls.context()
    except (OSError, ValueError) as exc:
        raise SettingsError(
            f"HERMIT_KEY_SERVICE_TLS_CERT_FILE={settings.tls_cert_file} and "
            f"HERMIT_KEY_SERVICE_TLS_KEY_FILE={settings.tls_key_file}: not a usable "
            f"certificate and key: {exc}") from None
    vendor = None
    if settings.store_credentials:
        if store is None:
            raise SettingsError("HERMIT_KEY_SERVICE_STORE_CREDENTIALS=true needs the store "
                                "(HERMIT_S3_BUCKET)")
        vendor = StoreVendor(store, settings)
    sandbox_vendor = None
    if settings.sandbox_store_credentials != "off":
        if store is None:
            raise SettingsError("HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS="
                                f"{settings.sandbox_store_credentials} needs the default store "
                                "(HERMIT_S3_BUCKET): what a sandbox's storage leaves out")
        sandbox_vendor = SandboxStoreVendor(store, settings)
    service = KeyService(wrapper, kube, callers=settings.callers, audience=settings.audience,
                         clock=clock, vendor=vendor, sandbox_vendor=sandbox_vendor)
    return hardhttp.serve(settings.port, service.handle, admit=service.admit,
                          max_body=MAX_BODY, usage=USAGE, name="keys", host=host, tls=tls)

