"""``RemoteKeyWrapper``: a ``seal.KeyWrapper`` that asks the operator's key service
(hermit_operator.keyservice; docs/security.md#the-key-service) instead of holding the
key-encryption keys.

Every request carries the node-agent's projected service-account token (audience
``hermit.dev/keys``, bound to its pod and so to its node), read from its file at each
call (the kubelet rotates it). The service answers only for sandboxes that node serves.

Answers, by HTTP status:

- 200: done;
- 422: the key service's wrapper refused (an unknown key id, a data key that does not
  open for that context): ``CheckpointRefused``, as the local wrapper raises it;
- 401, 403: the caller or the sandbox was refused: ``KeyAccessDenied`` (not a
  ``CheckpointRefused``: the store must not take it for an unusable key and make a new
  one, and a restore refused this way may be retried);
- anything else, or no answer: ``KeyServiceUnavailable`` after a few attempts.

Unwrapped data keys are kept in memory for ``DEK_TTL_SECONDS`` per (context, wrapped
key), and the current key id for ``CURRENT_TTL_SECONDS``: a checkpoint or restore asks
the service once or twice, not per chunk. A manifest is signed under its data key
(seal.SEALED_FORMAT 3), so once a node holds a sandbox's data key it checkpoints that
sandbox with the service down (an operator restart during a notice): the key is kept
for hours, and an unreachable service leaves the last known current key id in use. Key
bytes and tokens never reach a log.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import requests

from hermit_common.errors import CheckpointRefused, HermitError, Retryable
from hermit_common.protocol import one_line
from hermit_common.seal import KEY_BYTES, Wrapped, b64, unb64
from hermit_common.settings import KEY_SERVICE_AUDIENCE
from hermit_common.storecreds import Credentials, StoreCredentialsUnavailable
from hermit_common.turns import NamedHost

log = logging.getLogger(__name__)

# The service's paths (POST, JSON bodies, base64 for bytes).
PATH_CURRENT: Final = "/v1/keys/current"  # {} -> {"keyId"}
PATH_WRAP: Final = "/v1/keys/wrap"  # {"context", "dek"} -> {"keyId", "blob"}
PATH_UNWRAP: Final = "/v1/keys/unwrap"  # {"context", "keyId", "blob"} -> {"dek"}
PATH_SIGN: Final = "/v1/keys/sign"  # {"keyId", "data"} -> {"signature"}
PATH_VERIFY: Final = "/v1/keys/verify"  # {"keyId", "data", "signature"} -> {"valid"}
# {"namespace", "sandbox", "reads": [sandbox, ...]} -> {"accessKeyId", "secretAccessKey",
# "sessionToken", "durationSeconds", "expiration"} (docs/storage.md#scoped-store-credentials)
PATH_STORE_CREDENTIALS: Final = "/v1/store/credentials"
PATHS: Final = (PATH_CURRENT, PATH_WRAP, PATH_UNWRAP, PATH_SIGN, PATH_VERIFY,
                PATH_STORE_CREDENTIALS)

# A node that ran a sandbox has seen its memory; keeping its key for a day exposes nothing
# more, and keeps checkpoints independent of the key service's availability.
DEK_TTL_SECONDS: Final = 24 * 3600.0
CURRENT_TTL_SECONDS: Final = 30.0
MAX_DEKS_CACHED: Final = 1024
ATTEMPTS: Final = 4
CONNECT_TIMEOUT_SECONDS: Final = 5.0
READ_TIMEOUT_SECONDS: Final = 30.0
REFUSED: Final = 422  # the wrapper refused: CheckpointRefused


class KeyAccessDenied(HermitError):
    """The key service refused this node-agent or this sandbox (401, 403)."""


class KeyServiceUnavailable(Retryable):
    """The key service did not answer, or answered with an error (retry later)."""


class RemoteKeyWrapper:
    """A ``KeyWrapper`` over the key service at ``url`` (https), trusting ``ca_file``
    (and verifying its certificate for ``server_name`` when given)."""

    def __init__(self, url: str, *, ca_file: str, token_file: str,
                 server_name: str | None = None, clock: Any = time.monotonic,
                 backoff_seconds: float = 0.5) -> None:
        self._url, self._ca_file, self._token_file = url.rstrip("/"), ca_file, token_file
        self._clock, self._backoff = clock, backoff_seconds
        self._http = requests.Session()
        if server_name:  # the URL names an address: verify the certificate for this name
            self._http.mount("https://", NamedHost(server_name))
        self._lock = threading.Lock()
        self._deks: OrderedDict[tuple[bytes, str, bytes], tuple[float, bytes]] = OrderedDict()
        self._current: tuple[float, str] | None = None
        self.requests = 0  # sent (a count for tests and logs)

    def __repr__(self) -> str:
        return f"RemoteKeyWrapper({self._url!r})"

    # -- KeyWrapper ---------------------------------------------------------------------

    def current_key_id(self) -> str:
        now = self._clock()
        with self._lock:
            if self._current is not None and self._current[0] > now:
                return self._current[1]
        try:
            key_id = self._str(self._post(PATH_CURRENT, {}), "keyId")
        except KeyServiceUnavailable as exc:
            with self._lock:
                known = self._current
            if known is None:
                raise
            # A rotation is picked up once the service answers again; until then the
            # sandbox's data key stays wrapped under the key it has (still valid).
            log.warning("the key service did not answer (%s): key id %r stays current",
                        exc, known[1])
            return known[1]
        with self._lock:
            self._current = (now + CURRENT_TTL_SECONDS, key_id)
        return key_id

    def wrap(self, dek: bytes, context: bytes) -> Wrapped:
        out = self._post(PATH_WRAP, {"context": b64(context), "dek": b64(dek)})
        wrapped = Wrapped(self._str(out, "keyId"), self._bytes(out, "blob"))
        self._remember(context, wrapped, dek)
        return wrapped

    def unwrap(self, wrapped: Wrapped, context: bytes) -> bytes:
        key = (context, wrapped.key_id, wrapped.blob)
        now = self._clock()
        with self._lock:
            hit = self._deks.get(key)
            if hit is not None and hit[0] > now:
                self._deks.move_to_end(key)
                return hit[1]
        out = self._post(PATH_UNWRAP, {"context": b64(context), "keyId": wrapped.key_id,
                                       "blob": b64(wrapped.blob)})
        dek = self._bytes(out, "dek")
        if len(dek) != KEY_BYTES:
            raise KeyServiceUnavailable(f"the key service at {self._url} answered a data key "
                                        f"of {len(dek)} bytes")
        self._remember(context, wrapped, dek)
        return dek

    def sign(self, key_id: str, data: bytes) -> bytes:
        return self._bytes(self._post(PATH_SIGN, {"keyId": key_id, "data": b64(data)}),
                           "signature")

    def verify(self, key_id: str, data: bytes, signature: bytes) -> bool:
        out = self._post(PATH_VERIFY, {"keyId": key_id, "data": b64(data),
                                       "signature": b64(signature)})
        return out.get("valid") is True

    # -- scoped store credentials (storecreds.CredentialCache's fetch) -------------------

    def store_credentials(self, namespace: str, sandbox: str, reads: tuple[str, ...] = (),
                          *, storage: Mapping[str, str] | None = None,
                          location: Mapping[str, str] | None = None) -> Credentials:
        """Temporary S3 credentials for ``sandbox``'s prefix (and read-only for ``reads``);
        StoreCredentialsUnavailable when the service refuses or does not answer.

        With ``storage`` (``{"storage": "spec"}``, or ``{"storage": "checkpoint",
        "checkpoint": name}``), for the sandbox's own store (spec.checkpoint.storage with a
        secretRef, docs/storage.md#per-sandbox-store-credentials): the operator reads the
        Secret, and its answer must name ``location`` (the node-agent's own reading of the
        spec or of the Checkpoint), or the credentials are not used. Such credentials may be
        the Secret's own (``"mode": "static"``), which need no session token."""
        body: dict[str, Any] = {"namespace": namespace, "sandbox": sandbox,
                                "reads": list(reads)}
        if storage is not None:
            body.update(storage)
        try:
            out = self._post(PATH_STORE_CREDENTIALS, body)
            duration = out.get("durationSeconds")
            if not isinstance(duration, int | float) or duration <= 0:
                raise KeyServiceUnavailable(f"the key service at {self._url} answered no "
                                            "durationSeconds")
            if location is not None and out.get("location") != dict(location):
                raise KeyServiceUnavailable(
                    f"the key service at {self._url} answered credentials for another "
                    f"store ({one_line(str(out.get('location')), 300)}) than the one this "
                    f"node-agent reads ({dict(location)}): do the operator and the "
                    "node-agent have the same default store (s3.*)?")
            static = storage is not None and out.get("mode") == "static"
            token = out.get("sessionToken") if static else self._str(out, "sessionToken")
            if not isinstance(token, str | None):
                raise KeyServiceUnavailable(f"the key service at {self._url} answered no "
                                            "sessionToken")
            return Credentials(self._str(out, "accessKeyId"), self._str(out, "secretAccessKey"),
                               token or "", float(duration))
        except (KeyAccessDenied, KeyServiceUnavailable, CheckpointRefused) as exc:
            raise StoreCredentialsUnavailable(
                f"no store credentials for {namespace}/{sandbox}: {exc}") from None

    # -- the rest -----------------------------------------------------------------------

    def _remember(self, context: bytes, wrapped: Wrapped, dek: bytes) -> None:
        with self._lock:
            self._deks[(context, wrapped.key_id, wrapped.blob)] = \
                (self._clock() + DEK_TTL_SECONDS, dek)
            while len(self._deks) > MAX_DEKS_CACHED:
                self._deks.popitem(last=False)

    def _token(self) -> str:
        try:
            return Path(self._token_file).read_text().strip()
        except OSError as exc:
            raise KeyAccessDenied(
                f"cannot read the key service token {self._token_file}: {exc.strerror} (mount "
                f"a projected service-account token with audience {KEY_SERVICE_AUDIENCE} "
                "there: HERMIT_SEAL_KEY_SERVICE_TOKEN_FILE)") from None

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self._url + path
        data = json.dumps(body).encode()
        problem = ""
        for attempt in range(1, ATTEMPTS + 1):
            if attempt > 1:
                time.sleep(self._backoff * 2 ** (attempt - 2))
            self.requests += 1
            try:
                resp = self._http.post(
                    url, data=data, verify=self._ca_file,
                    timeout=(CONNECT_TIMEOUT_SECONDS, READ_TIMEOUT_SECONDS),
                    headers={"Authorization": f"Bearer {self._token()}",
                             "Content-Type": "application/json"})
            except requests.RequestException as exc:
                problem = f"cannot reach it: {type(exc).__name__}"
                continue
            message = _message(resp)
            if resp.status_code == 200:
                try:
                    out = resp.json()
                except ValueError:
                    out = None
                if isinstance(out, dict):
                    return out
                problem = "it answered no JSON object"
            elif resp.status_code == REFUSED:
                raise CheckpointRefused(message)
            elif resp.status_code in (401, 403):
                raise KeyAccessDenied(f"the key service refused: {message}")
            elif resp.status_code == 429 or resp.status_code >= 500:
                problem = f"HTTP {resp.status_code}: {message}"
            else:
                raise KeyServiceUnavailable(f"the key service at {url} answered HTTP "
                                            f"{resp.status_code}: {message}")
        raise KeyServiceUnavailable(f"the key service at {url} failed {ATTEMPTS} times; "
                                    f"last: {problem}")

    def _str(self, out: dict[str, Any], name: str) -> str:
        value = out.get(name)
        if not isinstance(value, str) or not value:
            raise KeyServiceUnavailable(f"the key service at {self._url} answered no {name}")
        return value

    def _bytes(self, out: dict[str, Any], name: str) -> bytes:
        try:
            return unb64(out.get(name), name, "the field")
        except CheckpointRefused as exc:
            raise KeyServiceUnavailable(f"the key service at {self._url}: {exc}") from None


def _message(resp: requests.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        body = None
    text = str(body.get("error")) if isinstance(body, dict) and body.get("error") else \
        resp.reason or ""
    return one_line(text, 300, mark="")
