"""Turning botocore exceptions into Hermit errors with one line that says what failed.

Messages name the endpoint, bucket and key, never credentials or signed URLs. Errors are
classed by what the failure means, as kubeapi.py classes the API server's:

======================== ============================================ =====================
error                    when                                         what a caller does
======================== ============================================ =====================
StoreNotFound            NoSuchKey, NotFound, 404                     the object is not
                                                                      there
StorePreconditionFailed  PreconditionFailed, 412,                     a conditional write
                         ConditionalRequestConflict                   found an object
StoreForbidden           AccessDenied, 403, bad or expired keys       credentials or policy
StoreThrottled           SlowDown                                     retry later, slower
StoreTransient           5xx, InternalError, RequestTimeout, ...;     retry later
                         network errors, timeouts
StoreUnavailable         the base class; alone for any other error
                         (NoSuchBucket, no credentials, ...)
======================== ============================================ =====================

A missing bucket stays a plain StoreUnavailable: it is the store that is missing, not an
object in it.
"""

from __future__ import annotations

import socket
from typing import Final

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from hermit_common.errors import CheckpointFailed, CheckpointRefused, HermitError, StoreUnavailable

NOT_FOUND_CODES: Final = frozenset({"NoSuchKey", "404", "NotFound"})
_THROTTLED_CODES: Final = frozenset({"SlowDown"})
_DENIED_CODES: Final = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden",
    "AllAccessDisabled", "ExpiredToken", "InvalidToken",
})
# Errors worth another try after botocore's own retries gave up.
_TRANSIENT_CODES: Final = _THROTTLED_CODES | frozenset({
    "ServiceUnavailable", "InternalError", "RequestTimeout",
    "RequestTimeTooSkewed", "500", "502", "503", "504", "XMinioServerNotInitialized",
})


# Failures on the way to or from the endpoint: transient.
_NETWORK_ERRORS: Final = (EndpointConnectionError, ConnectionClosedError, ConnectTimeoutError,
                          ReadTimeoutError, ConnectionError, TimeoutError)

# A conditional PUT (If-None-Match) found an object: 412 on S3 and MinIO; 409 when another
# conditional write of the same key is under way.
_PRECONDITION_CODES: Final = frozenset({"PreconditionFailed", "412",
                                        "ConditionalRequestConflict"})


class StoreNotFound(StoreUnavailable):
    """The object (key) does not exist."""


class StorePreconditionFailed(StoreUnavailable):
    """A conditional request was refused because its condition did not hold."""


class StoreForbidden(StoreUnavailable):
    """The credentials are not accepted, or the policy does not allow the request."""


class StoreTransient(StoreUnavailable):
    """The store is unavailable for now (5xx, network, timeout): another attempt may work."""


class StoreThrottled(StoreTransient):
    """The store asked for fewer requests (SlowDown)."""


class CheckpointNotFound(CheckpointRefused):
    """The requested checkpoint has no manifest in the store."""


class ObjectExists(CheckpointFailed):
    """A conditional PUT was refused: the object exists (another writer made it)."""


def error_code(exc: ClientError) -> str:
    """The S3 error code of a ClientError (or its HTTP status as a string)."""
    err = exc.response.get("Error", {})
    code = str(err.get("Code") or "")
    if code:
        return code
    return str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "unknown"))


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and error_code(exc) in NOT_FOUND_CODES


def is_precondition_failed(exc: BaseException) -> bool:
    """True when a conditional request was refused because its condition did not hold."""
    return isinstance(exc, ClientError) and error_code(exc) in _PRECONDITION_CODES


def is_transient(exc: BaseException) -> bool:
    """True for failures another attempt may fix (network, throttling, 5xx)."""
    if isinstance(exc, ClientError):
        return error_code(exc) in _TRANSIENT_CODES
    return isinstance(exc, _NETWORK_ERRORS)


def _root_reason(exc: BaseException) -> str:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cur, socket.gaierror):
            return "host name not found"
        if isinstance(cur, (ConnectTimeoutError, socket.timeout, TimeoutError)):
            return "timed out"
        if isinstance(cur, ConnectionResetError):
            return "connection reset"
        if isinstance(cur, OSError) and cur.strerror:
            return cur.strerror.lower()
        cur = cur.__cause__ or cur.__context__
    text = str(exc).lower()
    if "refused" in text:
        return "connection refused"
    if "timed out" in text or "timeout" in text:
        return "timed out"
    if "name or service not known" in text or "nodename nor servname" in text:
        return "host name not found"
    return type(exc).__name__


def _code_class(code: str) -> type[StoreUnavailable]:
    """The error class of an S3 error code that is neither a denial nor a missing object."""
    if code in _PRECONDITION_CODES:
        return StorePreconditionFailed
    if code in _THROTTLED_CODES:
        return StoreThrottled
    if code in _TRANSIENT_CODES:
        return StoreTransient
    return StoreUnavailable


def to_hermit_error(exc: BaseException, *, endpoint: str, bucket: str, key: str,
                    action: str) -> HermitError:
    """Maps a botocore (or socket) exception to a HermitError with a one-line message.

    ``action`` is a short verb phrase, e.g. "upload chunk" or "read manifest". The
    error's class says what the failure means (the table above); a HermitError passes
    through unchanged.
    """
    if isinstance(exc, HermitError):
        return exc
    where = f"s3://{bucket}/{key}" if key else f"s3://{bucket}"
    if isinstance(exc, ClientError):
        code = error_code(exc)
        if code == "NoSuchBucket":
            return StoreUnavailable(
                f"cannot {action}: bucket {bucket!r} does not exist at {endpoint}")
        if code in _DENIED_CODES:
            return StoreForbidden(
                f"cannot {action} {where}: access denied by {endpoint} ({code})")
        if code in NOT_FOUND_CODES:
            return StoreNotFound(f"cannot {action} {where}: not found")
        message = str(exc.response.get("Error", {}).get("Message") or "").splitlines()
        detail = f": {message[0]}" if message and message[0] else ""
        return _code_class(code)(f"cannot {action} {where}: S3 error {code}{detail}")
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return StoreUnavailable(f"cannot {action} {where}: no S3 credentials configured")
    if isinstance(exc, _NETWORK_ERRORS):
        return StoreTransient(f"cannot reach S3 endpoint {endpoint}: {_root_reason(exc)}")
    if isinstance(exc, BotoCoreError):
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return StoreUnavailable(f"cannot {action} {where}: {first}")
    return StoreUnavailable(f"cannot {action} {where}: {type(exc).__name__}: {exc}")
