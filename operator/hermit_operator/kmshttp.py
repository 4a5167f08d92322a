"""REST plumbing shared by the Azure Key Vault and Google Cloud KMS key wrappers
(keyvault.py, cloudkms.py; docs/security.md#a-cloud-kms): bounded JSON answers, the
line between "refused" and "did not answer", and the access tokens they send.

An answer is read at most MAX_ANSWER_BYTES into memory and parsed only then: an
oversized or garbled answer (a proxy's error page, a stream that does not end) is
``KmsUnavailable`` and never a refusal, because the store replaces a data key it is
refused, and a KMS that did not say "no" must not cost a sandbox its checkpoints.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import requests

from hermit_common.errors import CheckpointRefused, Retryable, SettingsError

log = logging.getLogger("hermit.operator.keys")


class _HasCurrentKey(Protocol):
    def current_key_id(self) -> str: ...


W = TypeVar("W", bound=_HasCurrentKey)

# A wrap, unwrap, sign or verify answer is well under 4 KiB (an RSA-4096 block is 683
# characters of base64); a token answer under 16 KiB.
MAX_ANSWER_BYTES: Final = 64 * 1024
MAX_TOKEN_BYTES: Final = 16 * 1024
# Within the key service's 10 s per request: the node-agent tries again itself.
TIMEOUT: Final = (2.0, 3.0)
# A token is used until this many seconds before it expires.
TOKEN_MARGIN_SECONDS: Final = 120.0


class KmsUnavailable(Retryable):
    """KMS did not answer, throttled, or failed on its side: try again later."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]


def read_bounded(response: requests.Response, limit: int = MAX_ANSWER_BYTES) -> bytes:
    """The body of ``response``, refused (KmsUnavailable) past ``limit`` bytes."""
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise KmsUnavailable(f"answered {declared} bytes (at most {limit})")
    out = bytearray()
    for chunk in response.iter_content(8192):
        out += chunk
        if len(out) > limit:
            raise KmsUnavailable(f"answered more than {limit} bytes")
    return bytes(out)


def parse_answer(status: int, raw: bytes) -> Answer:
    """A JSON object answer. A 200 that is anything else is KmsUnavailable (no KMS says
    "no" that way); an error's body that is not a JSON object is left empty, and its
    status tells what it was (a proxy's 502 page, a metadata server's plain 404)."""
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        if status == 200:
            raise KmsUnavailable(f"answered HTTP 200 with {len(raw)} bytes that are not a "
                                 "JSON object")
        body = {}
    return Answer(status, body)


def call(session: requests.Session, method: str, url: str, *,
         headers: Mapping[str, str] | None = None, json_body: Any = None,
         form: Mapping[str, str] | None = None, limit: int = MAX_ANSWER_BYTES) -> Answer:
    """One bounded request; a network failure is KmsUnavailable."""
    try:
        with session.request(method, url, headers=dict(headers or {}), json=json_body,
                             data=form, timeout=TIMEOUT, stream=True,
                             allow_redirects=False) as response:
            return parse_answer(response.status_code, read_bounded(response, limit))
    except requests.RequestException as exc:
        raise KmsUnavailable(f"did not answer: {type(exc).__name__}") from None


def bearer_call(session: requests.Session, token: Callable[[], str], url: str,
                body: Any, what: str) -> Answer:
    """One bounded JSON request with ``token()`` as its bearer (POST with ``body``, GET
    without); no answer is KmsUnavailable naming ``what``. A 401 makes a token that can
    ``forget`` fetch a fresh one next time."""
    headers = {"Authorization": f"Bearer {token()}", "Accept": "application/json"}
    try:
        answer = call(session, "POST" if body is not None else "GET", url, headers=headers,
                      json_body=body)
    except KmsUnavailable as exc:
        raise KmsUnavailable(f"{what}: {exc}") from None
    if answer.status == 401:
        forget = getattr(token, "forget", None)
        if forget is not None:
            forget()
    return answer


