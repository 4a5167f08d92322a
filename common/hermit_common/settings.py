"""Settings from the environment: one frozen, typed, validated object per component.

Each component builds its settings once in ``main()`` from ``os.environ`` (or any
mapping, for tests). A wrong or missing value raises ``SettingsError`` naming the
variable and what is wrong with it. ``redacted()`` gives a copy safe to log.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlparse

from hermit_common import logformat
from hermit_common.errors import SettingsError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Env:
    """Reads typed values from an environment mapping, naming the variable on error."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ

    def _raw(self, name: str) -> str | None:
        value = self._environ.get(name)
        if value is None or value.strip() == "":
            return None
        return value.strip()

    def text(self, name: str, default: str | None = None) -> str:
        value = self._raw(name)
        if value is None:
            if default is None:
                raise SettingsError(f"{name} is required but not set")
            return default
        return value

    def optional_str(self, name: str) -> str | None:
        return self._raw(name)

    def integer(self, name: str, default: int, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
        raw = self._raw(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise SettingsError(f"{name}={raw!r} is not an integer") from None
        if minimum is not None and value < minimum:
            raise SettingsError(f"{name}={value} is below the minimum {minimum}")
        if maximum is not None and value > maximum:
            raise SettingsError(f"{name}={value} is above the maximum {maximum}")
        return value

    def number(self, name: str, default: float, *, minimum: float | None = None,
              maximum: float | None = None) -> float:
        raw = self._raw(name)
        if raw is None:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise SettingsError(f"{name}={raw!r} is not a number") from None
        if minimum is not None and value < minimum:
            raise SettingsError(f"{name}={value} is below the minimum {minimum}")
        if maximum is not None and value > maximum:
            raise SettingsError(f"{name}={value} is above the maximum {maximum}")
        return value

    def flag(self, name: str, default: bool) -> bool:
        raw = self._raw(name)
        if raw is None:
            return default
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise SettingsError(f"{name}={raw!r} is not a boolean (use true or false)")

    def url(self, name: str, default: str | None = None) -> str:
        value = self.text(name, default)
        return _check_url(name, value)

    def optional_url(self, name: str) -> str | None:
        value = self._raw(name)
        return None if value is None else _check_url(name, value)

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.text(name, default)
        if value not in choices:
            raise SettingsError(f"{name}={value!r} is not one of {', '.join(choices)}")
        return value


def _check_url(name: str, value: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise SettingsError(f"{name}={value!r} is not an http(s) URL")
    return value.rstrip("/")


@dataclass(frozen=True)
class StoreSettings:
    """Where checkpoints live: an S3-compatible bucket."""

    bucket: str
    prefix: str = "hermit"
    endpoint_url: str | None = None  # None: AWS S3 itself
    region: str = "us-east-1"
    access_key_id: str | None = None  # None: boto3's default credential chain
    secret_access_key: str | None = None
    session_token: str | None = None  # with temporary credentials (a sandbox's Secret)
    transfer_concurrency: int = 8
    chunk_size_bytes: int = 4 * 1024 * 1024
    max_attempts: int = 5
    connect_timeout_seconds: float = 5.0
    read_timeout_seconds: float = 60.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> StoreSettings:
        env = Env(environ)
        bucket = env.text("HERMIT_S3_BUCKET")
        prefix = env.text("HERMIT_S3_PREFIX", "hermit").strip("/")
        access = env.optional_str("HERMIT_S3_ACCESS_KEY_ID")
        secret = env.optional_str("HERMIT_S3_SECRET_ACCESS_KEY")
        if (access is None) != (secret is None):
            raise SettingsError(
                "HERMIT_S3_ACCESS_KEY_ID and HERMIT_S3_SECRET_ACCESS_KEY must be set together"
            )
        return cls(
            bucket=bucket,
            prefix=prefix,
            endpoint_url=env.optional_url("HERMIT_S3_ENDPOINT"),
            region=env.text("HERMIT_S3_REGION", "us-east-1"),
            access_key_id=access,
            secret_access_key=secret,
            transfer_concurrency=env.integer("HERMIT_S3_CONCURRENCY", 8, minimum=1, maximum=64),
            chunk_size_bytes=env.integer(
                "HERMIT_CHUNK_SIZE_BYTES", 4 * 1024 * 1024, minimum=64 * 1024,
                maximum=64 * 1024 * 1024,
            ),
            max_attempts=env.integer("HERMIT_S3_MAX_ATTEMPTS", 5, minimum=1, maximum=20),
            connect_timeout_seconds=env.number(
                "HERMIT_S3_CONNECT_TIMEOUT_SECONDS", 5.0, minimum=0.1),
            read_timeout_seconds=env.number("HERMIT_S3_READ_TIMEOUT_SECONDS", 60.0, minimum=0.1),
        )


# The key service's audience (docs/security.md#the-key-service): a node-agent's projected
# token for it is good for nothing else, and the API server refuses it.
KEY_SERVICE_AUDIENCE = "hermit.dev/keys"
KEY_SERVICE_TOKEN_PATH = "/var/run/secrets/hermit.dev/keys/token"


@dataclass(frozen=True)
class SealSettings:
    """Sealed checkpoints (docs/security.md): where the key-encryption keys are, either
    mounted (``keys_dir``) or behind the operator's key service (``key_service_url``:
    the node-agent then holds no key-encryption key)."""

    keys_dir: str | None = None  # a mounted Secret (current + KEKs); None: written plain
    accept_plain: bool = False  # read plain (unsealed) checkpoints too: a migration only
    key_service_url: str | None = None  # https://...: wrap, unwrap, sign, verify there
    key_service_ca_file: str | None = None  # the CA that signed the key service's cert
    key_service_token_file: str = KEY_SERVICE_TOKEN_PATH  # audience hermit.dev/keys
    # The name its certificate is verified for, when the URL names an address (a
    # Service's ClusterIP on a cluster without DNS); None: the URL's host.
    key_service_server_name: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SealSettings:
        env = Env(environ)
        keys_dir = env.optional_str("HERMIT_SEAL_KEYS_DIR")
        url = env.optional_url("HERMIT_SEAL_KEY_SERVICE_URL")
        ca_file = env.optional_str("HERMIT_SEAL_KEY_SERVICE_CA_FILE")
        if url is not None and keys_dir is not None:
            raise SettingsError("HERMIT_SEAL_KEYS_DIR and HERMIT_SEAL_KEY_SERVICE_URL are both "
                                "set: a node-agent either holds the keys or asks the key "
                                "service, not both")
        if url is not None and not url.startswith("https://"):
            raise SettingsError(f"HERMIT_SEAL_KEY_SERVICE_URL={url!r} is not https: the key "
                                "service is only spoken to over TLS")
        if url is not None and ca_file is None:
            raise SettingsError("HERMIT_SEAL_KEY_SERVICE_CA_FILE is required with "
                                "HERMIT_SEAL_KEY_SERVICE_URL (the CA of the key service's "
                                "certificate)")
        return cls(keys_dir=keys_dir,
                   accept_plain=env.flag("HERMIT_SEAL_ACCEPT_PLAIN", False),
                   key_service_url=url, key_service_ca_file=ca_file,
                   key_service_token_file=env.text("HERMIT_SEAL_KEY_SERVICE_TOKEN_FILE",
                                                   KEY_SERVICE_TOKEN_PATH),
                   key_service_server_name=env.optional_str(
                       "HERMIT_SEAL_KEY_SERVICE_SERVER_NAME"))


SANDBOX_STORE_CREDENTIAL_MODES: Final = ("off", "sts", "sts-or-static", "static")


@dataclass(frozen=True)
class KeyServiceSettings:
    """The operator's key service (docs/security.md#the-key-service): node-agents wrap,
    unwrap, sign and verify there, each only for the sandboxes its node serves."""

    port: int = 0  # 0: off
    keys_dir: str | None = None  # the sealing Secret, mounted in the operator only
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    callers: tuple[str, ...] = ()  # service-account usernames allowed (the node-agent's)
    audience: str = KEY_SERVICE_AUDIENCE
    # Scoped store credentials (docs/storage.md#scoped-store-credentials): STS AssumeRole
    # with a session policy for one sandbox's prefix, with the operator's own store
    # credentials (HERMIT_S3_*); the role to assume (AWS needs one; MinIO ignores it),
    # and how long the credentials last.
    store_credentials: bool = False
    store_role_arn: str | None = None
    store_credentials_seconds: int = 3600
    # Per-sandbox stores (spec.checkpoint.storage with a secretRef;
    # docs/storage.md#per-sandbox-store-credentials): the operator reads the Secret and
    # vends "sts" (AssumeRole with the Secret's credentials, scoped to the sandbox's prefix;
    # refused when the store has no STS), "sts-or-static" (the Secret's own credentials
    # when STS is refused), "static" (always the Secret's own), or "off" (none).
    sandbox_store_credentials: str = "off"
    # A cloud KMS holds the key-encryption key instead of keys_dir
    # (docs/security.md#a-cloud-kms): kms_provider is aws (AWS KMS), azure (Key Vault) or
    # gcp (Cloud KMS). The key to wrap with and the key to sign with (AWS: id, ARN or
    # alias; Azure: the key's URL, and no MAC key; GCP: a CryptoKey, and an HMAC key
    # version); AWS's region, AWS's or GCP's endpoint (None: the SDK's, Google's).
    kms_provider: str = "aws"
    kms_key_id: str | None = None
    kms_mac_key_id: str | None = None
    kms_region: str | None = None
    kms_endpoint: str | None = None
    # Azure and GCP: a file holding a bearer token, read at each use, instead of the pod's
    # workload identity (Azure: Entra with the federated token; GCP: the metadata server).
    kms_token_file: str | None = None
    kms_azure_wrap_algorithm: str = "RSA-OAEP-256"  # or A256KW (Managed HSM)
    kms_azure_authority_host: str = "https://login.microsoftonline.com"
    kms_azure_tenant_id: str | None = None
    kms_azure_client_id: str | None = None
    kms_azure_federated_token_file: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> KeyServiceSettings:
        env = Env(environ)
        port = env.integer("HERMIT_KEY_SERVICE_PORT", 0, minimum=0, maximum=65535)
        if not port:
            return cls()
        raw = env.text("HERMIT_KEY_SERVICE_CALLERS")
        callers = tuple(dict.fromkeys(c.strip() for c in raw.split(",") if c.strip()))
        if not callers or not all(c.startswith("system:serviceaccount:") and
                                  c.count(":") == 3 for c in callers):
            raise SettingsError(f"HERMIT_KEY_SERVICE_CALLERS={raw!r} must list service-account "
                                "usernames (system:serviceaccount:NAMESPACE:NAME, comma "
                                "separated)")
        kms = _kms_settings(env)
        return cls(port=port,
                   keys_dir=None if kms else env.text("HERMIT_SEAL_KEYS_DIR"),
                   tls_cert_file=env.text("HERMIT_KEY_SERVICE_TLS_CERT_FILE"),
                   tls_key_file=env.text("HERMIT_KEY_SERVICE_TLS_KEY_FILE"),
                   callers=callers,
                   audience=env.text("HERMIT_KEY_SERVICE_AUDIENCE", KEY_SERVICE_AUDIENCE),
                   **_store_credential_settings(env), **kms)


@dataclass(frozen=True)
class SigWebhookSettings:
    """The mutating admission webhook for opted-in SIG Sandbox pods (docs/agent-sandbox.md,
    "Opting a Sandbox in"), served over TLS by every operator replica."""

    port: int = 0  # 0: off
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # The MutatingWebhookConfiguration whose caBundle the operator keeps equal to ca_file
    # (the chart's self-signed CA); None: someone else sets it (cert-manager's cainjector).
    configuration: str | None = None
    ca_file: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SigWebhookSettings:
        env = Env(environ)
        port = env.integer("HERMIT_SIG_WEBHOOK_PORT", 0, minimum=0, maximum=65535)
        if not port:
            return cls()
        configuration = env.optional_str("HERMIT_SIG_WEBHOOK_CONFIGURATION")
        return cls(port=port, tls_cert_file=env.text("HERMIT_SIG_WEBHOOK_TLS_CERT_FILE"),
                   tls_key_file=env.text("HERMIT_SIG_WEBHOOK_TLS_KEY_FILE"),
                   configuration=configuration,
                   ca_file=env.text("HERMIT_SIG_WEBHOOK_CA_FILE") if configuration else None)


_KMS_KEY_RE: Final = re.compile(r"^[A-Za-z0-9:/_.+=@-]{1,2048}$")
KMS_PROVIDERS: Final = ("aws", "azure", "gcp")
_AZURE_KEY_RE: Final = re.compile(r"^https://[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?/keys/"
                                  r"[0-9A-Za-z-]{1,127}(/[0-9A-Fa-f]{32})?/?$")
_GCP_SEG: Final = r"[A-Za-z0-9_-]{1,63}"
_GCP_KEY_RE: Final = re.compile(rf"^projects/[a-z][a-z0-9.:-]{{0,62}}/locations/"
                                rf"[a-z0-9-]{{1,63}}/keyRings/{_GCP_SEG}/cryptoKeys/{_GCP_SEG}$")
_GCP_MAC_KEY_RE: Final = re.compile(_GCP_KEY_RE.pattern[:-1] +
                                    r"/cryptoKeyVersions/[0-9]{1,10}$")
_KMS_KEY_FORMS: Final = {
    "aws": (_KMS_KEY_RE, "a KMS key id, ARN or alias", _KMS_KEY_RE),
    "azure": (_AZURE_KEY_RE, "a Key Vault key URL (https://VAULT.vault.azure.net/keys/NAME"
              "[/VERSION])", None),
    "gcp": (_GCP_KEY_RE, "a Cloud KMS CryptoKey (projects/P/locations/L/keyRings/R/"
            "cryptoKeys/K; its MAC key: .../cryptoKeyVersions/N)", _GCP_MAC_KEY_RE)}


def _kms_settings(env: Env) -> dict[str, Any]:
    """HERMIT_SEAL_KMS_*: empty when the keys come from HERMIT_SEAL_KEYS_DIR."""
    key = env.optional_str("HERMIT_SEAL_KMS_KEY_ID")
    if key is None:
        return {}
    if env.optional_str("HERMIT_SEAL_KEYS_DIR") is not None:
        raise SettingsError("HERMIT_SEAL_KMS_KEY_ID and HERMIT_SEAL_KEYS_DIR are both set: "
                            "the key-encryption keys come from one of them")
    provider = env.choice("HERMIT_SEAL_KMS_PROVIDER", "aws", KMS_PROVIDERS)
    out: dict[str, Any] = {"kms_provider": provider, "kms_key_id": key,
                           "kms_mac_key_id": env.optional_str("HERMIT_SEAL_KMS_MAC_KEY_ID"),
                           "kms_region": env.optional_str("HERMIT_SEAL_KMS_REGION"),
                           "kms_endpoint": env.optional_url("HERMIT_SEAL_KMS_ENDPOINT"),
                           "kms_token_file": env.optional_str("HERMIT_SEAL_KMS_TOKEN_FILE")}
    key_re, form, mac_re = _KMS_KEY_FORMS[provider]
    for name, value, pattern in (("HERMIT_SEAL_KMS_KEY_ID", key, key_re),
                                 ("HERMIT_SEAL_KMS_MAC_KEY_ID", out["kms_mac_key_id"], mac_re)):
        if value is None:
            continue
        if pattern is None:
            raise SettingsError(f"{name} is not used with HERMIT_SEAL_KMS_PROVIDER={provider}"
                                " (the wrapping key signs)")
        if not pattern.match(value):
            raise SettingsError(f"{name}={value!r:.200} is not {form} "
                                f"(HERMIT_SEAL_KMS_PROVIDER={provider})")
    unused = {"aws": ("HERMIT_SEAL_KMS_TOKEN_FILE",),
              "azure": ("HERMIT_SEAL_KMS_REGION", "HERMIT_SEAL_KMS_ENDPOINT"),
              "gcp": ("HERMIT_SEAL_KMS_REGION",)}[provider]
    for name in unused:
        if env.optional_str(name) is not None:
            raise SettingsError(f"{name} is not used with HERMIT_SEAL_KMS_PROVIDER={provider}")
    if provider == "azure":
        out.update(_azure_kms_settings(env, token_file=out["kms_token_file"]))
    return out


def _azure_kms_settings(env: Env, *, token_file: str | None) -> dict[str, Any]:
    """Key Vault's wrap algorithm, and the workload identity that the Azure Workload
    Identity webhook injects (AZURE_*), needed unless HERMIT_SEAL_KMS_TOKEN_FILE is set."""
    out: dict[str, Any] = {
        "kms_azure_wrap_algorithm": env.choice("HERMIT_SEAL_KMS_AZURE_WRAP_ALGORITHM",
                                               "RSA-OAEP-256", ("RSA-OAEP-256", "A256KW")),
        "kms_azure_authority_host": env.url("AZURE_AUTHORITY_HOST",
                                            "https://login.microsoftonline.com"),
        "kms_azure_tenant_id": env.optional_str("AZURE_TENANT_ID"),
        "kms_azure_client_id": env.optional_str("AZURE_CLIENT_ID"),
        "kms_azure_federated_token_file": env.optional_str("AZURE_FEDERATED_TOKEN_FILE")}
    missing = [name for name in ("AZURE_CLIENT_ID", "AZURE_TENANT_ID",
                                 "AZURE_FEDERATED_TOKEN_FILE")
               if out["kms_azure_" + name[6:].lower()] is None]
    if missing and token_file is None:
        raise SettingsError(f"HERMIT_SEAL_KMS_PROVIDER=azure needs the pod's workload "
                            f"identity ({', '.join(missing)} unset: label the operator's pod "
                            "azure.workload.identity/use=true and annotate its service "
                            "account with the client id) or HERMIT_SEAL_KMS_TOKEN_FILE")
    tenant = out["kms_azure_tenant_id"]
    if tenant is not None and not re.match(r"^[A-Za-z0-9.-]{1,100}$", tenant):
        raise SettingsError(f"AZURE_TENANT_ID={tenant!r:.100} is not a tenant id or domain")
    return out


def _store_credential_settings(env: Env) -> dict[str, Any]:
    enabled = env.flag("HERMIT_KEY_SERVICE_STORE_CREDENTIALS", False)
    role = env.optional_str("HERMIT_KEY_SERVICE_STORE_ROLE_ARN")
    if enabled and env.optional_str("HERMIT_S3_BUCKET") is None:
        raise SettingsError("HERMIT_KEY_SERVICE_STORE_CREDENTIALS=true needs the store "
                            "(HERMIT_S3_BUCKET and the operator's credentials for it)")
    if enabled and role is None and env.optional_str("HERMIT_S3_ENDPOINT") is None:
        raise SettingsError("HERMIT_KEY_SERVICE_STORE_ROLE_ARN must name the IAM role to "
                            "assume for scoped store credentials on AWS S3 "
                            "(docs/storage.md#scoped-store-credentials)")
    modes = SANDBOX_STORE_CREDENTIAL_MODES
    mode = env.text("HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS", "off")
    if mode not in modes:
        raise SettingsError(f"HERMIT_KEY_SERVICE_SANDBOX_STORE_CREDENTIALS={mode!r:.40} must "
                            f"be one of {', '.join(modes)}")
    return {"store_credentials": enabled, "store_role_arn": role,
            "sandbox_store_credentials": mode,
            "store_credentials_seconds": env.integer(
                "HERMIT_KEY_SERVICE_STORE_CREDENTIALS_SECONDS", 3600, minimum=900,
                maximum=3600)}


@dataclass(frozen=True)
class WatcherSettings:
    """Which interruption notices the node-agent watches, and where."""

    provider: str = "aws"  # aws | gcp | azure | none
    aws_imds_url: str = "http://169.254.169.254"
    gcp_metadata_url: str = "http://metadata.google.internal"
    azure_metadata_url: str = "http://169.254.169.254"
    poll_interval_seconds: float = 1.0
    request_timeout_seconds: float = 2.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WatcherSettings:
        env = Env(environ)
        return cls(
            provider=env.choice("HERMIT_CLOUD_PROVIDER", "aws", ("aws", "gcp", "azure", "none")),
            aws_imds_url=env.url("HERMIT_AWS_IMDS_URL", "http://169.254.169.254"),
            gcp_metadata_url=env.url("HERMIT_GCP_METADATA_URL", "http://metadata.google.internal"),
            azure_metadata_url=env.url("HERMIT_AZURE_METADATA_URL", "http://169.254.169.254"),
            poll_interval_seconds=env.number(
                "HERMIT_POLL_INTERVAL_SECONDS", 1.0, minimum=0.1, maximum=2.0),
            request_timeout_seconds=env.number(
                "HERMIT_METADATA_TIMEOUT_SECONDS", 2.0, minimum=0.1, maximum=30.0),
        )


# The turn endpoint's default audience: a token for it is good for nothing else (and a
# token the API server accepts is refused there). HERMIT_TURN_AUDIENCE=@api-server opts
# out: the API server's own audiences (a pod's default token works, sent in clear text
# unless TLS is on).
TURN_AUDIENCE = "hermit.dev/turns"
TURN_AUDIENCE_API_SERVER = "@api-server"


@dataclass(frozen=True)
class NodeSettings:
    """Everything the node-agent needs, built once at start-up."""

    node_name: str
    store: StoreSettings
    watcher: WatcherSettings
    criu_path: str = "criu"
    work_dir: str = "/var/lib/hermit"
    # Where the node's cgroup filesystem is mounted in the node-agent (the chart mounts
    # the host's at the same path); a cgroup2 mount here makes the node a v2 node.
    cgroup_root: str = "/sys/fs/cgroup"
    metrics_port: int = 9101
    log_level: str = "INFO"
    log_format: str = "text"  # HERMIT_LOG_FORMAT: text or json (logformat.py)
    # How often, at the least, the watched copy of the node's pods and Checkpoints is
    # looked at (a change wakes the loop at once).
    reconcile_interval_seconds: float = 2.0
    max_frozen_seconds: float = 60.0  # a routine checkpoint thaws the sandbox by then
    # Honour spec.checkpoint.storage (a sandbox's own bucket and Secret); off: only the
    # default store above is used and no Secret is ever read.
    per_sandbox_storage: bool = False
    # Reach the default store only with credentials the key service vends per sandbox
    # prefix (docs/storage.md#scoped-store-credentials): no bucket-wide credential.
    scoped_store_credentials: bool = False
    seal: SealSettings = SealSettings()
    # S3 garbage collection after each routine checkpoint (docs/storage.md): nothing
    # younger than the minimum age is deleted (longer than any upload takes).
    gc_enabled: bool = True
    gc_min_age_seconds: float = 3600.0
    # A routine (Interval, Manual, Turn) checkpoint's upload gives up after this long; a
    # notice's deadline bounds the stopping ones.
    routine_upload_seconds: float = 900.0
    # The node's upload bandwidth for checkpoints, shared by all of them (bandwidth.py;
    # docs/storage.md#upload-bandwidth); 0: unlimited. Either way a notice's (or a
    # drain's) stopping upload holds routine ones back while it runs.
    upload_bandwidth_bytes_per_second: int = 0
    # The turn endpoint (docs/turns.md): its port (0: not served), and the audience a
    # caller's token must carry (Hermit's own by default; "" only when HERMIT_TURN_AUDIENCE
    # is TURN_AUDIENCE_API_SERVER: the API server's own audiences, a pod's default token).
    # With a certificate and key (both or neither) it serves TLS.
    turn_port: int = 9103
    turn_audience: str = TURN_AUDIENCE
    turn_tls_cert_file: str | None = None
    turn_tls_key_file: str | None = None
    # Restore lazily (docs/criu.md#lazy-restore): the tree runs while CRIU's lazy-pages
    # daemon copies its memory in; a node without userfaultfd restores fully.
    lazy_restore: bool = False
    # The node-local chunk cache under <work_dir>/chunk-cache (docs/storage.md#prefetch-
    # and-the-chunk-cache): its size bound; 0 turns the cache and the prefetch off.
    chunk_cache_bytes: int = 0  # off: the prefetch competes with the old node (storage.md)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> NodeSettings:
        env = Env(environ)
        tls = _turn_tls(env)
        return cls(
            node_name=env.text("HERMIT_NODE_NAME"),
            store=StoreSettings.from_env(environ),
            watcher=WatcherSettings.from_env(environ),
            criu_path=env.text("HERMIT_CRIU_PATH", "criu"),
            work_dir=env.text("HERMIT_WORK_DIR", "/var/lib/hermit"),
            cgroup_root=env.text("HERMIT_CGROUP_ROOT", "/sys/fs/cgroup"),
            metrics_port=env.integer("HERMIT_METRICS_PORT", 9101, minimum=1, maximum=65535),
            log_level=env.choice(
                "HERMIT_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR")),
            log_format=env.choice("HERMIT_LOG_FORMAT", logformat.TEXT, logformat.FORMATS),
            reconcile_interval_seconds=env.number(
                "HERMIT_RECONCILE_INTERVAL_SECONDS", 2.0, minimum=0.1, maximum=300.0),
            max_frozen_seconds=env.number(
                "HERMIT_MAX_FROZEN_SECONDS", 60.0, minimum=1.0, maximum=3600.0),
            per_sandbox_storage=env.flag("HERMIT_PER_SANDBOX_STORAGE", False),
            scoped_store_credentials=_scoped_store_credentials(env, environ),
            seal=SealSettings.from_env(environ),
            gc_enabled=env.flag("HERMIT_GC_ENABLED", True),
            gc_min_age_seconds=env.number(
                "HERMIT_GC_MIN_AGE_SECONDS", 3600.0, minimum=0.0, maximum=30 * 86400.0),
            routine_upload_seconds=env.number(
                "HERMIT_ROUTINE_UPLOAD_SECONDS", 900.0, minimum=10.0, maximum=86400.0),
            upload_bandwidth_bytes_per_second=_bandwidth(
                env, "HERMIT_UPLOAD_BANDWIDTH_BYTES_PER_SECOND"),
            turn_port=env.integer("HERMIT_TURN_PORT", 9103, minimum=0, maximum=65535),
            turn_audience=_turn_audience(env),
            turn_tls_cert_file=tls[0],
            turn_tls_key_file=tls[1],
            lazy_restore=env.flag("HERMIT_LAZY_RESTORE", False),
            chunk_cache_bytes=env.integer("HERMIT_CHUNK_CACHE_BYTES", 0,
                                          minimum=0, maximum=1024 ** 5),
        )


def _turn_audience(env: Env) -> str:
    value = env.text("HERMIT_TURN_AUDIENCE", TURN_AUDIENCE)
    if value == TURN_AUDIENCE_API_SERVER:
        return ""
    if value.startswith("@") or any(c.isspace() for c in value):
        raise SettingsError(f"HERMIT_TURN_AUDIENCE={value!r} is not an audience (or "
                            f"{TURN_AUDIENCE_API_SERVER} for the API server's own)")
    return value


def _scoped_store_credentials(env: Env, environ: Mapping[str, str]) -> bool:
    scoped = env.flag("HERMIT_S3_SCOPED_CREDENTIALS", False)
    if scoped and SealSettings.from_env(environ).key_service_url is None:
        raise SettingsError("HERMIT_S3_SCOPED_CREDENTIALS=true needs the key service "
                            "(HERMIT_SEAL_KEY_SERVICE_URL): it vends them")
    if scoped and env.optional_str("HERMIT_S3_ACCESS_KEY_ID") is not None:
        raise SettingsError("HERMIT_S3_SCOPED_CREDENTIALS=true and HERMIT_S3_ACCESS_KEY_ID "
                            "are both set: with scoped credentials a node-agent holds no "
                            "bucket-wide credential")
    return scoped


def _turn_tls(env: Env) -> tuple[str | None, str | None]:
    cert = env.optional_str("HERMIT_TURN_TLS_CERT_FILE")
    key = env.optional_str("HERMIT_TURN_TLS_KEY_FILE")
    if (cert is None) != (key is None):
        raise SettingsError("HERMIT_TURN_TLS_CERT_FILE and HERMIT_TURN_TLS_KEY_FILE go "
                            "together: set both (TLS) or neither (plain HTTP)")
    return cert, key


# An upload bandwidth below this would take seconds per chunk: a typo, not a choice.
MIN_UPLOAD_BANDWIDTH = 1024 * 1024
MAX_UPLOAD_BANDWIDTH = 100 * 1000 ** 3  # 800 Gbit/s


def _bandwidth(env: Env, name: str) -> int:
    """Bytes per second: 0 (unlimited) or between 1 MiB/s and 100 GB/s."""
    value = env.integer(name, 0, minimum=0, maximum=MAX_UPLOAD_BANDWIDTH)
    if 0 < value < MIN_UPLOAD_BANDWIDTH:
        raise SettingsError(
            f"{name}={value} is below the minimum {MIN_UPLOAD_BANDWIDTH} (1 MiB/s); "
            "0 means unlimited")
    return value


DEFAULT_HERMIT_IMAGE = "hermit.local/hermit:dev"
# The small image that carries only the static hermit-init (hack/images/build init): what
# sandbox pods' init container runs (`hermit-init --install`), instead of the whole
# node-agent image.
DEFAULT_INIT_IMAGE = "hermit.local/init:dev"
DEFAULT_INIT_PATH = "/usr/local/bin/hermit-init"
_IMAGE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _image_ref(env: Env, name: str, default: str) -> str:
    """An image reference ([registry/]repository[:tag][@sha256:...]): non-empty, no
    whitespace, and a well-formed digest when pinned by one."""
    ref = env.text(name, default).strip()
    if not ref or any(c.isspace() for c in ref):
        raise SettingsError(f"{name}={ref!r} is not an image reference")
    if "@" in ref:
        repo, _, digest = ref.partition("@")
        if not repo or not _IMAGE_DIGEST.fullmatch(digest):
            raise SettingsError(
                f"{name}={ref!r}: a pinned image is REPOSITORY@sha256:<64 hex digits>")
    return ref

# Exemptions from the sandbox pod policy (operator/hermit_operator/podpolicy.py) that a
# cluster admin may grant with HERMIT_POD_POLICY_ALLOW.
ALLOW_PRIVILEGED = "privileged"
ALLOW_HOST_NAMESPACES = "hostNamespaces"
ALLOW_HOST_PATH = "hostPath"
ALLOW_HOST_PORTS = "hostPorts"
ALLOW_NODE_NAME = "nodeName"
ALLOW_PROC_MOUNT = "procMount"
ALLOW_UNCONFINED = "unconfinedProfiles"
ALLOW_UNSAFE_SYSCTLS = "unsafeSysctls"
ALLOW_PLACEMENT = "placement"  # template fields that take a sandbox off spot nodes
POD_POLICY_EXEMPTIONS = (ALLOW_PRIVILEGED, ALLOW_HOST_NAMESPACES, ALLOW_HOST_PATH,
                         ALLOW_HOST_PORTS, ALLOW_NODE_NAME, ALLOW_PROC_MOUNT, ALLOW_UNCONFINED,
                         ALLOW_UNSAFE_SYSCTLS, ALLOW_PLACEMENT)
# The Pod Security Standard a sandbox pod must meet (HERMIT_POD_POLICY_PROFILE).
PROFILE_RESTRICTED = "restricted"
PROFILE_BASELINE = "baseline"
POD_POLICY_PROFILES = (PROFILE_RESTRICTED, PROFILE_BASELINE)


@dataclass(frozen=True)
class PodPolicySettings:
    """What sandbox pod templates may ask for (default: the "restricted" Pod Security
    Standard, the namespace's default ServiceAccount, no Secrets, spot nodes only)."""

    allow: frozenset[str] = frozenset()  # names from POD_POLICY_EXEMPTIONS
    extra_capabilities: frozenset[str] = frozenset()  # beyond the profile's set, e.g. SYS_PTRACE
    profile: str = PROFILE_RESTRICTED  # one of POD_POLICY_PROFILES
    # ServiceAccounts a template may name: "name" (any namespace) or "namespace/name".
    service_accounts: frozenset[str] = frozenset()
    # Namespaces whose sandboxes may use Secrets (volumes, projected tokens, env).
    secret_namespaces: frozenset[str] = frozenset()

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PodPolicySettings:
        env = Env(environ)
        allow = _names(env.optional_str("HERMIT_POD_POLICY_ALLOW"))
        unknown = sorted(allow - set(POD_POLICY_EXEMPTIONS))
        if unknown:
            raise SettingsError(
                f"HERMIT_POD_POLICY_ALLOW: unknown exemption(s) {', '.join(unknown)}; "
                f"known: {', '.join(POD_POLICY_EXEMPTIONS)}")
        caps = frozenset(c.upper().removeprefix("CAP_") for c in
                         _names(env.optional_str("HERMIT_POD_POLICY_CAPABILITIES")))
        bad = sorted(c for c in caps if not c.replace("_", "").isalnum())
        if bad:
            raise SettingsError(f"HERMIT_POD_POLICY_CAPABILITIES: {', '.join(bad)} "
                                "are not capability names (e.g. SYS_PTRACE,NET_ADMIN)")
        accounts = _names(env.optional_str("HERMIT_POD_POLICY_SERVICE_ACCOUNTS"))
        bad = sorted(a for a in accounts if not _account_entry(a))
        if bad:
            raise SettingsError(f"HERMIT_POD_POLICY_SERVICE_ACCOUNTS: {', '.join(bad)} "
                                "are not ServiceAccount names (name or namespace/name)")
        namespaces = _names(env.optional_str("HERMIT_POD_POLICY_SECRET_NAMESPACES"))
        bad = sorted(n for n in namespaces if not _DNS_LABEL.fullmatch(n))
        if bad:
            raise SettingsError(f"HERMIT_POD_POLICY_SECRET_NAMESPACES: {', '.join(bad)} "
                                "are not namespace names")
        return cls(allow=allow, extra_capabilities=caps,
                   profile=env.choice("HERMIT_POD_POLICY_PROFILE", PROFILE_RESTRICTED,
                                      POD_POLICY_PROFILES),
                   service_accounts=accounts, secret_namespaces=namespaces)


_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # e.g. a ServiceAccount
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # e.g. a namespace


def _account_entry(entry: str) -> bool:
    """A ServiceAccount name, or namespace/name."""
    namespace, _, name = entry.rpartition("/")
    return bool(_DNS_NAME.fullmatch(name)) and (
        (not namespace and "/" not in entry) or bool(_DNS_LABEL.fullmatch(namespace)))


def _names(raw: str | None) -> frozenset[str]:
    """A comma-separated list, blanks dropped."""
    return frozenset(n.strip() for n in (raw or "").split(",") if n.strip())


@dataclass(frozen=True)
class OperatorSettings:
    """Everything the operator needs, built once at start-up."""

    watch_namespaces: tuple[str, ...] = ()  # empty: every namespace (cluster-wide)
    peering_name: str | None = None  # None: standalone (no kopf peering)
    metrics_port: int = 9102
    log_level: str = "INFO"
    log_format: str = "text"  # HERMIT_LOG_FORMAT: text or json (logformat.py)
    init_image: str = DEFAULT_INIT_IMAGE  # the image holding the static hermit-init
    init_path: str = DEFAULT_INIT_PATH  # hermit-init's path inside init_image
    init_pull_policy: str = "IfNotPresent"  # the sandbox pods' init container's pull policy
    store: StoreSettings | None = None  # None: no default checkpoint store configured
    # One active replica: the holder of a Lease in the operator's own namespace.
    leader_election: bool = False
    lease_name: str = "hermit-operator"
    namespace: str | None = None  # the operator pod's namespace (downward API)
    identity: str = "hermit-operator"  # this replica's name in the Lease (its pod name)
    pod_policy: PodPolicySettings = PodPolicySettings()
    # A move's replacement pod is created at the notice, while the old pod is being
    # checkpointed (its init waits for the checkpoint); False: once it is Completed.
    overlap_moves: bool = True
    # Every sandbox is looked at again this often, a safety net behind the watches: one
    # whose inputs did not change since it was last reconciled costs nothing.
    resync_seconds: float = 600.0
    key_service: KeyServiceSettings = KeyServiceSettings()
    sig_webhook: SigWebhookSettings = SigWebhookSettings()
    # Evictions (drains, autoscalers) are allowed; each sandbox container gets a preStop
    # hook that sleeps for the pod's grace period (termination_grace_seconds unless the
    # template sets one), holding its termination while the node-agent takes its Eviction
    # checkpoint; the operator's own deletes cut it short. False: no hook.
    termination_hold: bool = True
    termination_grace_seconds: int = 120
    # Opt-in: also give each sandbox a PodDisruptionBudget (maxUnavailable 0) that refuses
    # evictions, as before the hold existed; autoscalers then never empty its node.
    disruption_budget: bool = False
    # Sandbox pods require a node whose node-agent is ready (its protocol.LABEL_NODE_AGENT
    # label) in every required node selector term; False: any node the placement allows.
    require_ready_node_agent: bool = True

    @property
    def clusterwide(self) -> bool:
        return not self.watch_namespaces

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> OperatorSettings:
        env = Env(environ)
        namespaces = _watch_namespaces(env.optional_str("HERMIT_WATCH_NAMESPACE"))
        init_path = env.text("HERMIT_INIT_PATH", DEFAULT_INIT_PATH)
        if not init_path.startswith("/"):
            raise SettingsError(f"HERMIT_INIT_PATH={init_path!r} is not an absolute path")
        store = (StoreSettings.from_env(environ)
                 if env.optional_str("HERMIT_S3_BUCKET") is not None else None)
        return cls(
            watch_namespaces=namespaces,
            peering_name=env.optional_str("HERMIT_PEERING_NAME"),
            metrics_port=env.integer("HERMIT_METRICS_PORT", 9102, minimum=1, maximum=65535),
            log_level=env.choice(
                "HERMIT_LOG_LEVEL", "INFO", ("DEBUG", "INFO", "WARNING", "ERROR")),
            log_format=env.choice("HERMIT_LOG_FORMAT", logformat.TEXT, logformat.FORMATS),
            init_image=_image_ref(env, "HERMIT_INIT_IMAGE", DEFAULT_INIT_IMAGE),
            init_path=init_path,
            init_pull_policy=env.choice("HERMIT_INIT_PULL_POLICY", "IfNotPresent",
                                        ("Always", "IfNotPresent", "Never")),
            store=store,
            pod_policy=PodPolicySettings.from_env(environ),
            overlap_moves=env.flag("HERMIT_OVERLAP_MOVES", True),
            resync_seconds=env.number("HERMIT_RESYNC_SECONDS", 600.0, minimum=10.0,
                                      maximum=86400.0),
            key_service=KeyServiceSettings.from_env(environ),
            sig_webhook=SigWebhookSettings.from_env(environ),
            termination_hold=env.flag("HERMIT_TERMINATION_HOLD", True),
            termination_grace_seconds=env.integer(
                "HERMIT_TERMINATION_GRACE_SECONDS", 120, minimum=1, maximum=3600),
            disruption_budget=env.flag("HERMIT_DISRUPTION_BUDGET", False),
            require_ready_node_agent=env.flag("HERMIT_REQUIRE_READY_NODE_AGENT", True),
            **_leader_settings(env),
        )


def _watch_namespaces(raw: str | None) -> tuple[str, ...]:
    """HERMIT_WATCH_NAMESPACE: comma-separated namespace names, in order, once each; the
    chart grants the operator's namespaced rights in these only (operator.watchNamespaces)."""
    names = tuple(dict.fromkeys(n.strip() for n in (raw or "").split(",") if n.strip()))
    bad = [n for n in names if not _DNS_LABEL.fullmatch(n)]
    if bad:
        raise SettingsError(f"HERMIT_WATCH_NAMESPACE: {', '.join(map(repr, bad))} not "
                            "namespace names (DNS-1123 labels: a-z, 0-9 and '-', at most 63)")
    return names


def _leader_settings(env: Env) -> dict[str, Any]:
    enabled = env.flag("HERMIT_LEADER_ELECTION", False)
    namespace = env.optional_str("HERMIT_NAMESPACE")
    if enabled and namespace is None:
        raise SettingsError("HERMIT_NAMESPACE must name the operator's namespace when "
                            "HERMIT_LEADER_ELECTION is true (the Lease lives there)")
    return {"leader_election": enabled,
            "lease_name": env.text("HERMIT_LEADER_ELECTION_LEASE", "hermit-operator"),
            "namespace": namespace,
            "identity": env.optional_str("HERMIT_POD_NAME") or socket.gethostname()}


_SECRET_FIELDS = {"secret_access_key", "access_key_id", "session_token"}


def redacted(settings: object) -> dict[str, object]:
    """A dict of the settings with credentials masked, for the start-up log line."""
    if not dataclasses.is_dataclass(settings) or isinstance(settings, type):
        raise TypeError("redacted() takes a settings dataclass instance")
    out: dict[str, object] = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[field.name] = redacted(value)
        elif field.name in _SECRET_FIELDS and value is not None:
            out[field.name] = "***"
        else:
            out[field.name] = value
    return out
