"""S3 errors classed by meaning (s3errors.py): each kind its StoreUnavailable subclass,
the message unchanged, and the classes agreeing with the predicates callers used before."""

from __future__ import annotations

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from hermit_common.errors import CheckpointFailed, StoreUnavailable
from hermit_common.s3errors import (
    StoreForbidden,
    StoreNotFound,
    StorePreconditionFailed,
    StoreThrottled,
    StoreTransient,
    is_not_found,
    is_precondition_failed,
    is_transient,
    to_hermit_error,
)


def _client_error(code: str, status: int = 400, message: str = "") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


def _classed(exc: BaseException) -> BaseException:
    return to_hermit_error(exc, endpoint="http://s3", bucket="b", key="k", action="read it")


@pytest.mark.parametrize(("exc", "kind"), [
    (_client_error("NoSuchKey", 404), StoreNotFound),
    (_client_error("", 404), StoreNotFound),
    (_client_error("NotFound", 404), StoreNotFound),
    (_client_error("PreconditionFailed", 412), StorePreconditionFailed),
    (_client_error("ConditionalRequestConflict", 409), StorePreconditionFailed),
    (_client_error("AccessDenied", 403), StoreForbidden),
    (_client_error("InvalidAccessKeyId", 403), StoreForbidden),
    (_client_error("ExpiredToken", 400), StoreForbidden),
    (_client_error("SlowDown", 503), StoreThrottled),
    (_client_error("ServiceUnavailable", 503), StoreTransient),
    (_client_error("InternalError", 500), StoreTransient),
    (_client_error("", 502), StoreTransient),
    (_client_error("XMinioServerNotInitialized", 503), StoreTransient),
    (EndpointConnectionError(endpoint_url="http://s3"), StoreTransient),
    (ConnectTimeoutError(endpoint_url="http://s3"), StoreTransient),
    (ReadTimeoutError(endpoint_url="http://s3"), StoreTransient),
    (ConnectionRefusedError(111, "Connection refused"), StoreTransient),
    # the store itself is missing, or not configured: the base class alone
    (_client_error("NoSuchBucket", 404), StoreUnavailable),
    (NoCredentialsError(), StoreUnavailable),
    (_client_error("InvalidArgument", 400), StoreUnavailable),
    (RuntimeError("boom"), StoreUnavailable),
])
def test_each_kind_of_failure_has_its_class(exc: BaseException,
                                            kind: type[StoreUnavailable]) -> None:
    error = _classed(exc)
    assert type(error) is kind
    assert isinstance(error, StoreUnavailable)  # every `except StoreUnavailable` still holds
    assert str(error).count("\n") == 0
    # The classes say what the predicates said.
    assert isinstance(error, StoreNotFound) == is_not_found(exc)
    assert isinstance(error, StorePreconditionFailed) == is_precondition_failed(exc)
    assert isinstance(error, StoreTransient) == is_transient(exc)


def test_the_messages_name_what_failed() -> None:
    assert str(_classed(_client_error("NoSuchKey", 404))) == \
        "cannot read it s3://b/k: not found"
    assert str(_classed(_client_error("AccessDenied", 403))) == \
        "cannot read it s3://b/k: access denied by http://s3 (AccessDenied)"
    assert str(_classed(_client_error("SlowDown", 503, "Please reduce\nyour rate"))) == \
        "cannot read it s3://b/k: S3 error SlowDown: Please reduce"
    assert str(_classed(_client_error("NoSuchBucket", 404))) == \
        "cannot read it: bucket 'b' does not exist at http://s3"


def test_a_hermit_error_passes_through_unchanged() -> None:
    error = CheckpointFailed("already a Hermit error")
    assert _classed(error) is error