def unavailable_status(status: int) -> bool:
    """Throttled, or failed on its side: another try may succeed."""
    return status in (408, 429) or status >= 500


def b64decode_field(body: Mapping[str, Any], field: str, *, urlsafe: bool,
                    limit: int) -> bytes:
    """``body[field]`` as base64 of at most ``limit`` bytes; KmsUnavailable otherwise
    (a 200 answer without its value is no refusal either)."""
    value = body.get(field)
    if not isinstance(value, str) or not value or len(value) > 4 * (limit // 3 + 2):
        raise KmsUnavailable(f"answered without a usable {field!r}")
    try:
        padded = value + "=" * (-len(value) % 4)
        raw = (base64.urlsafe_b64decode(padded) if urlsafe
               else base64.b64decode(padded, validate=True))
    except (binascii.Error, ValueError):
        raise KmsUnavailable(f"answered a {field!r} that is not base64") from None
    if not raw or len(raw) > limit:
        raise KmsUnavailable(f"answered a {field!r} of {len(raw)} bytes (1 to {limit})")
    return raw


def b64url(data: bytes) -> str:
    """Key Vault's base64url without padding."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def read_token_file(path: str, setting: str) -> str:
    """A bearer token (or a federated identity token) kept in a file that is rotated
    underneath us: read at each use, bounded, and refused naming ``setting``."""
    try:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as exc:
        raise CheckpointRefused(f"{setting}={path}: cannot read the token: "
                                f"{exc.strerror or exc}") from None
    token = raw.decode("ascii", "replace").strip()
    if len(raw) > MAX_TOKEN_BYTES or not token or any(c.isspace() or not c.isprintable()
                                                      for c in token):
        raise CheckpointRefused(f"{setting}={path}: not one token of at most "
                                f"{MAX_TOKEN_BYTES} bytes")
    return token


class CachedToken:
    """An access token from ``fetch`` (returns the token and its lifetime in seconds),
    kept until TOKEN_MARGIN_SECONDS before it expires; one fetch at a time."""

    def __init__(self, fetch: Callable[[], tuple[str, float]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch, self._clock = fetch, clock
        self._token: str | None = None
        self._until = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> str:
        with self._lock:
            now = self._clock()
            if self._token is None or now >= self._until:
                token, lifetime = self._fetch()
                self._token, self._until = token, now + max(0.0, lifetime -
                                                            TOKEN_MARGIN_SECONDS)
            return self._token

    def forget(self) -> None:
        """After the service said 401: the next call fetches a new token."""
        with self._lock:
            self._token = None


def token_answer(answer: Answer, source: str) -> tuple[str, float]:
    """An OAuth 2.0 token answer (``access_token``, ``expires_in``) of ``source``."""
    token, lifetime = answer.body.get("access_token"), answer.body.get("expires_in", 300)
    if isinstance(lifetime, str) and lifetime.isdigit():
        lifetime = int(lifetime)  # Entra's v1 endpoints answer a string
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_BYTES or \
            not isinstance(lifetime, int | float) or isinstance(lifetime, bool):
        raise KmsUnavailable(f"{source} answered no usable access_token/expires_in")
    return token, float(min(max(lifetime, 0), 24 * 3600))


def session() -> requests.Session:
    """A session for one wrapper: HTTPS_PROXY and REQUESTS_CA_BUNDLE apply as they do to
    boto3; every request sets its own Authorization header."""
    return requests.Session()


def probed_at_start(wrapper: W, key_id: str) -> W:
    """``wrapper`` once its KMS has been asked for the current key: SettingsError naming
    HERMIT_SEAL_KMS_KEY_ID when the KMS refuses it; a KMS that does not answer yet is
    asked again at the first request (the key service starts anyway)."""
    try:
        wrapper.current_key_id()
    except CheckpointRefused as exc:
        raise SettingsError(f"HERMIT_SEAL_KMS_KEY_ID={key_id}: {exc}") from None
    except KmsUnavailable as exc:
        log.warning("key service: %s (asked again at the first request)", exc)
    return wrapper
