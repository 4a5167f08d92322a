"""Scoped store credentials (docs/storage.md#scoped-store-credentials): a node-agent
reaches a sandbox's objects in the bucket only with temporary credentials the operator's
key service vends for that sandbox's prefix, and only for sandboxes its node serves.

The pure parts:

- ``session_policy``: the inline session policy (STS ``AssumeRole`` ``Policy``) for one
  sandbox's prefix, read-write, plus read-only prefixes (a fork's source, whose chunks a
  fork's first checkpoint copies). Names are checked by ``store.check_name`` (letters,
  digits, ``.``, ``_``, ``-``; no ``/``, no ``*``, no ``?``), so a hostile name cannot
  widen a prefix.
- ``CredentialCache``: S3 clients built from such credentials, one per (namespace,
  sandbox, read-only sandboxes), fetched again shortly before they expire; while the key
  service does not answer, credentials still valid stay in use.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from hermit_common.errors import StoreUnavailable
from hermit_common.store.objects import check_name

# What a node-agent does in a sandbox's prefix: upload (list, put, copy), restore and
# prefetch (get), garbage collection (list, delete). Nothing bucket-wide.
WRITE_ACTIONS: Final = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")
READ_ACTIONS: Final = ("s3:GetObject",)
MIN_DURATION_SECONDS: Final = 900  # STS's own minimum
MAX_DURATION_SECONDS: Final = 3600  # a role's default maximum session (AWS)
MAX_READS: Final = 4  # read-only prefixes one request may name
REFRESH_FRACTION: Final = 0.25  # refresh once this much of the lifetime is left...
MAX_REFRESH_MARGIN_SECONDS: Final = 300.0  # ...or this long, whichever is shorter
MAX_CLIENTS: Final = 256
# A refusal (or no answer) is remembered this long, so a fork's chunk copies, each of
# which asks for its source's read access, do not each ask the key service again. Short:
# a notice's stopping checkpoint seconds after a failed one (a Secret fixed meanwhile)
# must ask again, not inherit the old refusal.
FAILURE_TTL_SECONDS: Final = 2.0


class StoreCredentialsUnavailable(StoreUnavailable):
    """No credentials for a sandbox's prefix: the key service refused or did not answer
    (counted as the store's failure: a checkpoint fails, a restore is retried)."""


def sandbox_prefix(prefix: str, namespace: str, sandbox: str) -> str:
    """``<prefix>/<namespace>/<sandbox>/``, exactly the store's (store.CheckpointStore)."""
    base = f"{check_name(namespace, 'namespace')}/{check_name(sandbox, 'sandbox')}/"
    prefix = prefix.strip("/")
    return f"{prefix}/{base}" if prefix else base


def session_policy(bucket: str, prefix: str, namespace: str, sandbox: str, *,
                   write: bool = True, reads: Sequence[str] = ()) -> dict[str, Any]:
    """The session policy for ``sandbox``'s prefix (read-write, or read-only when not
    ``write``), and read-only for the ``reads`` sandboxes of the same namespace."""
    own = sandbox_prefix(prefix, namespace, sandbox)
    readable = [sandbox_prefix(prefix, namespace, r) for r in reads if r != sandbox]
    statements: list[dict[str, Any]] = [{
        "Sid": "SandboxObjects",
        "Effect": "Allow",
        "Action": list(WRITE_ACTIONS if write else READ_ACTIONS),
        "Resource": [f"arn:aws:s3:::{bucket}/{own}*"],
    }]
    if readable:
        statements.append({
            "Sid": "SourceObjects",
            "Effect": "Allow",
            "Action": list(READ_ACTIONS),
            "Resource": [f"arn:aws:s3:::{bucket}/{p}*" for p in readable],
        })
    statements.append({
        "Sid": "ListSandboxPrefix",
        "Effect": "Allow",
        "Action": ["s3:ListBucket"],
        "Resource": [f"arn:aws:s3:::{bucket}"],
        "Condition": {"StringLike": {"s3:prefix": [f"{p}*" for p in (own, *readable)]}},
    })
    return {"Version": "2012-10-17", "Statement": statements}


@dataclass(frozen=True)
class Credentials:
    """Temporary S3 credentials (kept out of repr and logs)."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str = field(repr=False)
    lifetime_seconds: float  # from when they were asked for


Scope = tuple[str, str, tuple[str, ...]]  # namespace, sandbox, read-only sandboxes
Fetch = Callable[[str, str, tuple[str, ...]], Credentials]
MakeClient = Callable[[Credentials], Any]


def refresh_margin(lifetime: float) -> float:
    return min(MAX_REFRESH_MARGIN_SECONDS, lifetime * REFRESH_FRACTION)


class CredentialCache:
    """``client(namespace, sandbox, reads)``: an S3 client whose credentials reach that
    prefix, fetched once and reused until ``refresh_margin`` before they expire.
    Thread-safe; one fetch at a time per scope. When a refresh fails with the old
    credentials still valid, the old client is used (the key service restarting)."""

    def __init__(self, fetch: Fetch, make_client: MakeClient, *,
                 clock: Callable[[], float] = time.monotonic,
                 max_clients: int = MAX_CLIENTS) -> None:
        self._fetch, self._make_client, self._clock = fetch, make_client, clock
        self._max = max_clients
        # scope -> (refresh at, expires at, client)
        self._entries: OrderedDict[Scope, tuple[float, float, Any]] = OrderedDict()
        self._locks: dict[Scope, threading.Lock] = {}
        self._failed: dict[Scope, tuple[float, StoreCredentialsUnavailable]] = {}
        self._lock = threading.Lock()
        self.fetches = 0  # a count for tests and logs

    def client(self, namespace: str, sandbox: str, reads: tuple[str, ...] = ()) -> Any:
        scope: Scope = (namespace, sandbox, tuple(sorted(set(reads) - {sandbox})))
        fresh = self._lookup(scope, fresh=True)
        if fresh is not None:
            return fresh
        with self._lock:
            scope_lock = self._locks.setdefault(scope, threading.Lock())
        with scope_lock:
            fresh = self._lookup(scope, fresh=True)  # another thread fetched meanwhile
            if fresh is not None:
                return fresh
            asked = self._clock()
            valid = self._lookup(scope, fresh=False)
            failed = self._failed.get(scope)
            if failed is not None and failed[0] > asked:
                if valid is not None:
                    return valid
                raise failed[1]
            try:
                creds = self._fetch(*scope)
            except StoreCredentialsUnavailable as exc:
                with self._lock:
                    if len(self._failed) >= self._max:
                        self._failed.clear()
                    self._failed[scope] = (asked + FAILURE_TTL_SECONDS, exc)
                if valid is None:
                    raise
                return valid
            self._failed.pop(scope, None)
            self.fetches += 1
            client = self._make_client(creds)
            life = creds.lifetime_seconds
            entry = (asked + life - refresh_margin(life), asked + life, client)
            with self._lock:
                self._entries[scope] = entry
                self._entries.move_to_end(scope)
                while len(self._entries) > self._max:
                    old, _ = self._entries.popitem(last=False)
                    self._locks.pop(old, None)
                    self._failed.pop(old, None)
            return client

    def _lookup(self, scope: Scope, *, fresh: bool) -> Any:
        now = self._clock()
        with self._lock:
            entry = self._entries.get(scope)
            if entry is None or now >= entry[0 if fresh else 1]:
                return None
            self._entries.move_to_end(scope)
            return entry[2]
