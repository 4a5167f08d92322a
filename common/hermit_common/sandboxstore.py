"""Per-sandbox stores, the pure part both components share (docs/storage.md).

``spec.checkpoint.storage`` of an AgentSandbox names a bucket, and optionally a key
prefix, an endpoint, a region and a Secret (in the sandbox's namespace) holding S3
credentials; what it leaves out comes from the default store (HERMIT_S3_*, the chart's
``s3.*`` values). ``sandbox_storage`` decides where a sandbox's next checkpoint goes,
``recorded_location`` and ``restore_storage`` where an existing checkpoint is read and
with which Secret, ``parse_credentials`` reads a Secret (bounded; a value is never put in
a message). The node-agent (hermit_node.control.storage) uses them to build its stores; the
operator's key service (hermit_operator.keyservice) to decide which Secret and which
bucket and prefix the credentials it vends for a sandbox are for: only the operator reads
the Secret (docs/storage.md#per-sandbox-store-credentials).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlparse

from hermit_common import api, protocol
from hermit_common.errors import CheckpointRefused, HermitError
from hermit_common.settings import StoreSettings

SPEC_PATH: Final = "spec.checkpoint.storage"
# Bounds on what a Secret or a spec may hold (a Secret is written by a tenant).
MAX_SECRET_VALUE: Final = 4096  # base64 characters of one value (session tokens ~1-2 KiB)
MAX_FIELD: Final = 1024  # characters of a bucket, prefix, region or endpoint
ROLE_ARN_KEY: Final = "roleArn"  # optional: the role AssumeRole names (AWS needs one)
_SECRET_NAME_RE: Final = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_ROLE_ARN_RE: Final = re.compile(r"^arn:[\w+=/,.@:-]{1,2040}$")


class StorageError(HermitError):
    """A sandbox's storage cannot be used as it is configured: its Secret is missing or
    incomplete, the operator may not read it, per-sandbox storage is off, or it would
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
    role_arn: str | None = None  # the Secret's roleArn: what STS AssumeRole names

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
    text = str(value)[:MAX_FIELD + 1].strip().rstrip("/")
    if len(text) > MAX_FIELD:
        raise error(f"{where}: endpoint {text!r:.200} is longer than {MAX_FIELD} characters")
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


def _secret_name(storage: Mapping[str, Any], where: str) -> str | None:
    """``secretRef.name``: a Secret's name (a DNS subdomain), or None."""
    ref = storage.get("secretRef")
    if ref is None:
        return None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    if name is None or name == "":
        return None
    if not isinstance(name, str) or not _SECRET_NAME_RE.match(name):
        raise StorageError(f"{where}: secretRef.name {str(name)!r:.80} is not a Secret's name")
    return name


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
    for name in ("bucket", "prefix", "region"):
        if len(str(storage.get(name) or "")) > MAX_FIELD:
            raise StorageError(f"{where}: {name} is longer than {MAX_FIELD} characters")
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
    secret = _secret_name(storage, where)
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
            or not isinstance(raw.get("endpoint", ""), str) \
            or any(len(str(raw.get(k) or "")) > MAX_FIELD
                   for k in ("bucket", "prefix", "region", "endpoint")):
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
        secret = _secret_name(storage, f"{SPEC_PATH} of {_sandbox_name(owner)}")
    where = f"the checkpoint at {location.describe()}"
    if owner is not None:
        where += f", read with the credentials {_sandbox_name(owner)} names"
    _check_credentials_stay_home(location, secret, default, where)
    return SandboxStorage(location, secret)


def parse_credentials(secret: Mapping[str, Any], where: str) -> Credentials:
    """The S3 credentials in a Secret (``where``: its namespace/name, for messages).
    StorageError names a missing or unreadable key, never a value."""
    data = secret.get("data") or {}
    if not isinstance(data, Mapping):
        raise StorageError(f"Secret {where} has no data")

    def value(key: str) -> str | None:
        raw = data.get(key)
        if raw is None:
            return None
        if not isinstance(raw, str) or len(raw) > MAX_SECRET_VALUE:
            raise StorageError(f"Secret {where}: {key} is not a string of at most "
                               f"{MAX_SECRET_VALUE} base64 characters")
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
    role = value(ROLE_ARN_KEY)
    if role is not None and not _ROLE_ARN_RE.match(role):
        raise StorageError(f"Secret {where}: {ROLE_ARN_KEY} is not an IAM role ARN")
    return Credentials(access, secret_key, value(api.STORAGE_SECRET_SESSION_TOKEN), role)


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


def location_from_status(raw: object) -> Location | None:
    """A ``Location.to_status()`` read back (the key service's answer), or None when it
    is not one."""
    if not isinstance(raw, Mapping) or not all(
            isinstance(raw.get(k), str) and len(raw[k]) <= MAX_FIELD
            for k in ("bucket", "prefix", "region")):
        return None
    endpoint = raw.get("endpoint")
    if endpoint is not None and (not isinstance(endpoint, str) or len(endpoint) > MAX_FIELD):
        return None
    return Location(bucket=raw["bucket"], prefix=raw["prefix"], region=raw["region"],
                    endpoint=endpoint)
