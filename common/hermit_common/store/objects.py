"""The store's object I/O on S3: the client (bucket-wide or scoped to a sandbox's prefix),
the key layout, and GET, PUT (with retries), list, copy and delete, every failure turned
into a Hermit error (s3errors.py)."""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

from botocore.exceptions import ClientError

from hermit_common import bounded
from hermit_common.errors import CheckpointFailed, HermitError
from hermit_common.s3errors import (
    ObjectExists,
    StoreNotFound,
    StorePreconditionFailed,
    StoreTransient,
    error_code,
    is_not_found,
    to_hermit_error,
)
from hermit_common.settings import StoreSettings

log = logging.getLogger("hermit_common.store")

_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_DIGEST_RE: Final = re.compile(r"^[0-9a-f]{64}$")
_PUT_ATTEMPTS: Final = 4  # on top of botocore's own retries
_BACKOFF_BASE_SECONDS: Final = 0.25
_BACKOFF_CAP_SECONDS: Final = 4.0
_DELETE_BATCH: Final = 1000

# Asked before each chunk PUT with its size in bytes, the upload's stop event and deadline:
# waits until the node's upload bandwidth lets it go (bandwidth.Ticket.acquire); False
# when it gave up waiting (stopped, or the deadline passed).
Pace = Callable[[int, threading.Event | None, float | None], bool]

# Scoped credentials (storecreds.CredentialCache.client): (namespace, sandbox, read-only
# sandboxes of the namespace) -> an S3 client whose credentials reach that prefix only.
ScopedClients = Callable[[str, str, tuple[str, ...]], Any]


