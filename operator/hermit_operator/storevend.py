"""Scoped store credentials, vended by the key service (keyservice.py, ``POST
/v1/store/credentials``; docs/storage.md#scoped-store-credentials).

The operator alone holds credentials for the whole bucket (the chart's
``s3.existingSecret``, or the SDK's chain). For a node-agent it calls STS ``AssumeRole``
against the store's endpoint (AWS STS, or MinIO's, which serves it on the S3 port) with
an inline session ``Policy`` from ``storecreds.session_policy``: the temporary
credentials can do no more than both the caller's rights and that policy allow, so only
that sandbox's prefix. Credentials are never logged.

``SandboxStoreVendor`` does the same for a sandbox's own store (spec.checkpoint.storage
with a secretRef; docs/storage.md#per-sandbox-store-credentials): AssumeRole against that
store's endpoint with the credentials of the Secret the key service read (the node-agent
never reads it), and a session policy for that bucket and that sandbox's prefix. When the
setting (HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS) allows it, the Secret's own
credentials instead: "static" always, "sts-or-static" when the store refuses STS.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any, Final

from hermit_common import storecreds
from hermit_common.errors import HermitError
from hermit_common.sandboxstore import Credentials as SecretCredentials
from hermit_common.sandboxstore import Location
from hermit_common.settings import KeyServiceSettings, StoreSettings

# MinIO ignores the role; AWS boto3 wants an ARN-shaped value either way.
MINIO_ROLE_ARN: Final = "arn:aws:iam::000000000000:role/hermit-node-store"
_SESSION_NAME_BAD: Final = re.compile(r"[^\w+=,.@-]")


class VendFailed(HermitError):
    """STS refused or did not answer."""


def session_name(node: str) -> str:
    """``hermit-<node>`` within STS's rules (2-64 of ``[\\w+=,.@-]``): CloudTrail and
    MinIO's logs show which node used the credentials."""
    return _SESSION_NAME_BAD.sub("-", f"hermit-{node}")[:64]


def make_sts_client(store: StoreSettings) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "sts", endpoint_url=store.endpoint_url, region_name=store.region,
        aws_access_key_id=store.access_key_id, aws_secret_access_key=store.secret_access_key,
        aws_session_token=store.session_token,
        config=Config(retries={"mode": "standard", "max_attempts": 3},
                      connect_timeout=5, read_timeout=10))


class StoreVendor:
    """Temporary credentials for one sandbox's prefix of the default store."""

    def __init__(self, store: StoreSettings, settings: KeyServiceSettings, *,
                 make_sts: Callable[[StoreSettings], Any] = make_sts_client) -> None:
        self._store = store
        self._role = settings.store_role_arn or MINIO_ROLE_ARN
        self._seconds = settings.store_credentials_seconds
        self._sts = make_sts(store)

    def credentials(self, node: str, namespace: str, sandbox: str, *, write: bool,
                    reads: tuple[str, ...]) -> dict[str, Any]:
        policy = storecreds.session_policy(self._store.bucket, self._store.prefix, namespace,
                                           sandbox, write=write, reads=reads)
        try:
            out = self._sts.assume_role(
                RoleArn=self._role, RoleSessionName=session_name(node),
                Policy=json.dumps(policy, separators=(",", ":")),
                DurationSeconds=self._seconds)
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            raise VendFailed(f"STS AssumeRole for {namespace}/{sandbox} failed: "
                             f"{code or type(exc).__name__}") from None
        creds = out.get("Credentials") or {}
        expiration: Any = creds.get("Expiration")
        return {"accessKeyId": creds.get("AccessKeyId"),
                "secretAccessKey": creds.get("SecretAccessKey"),
                "sessionToken": creds.get("SessionToken"),
                "durationSeconds": self._seconds,
                "expiration": str(getattr(expiration, "isoformat", lambda: expiration)()),
                "bucket": self._store.bucket,
                "access": "read-write" if write else "read-only"}


STS: Final = "sts"
STS_OR_STATIC: Final = "sts-or-static"
STATIC: Final = "static"
STATIC_RECHECK_SECONDS: Final = 60  # the lifetime a node gives a Secret's own credentials


class SandboxStoreVendor:
    """Credentials for one sandbox's prefix of a store its spec names, from the Secret's
    credentials (``mode``: HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS, not "off")."""

    def __init__(self, defaults: StoreSettings, settings: KeyServiceSettings, *,
                 make_sts: Callable[[StoreSettings], Any] = make_sts_client) -> None:
        assert settings.sandbox_store_credentials in (STS, STS_OR_STATIC, STATIC)
        self.defaults = defaults  # what a spec leaves out (sandboxstore.sandbox_storage)
        self._mode = settings.sandbox_store_credentials
        self._seconds = settings.store_credentials_seconds
        self._make_sts = make_sts

    def credentials(self, node: str, namespace: str, sandbox: str, *, write: bool,
                    reads: tuple[str, ...], location: Location,
                    secret: SecretCredentials) -> dict[str, Any]:
        out: dict[str, Any] = {"bucket": location.bucket, "location": location.to_status(),
                               "access": "read-write" if write else "read-only"}
        if self._mode != STATIC:
            try:
                return out | self._assume(node, namespace, sandbox, write=write, reads=reads,
                                          location=location, secret=secret)
            except VendFailed:
                if self._mode == STS:
                    raise
        # The Secret's own credentials: whatever they reach, the node now holds until
        # they are rotated (docs/security.md). The node asks again within a minute, so a
        # fixed or rotated Secret is picked up as soon as when the node read it itself.
        return out | {"mode": STATIC, "accessKeyId": secret.access_key_id,
                      "secretAccessKey": secret.secret_access_key,
                      "sessionToken": secret.session_token or "",
                      "durationSeconds": STATIC_RECHECK_SECONDS, "expiration": ""}

    def _assume(self, node: str, namespace: str, sandbox: str, *, write: bool,
                reads: tuple[str, ...], location: Location,
                secret: SecretCredentials) -> dict[str, Any]:
        store = dataclasses.replace(
            self.defaults, bucket=location.bucket, prefix=location.prefix,
            region=location.region, endpoint_url=location.endpoint,
            access_key_id=secret.access_key_id, secret_access_key=secret.secret_access_key,
            session_token=secret.session_token)
        policy = storecreds.session_policy(location.bucket, location.prefix, namespace,
                                           sandbox, write=write, reads=reads)
        what = f"{namespace}/{sandbox} at {location.describe()}"
        try:
            sts = self._make_sts(store)
            answer = sts.assume_role(
                RoleArn=secret.role_arn or MINIO_ROLE_ARN, RoleSessionName=session_name(node),
                Policy=json.dumps(policy, separators=(",", ":")),
                DurationSeconds=self._seconds)
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            raise VendFailed(f"STS AssumeRole for {what}, with the credentials of the "
                             f"sandbox's Secret, failed: {code or type(exc).__name__} (a "
                             "store without STS needs "
                             "HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS=sts-or-static or "
                             "static, chart value nodeAgent.perSandboxStoreCredentials)") \
                from None
        creds = answer.get("Credentials") or {}
        expiration: Any = creds.get("Expiration")
        return {"mode": STS, "accessKeyId": creds.get("AccessKeyId"),
                "secretAccessKey": creds.get("SecretAccessKey"),
                "sessionToken": creds.get("SessionToken"),
                "durationSeconds": self._seconds,
                "expiration": str(getattr(expiration, "isoformat", lambda: expiration)())}