def make_s3_client(settings: StoreSettings) -> Any:
    """A thread-safe boto3 S3 client configured from ``settings``."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": settings.max_attempts},
        connect_timeout=settings.connect_timeout_seconds,
        read_timeout=settings.read_timeout_seconds,
        max_pool_connections=max(10, settings.transfer_concurrency + 4),
        s3={"addressing_style": "path" if settings.endpoint_url else "auto"},
        user_agent_extra="hermit",
    )
    session = boto3.session.Session()
    return session.client(
        "s3",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id=settings.access_key_id,
        aws_secret_access_key=settings.secret_access_key,
        aws_session_token=settings.session_token,
        config=config,
    )


def check_name(value: str, what: str) -> str:
    """``value`` when it is one path segment of letters, digits, ``.``, ``_`` and ``-``
    (no ``/``, no wildcard, not ``.`` or ``..``); CheckpointFailed otherwise. Every key
    and every scoped-credential policy (storecreds.py) is built from checked names."""
    # fullmatch: "$" alone would let a trailing newline through.
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise CheckpointFailed(f"{what} name {value!r:.80} is not a valid object name")
    return value


class Objects:
    """The objects of one bucket (and prefix), through one client or per-sandbox scoped
    ones; thread-safe."""

    def __init__(self, settings: StoreSettings, client: Any | None = None, *,
                 scoped: ScopedClients | None = None) -> None:
        self.settings = settings
        # With ``scoped``, every request uses the client of the sandbox its key is under,
        # and there is no bucket-wide client at all.
        self.scoped = scoped
        self.client = client if client is not None or scoped is not None \
            else make_s3_client(settings)
        self.endpoint = settings.endpoint_url or "AWS S3"

    def s3(self, key: str, reads: tuple[str, ...] = ()) -> Any:
        """The client for a request on ``key`` (an object key or a listing prefix under
        a sandbox's prefix); with scoped credentials, that sandbox's (and ``reads``')."""
        if self.scoped is None:
            return self.client
        prefix = self.settings.prefix.strip("/")
        rest = key[len(prefix) + 1:] if prefix and key.startswith(prefix + "/") else \
            (key if not prefix else "")
        parts = rest.split("/", 2)
        if len(parts) < 3:
            raise CheckpointFailed(f"{key!r:.200} is under no sandbox's prefix: scoped "
                                   "store credentials reach only sandbox prefixes")
        return self.scoped(check_name(parts[0], "namespace"), check_name(parts[1], "sandbox"),
                           reads)

    # -- keys ---------------------------------------------------------------

    def sandbox_prefix(self, namespace: str, sandbox: str) -> str:
        base = f"{check_name(namespace, 'namespace')}/{check_name(sandbox, 'sandbox')}/"
        prefix = self.settings.prefix.strip("/")
        return f"{prefix}/{base}" if prefix else base

    def chunk_key(self, namespace: str, sandbox: str, digest: str) -> str:
        return f"{self.sandbox_prefix(namespace, sandbox)}chunks/{digest}"

    def manifest_key(self, namespace: str, sandbox: str, checkpoint: str) -> str:
        name = check_name(checkpoint, "checkpoint")
        return f"{self.sandbox_prefix(namespace, sandbox)}checkpoints/{name}/manifest.json"

    def sandbox_key_key(self, namespace: str, sandbox: str, sandbox_uid: str) -> str:
        """Where a sealed store keeps the sandbox's wrapped data key."""
        return f"{self.sandbox_prefix(namespace, sandbox)}keys/{check_name(sandbox_uid, 'uid')}"

    def uri(self, key: str) -> str:
        return f"s3://{self.settings.bucket}/{key}"

    # -- listings -------------------------------------------------------------

    def list_chunks(self, namespace: str, sandbox: str) -> dict[str, int]:
        """The sandbox's stored chunks: object name (the digest, unless sealed) -> size."""
        prefix = f"{self.sandbox_prefix(namespace, sandbox)}chunks/"
        out: dict[str, int] = {}
        for obj in self.list(prefix, "list chunks"):
            digest = obj["Key"][len(prefix):]
            if _DIGEST_RE.match(digest):
                out[digest] = int(obj.get("Size", 0))
        return out

    def list_checkpoints(self, namespace: str, sandbox: str) -> list[str]:
        """Names of the sandbox's complete checkpoints (those with a manifest), sorted."""
        prefix = f"{self.sandbox_prefix(namespace, sandbox)}checkpoints/"
        names = []
        for obj in self.list(prefix, "list checkpoints"):
            rest = obj["Key"][len(prefix):]
            name, sep, leaf = rest.partition("/")
            if sep and leaf == "manifest.json":
                names.append(name)
        return sorted(names)

    # -- requests -------------------------------------------------------------

    def error(self, exc: BaseException, key: str, action: str) -> HermitError:
        return to_hermit_error(exc, endpoint=self.endpoint, bucket=self.settings.bucket,
                               key=key, action=action)

    def list(self, prefix: str, action: str) -> Iterator[dict[str, Any]]:
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.settings.bucket, "Prefix": prefix}
            if token:
                kwargs["ContinuationToken"] = token
            try:
                page = self.s3(prefix).list_objects_v2(**kwargs)
            except Exception as exc:
                raise self.error(exc, prefix, action) from None
            yield from page.get("Contents", [])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def ages(self, prefix: str, action: str) -> Iterator[tuple[str, float | None]]:
        """(name under ``prefix``, age in seconds or None) of every object there."""
        now = time.time()
        for obj in self.list(prefix, action):
            modified = obj.get("LastModified")
            yield obj["Key"][len(prefix):], (
                None if modified is None else now - modified.timestamp())

    def put(self, key: str, body: bytes, content_type: str, action: str,
            stop: threading.Event | None = None, deadline: float | None = None, *,
            exclusive: bool = False, pace: Pace | None = None) -> None:
        """PUT with extra backoff-and-jitter attempts for errors botocore gave up on.

        ``exclusive``: a conditional PUT (``If-None-Match: *``) that never replaces an
        object; ObjectExists when there is one already. ``pace``: asked before each
        attempt (the node's upload bandwidth, bandwidth.py)."""
        extra: dict[str, str] = {"IfNoneMatch": "*"} if exclusive else {}
        for attempt in range(1, _PUT_ATTEMPTS + 1):
            if stop is not None and stop.is_set():
                raise CheckpointFailed("upload aborted")
            if deadline is not None and time.monotonic() > deadline:
                raise CheckpointFailed(f"cannot {action}: the upload deadline passed")
            if pace is not None and not pace(len(body), stop, deadline):
                raise CheckpointFailed("upload aborted" if stop is not None and stop.is_set()
                                       else f"cannot {action}: the upload deadline passed "
                                       "while it waited for the node's upload bandwidth")
            try:
                self.s3(key).put_object(Bucket=self.settings.bucket, Key=key, Body=body,
                                        ContentType=content_type, **extra)
                return
            except Exception as exc:
                # Classed only when botocore raised it: a Hermit error (from the scoped
                # credentials) is never retried here.
                error = self.error(exc, key, action)
                classed = not isinstance(exc, HermitError)
                if exclusive and classed and isinstance(error, StorePreconditionFailed):
                    raise ObjectExists(
                        f"cannot {action} {self.uri(key)}: an object exists there already "
                        "(written by another writer); it was not replaced") from None
                if attempt == _PUT_ATTEMPTS or not (classed
                                                    and isinstance(error, StoreTransient)):
                    raise error from None
                delay = min(_BACKOFF_CAP_SECONDS, _BACKOFF_BASE_SECONDS * 2 ** (attempt - 1))
                delay *= random.uniform(0.5, 1.5)
                log.debug("retrying %s of %s in %.2fs: %s", action, key, delay,
                          type(exc).__name__)
                if stop is not None:
                    stop.wait(delay)
                else:
                    time.sleep(delay)

    def get(self, key: str, action: str, max_bytes: int) -> bytes:
        """An object's bytes, at most ``max_bytes`` of them (bounded.py): its size is
        checked on the response's Content-Length before any of the body is read (the
        connection is closed unread: one request, like a HEAD first but without its
        race), and no more than ``max_bytes`` + 1 bytes are ever read, whatever the
        header said. bounded.TooLarge when it is larger; StoreNotFound when there is
        no such object."""
        try:
            response = self.s3(key).get_object(Bucket=self.settings.bucket, Key=key)
        except Exception as exc:
            error = self.error(exc, key, action)
            if not isinstance(error, StoreNotFound) and self.scoped is not None \
                    and self._absent(key, exc):
                raise StoreNotFound(f"cannot {action} {self.uri(key)}: not found") from None
            raise error from None
        body = response["Body"]
        try:
            length = int(response.get("ContentLength", 0))
            if length > max_bytes:
                raise bounded.TooLarge(
                    f"cannot {action} {self.uri(key)}: object of {length} "
                    f"bytes is larger than the limit of {max_bytes}")
            data: bytes = body.read(max_bytes + 1)
        except HermitError:
            raise
        except Exception as exc:
            raise self.error(exc, key, action) from None
        finally:
            body.close()
        if len(data) > max_bytes:
            raise bounded.TooLarge(
                f"cannot {action} {self.uri(key)}: object is larger than "
                f"the limit of {max_bytes} bytes")
        return data

    def _absent(self, key: str, exc: BaseException) -> bool:
        """Whether a refused GET was of a missing object. AWS S3 answers 403, not 404, for
        a missing key unless ListBucket is allowed without a condition, and scoped
        credentials allow it only under the sandbox's prefix (storecreds.py); so a
        refusal is checked with a listing of exactly that key, which they may make."""
        if not isinstance(exc, ClientError) or error_code(exc) not in ("AccessDenied", "403"):
            return False
        try:
            page = self.s3(key).list_objects_v2(Bucket=self.settings.bucket, Prefix=key,
                                                MaxKeys=1)
        except Exception:
            return False
        return not any(o.get("Key") == key for o in page.get("Contents", []))

    def copy(self, source_key: str, dest_key: str, reads: tuple[str, ...]) -> None:
        """Copies an object inside the bucket (with ``reads``' credentials for the source);
        the botocore exception as it came when that fails."""
        self.s3(dest_key, reads).copy_object(
            Bucket=self.settings.bucket, Key=dest_key,
            CopySource={"Bucket": self.settings.bucket, "Key": source_key})

    def delete(self, key: str, action: str) -> None:
        try:
            self.s3(key).delete_object(Bucket=self.settings.bucket, Key=key)
        except Exception as exc:
            raise self.error(exc, key, action) from None

    def delete_many(self, keys: Sequence[str], action: str,
                    may_delete: Callable[[], bool] | None) -> bool:
        """Deletes ``keys`` in batches; False when ``may_delete`` stopped it first."""
        for start in range(0, len(keys), _DELETE_BATCH):
            if may_delete is not None and not may_delete():
                log.info("garbage collection stopped before it could %s", action)
                return False
            batch = keys[start:start + _DELETE_BATCH]
            try:
                response = self.s3(batch[0]).delete_objects(
                    Bucket=self.settings.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            except Exception as exc:
                raise self.error(exc, batch[0], action) from None
            errors = response.get("Errors", [])
            if errors:
                first = errors[0]
                raise self.error(
                    RuntimeError(f"{first.get('Code')}: {first.get('Message')}"),
                    str(first.get("Key", batch[0])), action)
        return True

    def ensure_bucket(self) -> None:
        """Creates the bucket if it does not exist (for tests and demos)."""
        bucket = self.settings.bucket
        if self.client is None:
            raise HermitError(f"cannot check or create bucket {bucket} with scoped store "
                              "credentials: they reach sandbox prefixes only")
        try:
            self.client.head_bucket(Bucket=bucket)
            return
        except Exception as exc:
            # The predicate, not the class: NoSuchBucket is no StoreNotFound (s3errors.py).
            if not is_not_found(exc) and "NoSuchBucket" not in str(exc):
                raise self.error(exc, "", "check bucket") from None
        kwargs: dict[str, Any] = {"Bucket": bucket}
        if self.settings.region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.settings.region}
        try:
            self.client.create_bucket(**kwargs)
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self.error(exc, "", "create bucket") from None
