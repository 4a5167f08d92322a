"""The sandbox pod policy: what a pod template may ask for, as pure functions.

The operator creates every sandbox pod itself, so without a policy anyone allowed to create
an AgentSandbox would get any pod the namespace's admission lets the *operator* create (a
confused deputy): any ServiceAccount, any Secret of the namespace, any node. By default a
template must meet the Kubernetes Pod Security Standard "restricted" (``baseline`` with
``HERMIT_POD_POLICY_PROFILE``), may not pick its node with ``nodeName`` nor leave spot nodes
through its own nodeSelector, node affinity or tolerations, may name no ServiceAccount but
the namespace's ``default`` (or an allow-listed one), and may use no Secret (unless its
namespace is listed). Some rules have no exemption because the capture depends on them:
only the sandbox's own container sees Hermit's volumes, and no process namespace is shared.
A cluster admin loosens the rest one by one (``HERMIT_POD_POLICY_*``); see docs/security.md.

``violations`` lists what a template breaks; ``secure_defaults`` fills, in the pod the
operator builds, the fields the template left unset with the compliant value.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from hermit_common import protocol
from hermit_common.protocol import KubeObject
from hermit_common.settings import (
    ALLOW_HOST_NAMESPACES,
    ALLOW_HOST_PATH,
    ALLOW_HOST_PORTS,
    ALLOW_NODE_NAME,
    ALLOW_PLACEMENT,
    ALLOW_PRIVILEGED,
    ALLOW_PROC_MOUNT,
    ALLOW_UNCONFINED,
    ALLOW_UNSAFE_SYSCTLS,
    PROFILE_RESTRICTED,
    PodPolicySettings,
)

# Hermit's own volumes and init container (podspec.py adds them): the workspace the
# node-agent copies from the host, and the emptyDir hermit-init is copied into.
INIT_VOLUME = "hermit-init"
WORKSPACE_VOLUME = "hermit-workspace"
HERMIT_VOLUMES = (INIT_VOLUME, WORKSPACE_VOLUME)
INIT_CONTAINER = "hermit-init"

# The labels by which the usual provisioners mark spot (preemptible) nodes, with their spot
# value (podspec.py requires one of them; a template may not exclude them).
SPOT_NODE_LABELS: tuple[tuple[str, str], ...] = (
    ("karpenter.sh/capacity-type", "spot"),             # Karpenter, any cloud
    ("eks.amazonaws.com/capacityType", "SPOT"),         # EKS managed node groups
    ("cloud.google.com/gke-spot", "true"),              # GKE Spot VMs
    ("cloud.google.com/gke-provisioning", "spot"),      # GKE (node auto-provisioning, ...)
    ("kubernetes.azure.com/scalesetpriority", "spot"),  # AKS spot node pools
)
# Taints that keep pods off nodes that are going away or broken; a sandbox must respect
# them or it lands (and stays) where its next checkpoint cannot be taken. Tolerating
# Hermit's interruption taint is refused with no exemption (the protocol depends on it).
NODE_HEALTH_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable",
                      "node.kubernetes.io/unschedulable")

# The capabilities the baseline Pod Security Standard lets a container add.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# The only one the restricted standard lets a container add.
RESTRICTED_CAPABILITIES = frozenset({"NET_BIND_SERVICE"})
# The volume types the restricted standard allows (hostPath has its own rule).
RESTRICTED_VOLUME_TYPES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
    "projected", "secret"})
# The sysctls Kubernetes calls safe (namespaced, no effect outside the pod).
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"})
HOST_NAMESPACE_FIELDS = ("hostNetwork", "hostPID", "hostIPC")
# The user and group a restricted sandbox runs as when its template names none: a sandbox
# image commonly has no USER (root), which runAsNonRoot alone would refuse to start. Its
# workspace and init emptyDirs are world-writable, so the workload can write there.
DEFAULT_USER = 65532
DEFAULT_GROUP = 65532
DEFAULT_SERVICE_ACCOUNT = "default"
_TEMPLATE = "spec.podTemplate.spec"
_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")

# The "exemption" of a rule: the chart value that allows it, or why nothing does.
CAPABILITIES = "capabilities"
PROFILE = "profile"
SERVICE_ACCOUNTS = "serviceAccounts"
SECRET_NAMESPACES = "secretNamespaces"
NO_EXEMPTION_VOLUMES = "no exemption: the node-agent copies these volumes while only the " \
    "sandbox's container is frozen"
NO_EXEMPTION_PID = "no exemption: the capture freezes and dumps only the sandbox's container"
NO_EXEMPTION_INTERRUPTION = "no exemption: Hermit moves sandboxes off nodes with this taint"
_NONE = (NO_EXEMPTION_VOLUMES, NO_EXEMPTION_PID, NO_EXEMPTION_INTERRUPTION)
# A finding: (field path, what is wrong, exemption key, the value to name in the message).
Finding = tuple[str, str, str, str]


def violations(pod_spec: KubeObject, policy: PodPolicySettings, *, namespace: str = "",
               placement: KubeObject | None = None) -> list[str]:
    """Every way ``pod_spec`` (an AgentSandbox's podTemplate.spec in ``namespace``, with its
    spec.placement) breaks ``policy``, each as '<field path>: <what is wrong> (<how an admin
    allows it, or why nothing does>)'; empty when it complies."""
    found: list[Finding] = [*_hermit_volumes(pod_spec), *_pod_level(pod_spec),
                            *_volumes(pod_spec),
                            *_service_account(pod_spec, policy, namespace),
                            *_placement(pod_spec, placement or {})]
    for path, container in _containers(pod_spec):
        found.extend(_container(path, container, policy))
    return [f"{path}: {what} ({_how_to_allow(key, value, namespace)})"
            for path, what, key, value in found if not _exempt(policy, key, value, namespace)]


def _exempt(policy: PodPolicySettings, key: str, value: str, namespace: str) -> bool:
    if key in _NONE:
        return False
    if key == PROFILE:
        return policy.profile != PROFILE_RESTRICTED
    if key == CAPABILITIES:
        return False  # the allowed set is applied where the capabilities are read
    if key == SERVICE_ACCOUNTS:
        return service_account_allowed(policy, namespace, value)
    if key == SECRET_NAMESPACES:
        return namespace in policy.secret_namespaces
    return key in policy.allow


def _how_to_allow(key: str, value: str, namespace: str) -> str:
    if key in _NONE:
        return key
    if key == PROFILE:
        return "allowed by operator.podPolicy.profile: baseline"
    if key == CAPABILITIES:
        return f"allowed by operator.podPolicy.extraCapabilities: [{value}]"
    if key == SERVICE_ACCOUNTS:  # the narrowest entry: this account in this namespace
        entry = f"{namespace}/{value}" if namespace else value
        return f"allowed by operator.podPolicy.serviceAccounts: [{entry}]"
    if key == SECRET_NAMESPACES:
        return f"allowed by operator.podPolicy.secretNamespaces: [{namespace}]"
    return f"allowed by operator.podPolicy.allow: [{key}]"


def describe(problems: list[str]) -> str:
    """The one message of an InvalidSpec for these violations."""
    return ("the pod template could escape the sandbox, which the operator's pod policy "
            "refuses: " + "; ".join(problems))


def service_account_allowed(policy: PodPolicySettings, namespace: str, name: str) -> bool:
    """Whether sandboxes of ``namespace`` may run as ServiceAccount ``name``."""
    return name in policy.service_accounts or f"{namespace}/{name}" in policy.service_accounts


def service_account_of(pod_spec: KubeObject) -> str:
    """The ServiceAccount a pod of this spec runs as (serviceAccount is the old alias)."""
    return str(pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount")
               or DEFAULT_SERVICE_ACCOUNT)


# -- Hermit's volumes and the process namespace (no exemption) ----------------------------

def _hermit_volumes(pod_spec: KubeObject) -> Iterator[Finding]:
    """Only Hermit mounts its volumes: into the first container and its own init container,
    both added by the pod builder. Any other mount would let a container the node-agent does
    not freeze change the workspace while it is copied (the symlink race of issue 17)."""
    for i, volume in enumerate(pod_spec.get("volumes") or []):
        name = (volume or {}).get("name")
        if name in HERMIT_VOLUMES:
            yield (f"{_TEMPLATE}.volumes[{i}].name", f"the volume name {name!r} is reserved "
                   "for Hermit", NO_EXEMPTION_VOLUMES, "")
    for path, container in _containers(pod_spec):
        for field in ("volumeMounts", "volumeDevices"):
            for j, mount in enumerate(container.get(field) or []):
                name = (mount or {}).get("name")
                if name in HERMIT_VOLUMES:
                    yield (f"{path}.{field}[{j}]", f"container {container.get('name')!r} "
                           f"mounts Hermit's volume {name!r}, which Hermit alone mounts, "
                           "into the sandbox's container", NO_EXEMPTION_VOLUMES, "")
    if pod_spec.get("shareProcessNamespace"):
        yield (f"{_TEMPLATE}.shareProcessNamespace", "a shared process namespace lets other "
               "containers reach the sandbox's processes and files", NO_EXEMPTION_PID, "")


# -- the Pod Security Standards -----------------------------------------------------------

def _pod_level(pod_spec: KubeObject) -> Iterator[Finding]:
    for name in HOST_NAMESPACE_FIELDS:
        if pod_spec.get(name):
            yield f"{_TEMPLATE}.{name}", "host namespaces are not allowed", \
                ALLOW_HOST_NAMESPACES, ""
    if pod_spec.get("nodeName"):
        yield (f"{_TEMPLATE}.nodeName", "a sandbox may not pick its node (use "
               "spec.placement)", ALLOW_NODE_NAME, "")
    context = pod_spec.get("securityContext") or {}
    path = f"{_TEMPLATE}.securityContext"
    yield from _profiles(path, context)
    yield from _user(path, context)
    for i, sysctl in enumerate(context.get("sysctls") or []):
        if (sysctl or {}).get("name") not in SAFE_SYSCTLS:
            yield (f"{path}.sysctls[{i}]",
                   f"sysctl {(sysctl or {}).get('name')!r} is not a safe sysctl",
                   ALLOW_UNSAFE_SYSCTLS, "")


def _volumes(pod_spec: KubeObject) -> Iterator[Finding]:
    for i, volume in enumerate(pod_spec.get("volumes") or []):
        volume = volume or {}
        path, name = f"{_TEMPLATE}.volumes[{i}]", volume.get("name")
        if volume.get("hostPath") is not None:
            yield f"{path}.hostPath", f"volume {name!r} mounts a host path", ALLOW_HOST_PATH, ""
        kinds = sorted(k for k, v in volume.items()
                       if k != "name" and isinstance(v, dict) and k != "hostPath")
        for kind in kinds:
            if kind not in RESTRICTED_VOLUME_TYPES:
                yield (f"{path}.{kind}", f"volume {name!r} is of type {kind}, which the "
                       "restricted profile does not allow", PROFILE, "")
            yield from _secret_sources(f"{path}.{kind}", name, kind, volume[kind])


def _container(path: str, container: KubeObject,
               policy: PodPolicySettings) -> Iterator[Finding]:
    context = container.get("securityContext") or {}
    if context.get("privileged"):
        yield (f"{path}.securityContext.privileged", "privileged containers are not allowed",
               ALLOW_PRIVILEGED, "")
    if context.get("allowPrivilegeEscalation") is True:
        yield (f"{path}.securityContext.allowPrivilegeEscalation", "privilege escalation "
               "(setuid binaries, file capabilities) is not allowed", PROFILE, "")
    restricted = policy.profile == PROFILE_RESTRICTED
    allowed = (RESTRICTED_CAPABILITIES if restricted else BASELINE_CAPABILITIES) \
        | policy.extra_capabilities
    added = [str(c).upper().removeprefix("CAP_")
             for c in (context.get("capabilities") or {}).get("add") or []]
    beyond = sorted(c for c in added if c not in allowed)
    if beyond:
        yield (f"{path}.securityContext.capabilities.add",
               f"capabilities {', '.join(beyond)} are beyond the allowed set of the "
               f"{policy.profile} profile",
               CAPABILITIES, ", ".join(beyond))
    if context.get("procMount") not in (None, "Default"):
        yield f"{path}.securityContext.procMount", "an unmasked /proc is not allowed", \
            ALLOW_PROC_MOUNT, ""
    yield from _profiles(f"{path}.securityContext", context)
    yield from _user(f"{path}.securityContext", context)
    for j, port in enumerate(container.get("ports") or []):
        if (port or {}).get("hostPort"):
            yield (f"{path}.ports[{j}].hostPort", "host ports are not allowed",
                   ALLOW_HOST_PORTS, "")
    yield from _secret_env(path, container)


def _profiles(path: str, context: KubeObject) -> Iterator[Finding]:
    for field in ("seccompProfile", "appArmorProfile"):
        if ((context.get(field) or {}).get("type")) == "Unconfined":
            yield f"{path}.{field}.type", "Unconfined profiles are not allowed", \
                ALLOW_UNCONFINED, ""


def _user(path: str, context: KubeObject) -> Iterator[Finding]:
    """Restricted: a sandbox does not run as root (when the template says so explicitly;
    left unset, ``secure_defaults`` makes it non-root)."""
    if context.get("runAsNonRoot") is False:
        yield f"{path}.runAsNonRoot", "running as root is not allowed", PROFILE, ""
    if context.get("runAsUser") == 0:
        yield f"{path}.runAsUser", "running as root (uid 0) is not allowed", PROFILE, ""


# -- ServiceAccount and Secrets -----------------------------------------------------------

def _service_account(pod_spec: KubeObject, policy: PodPolicySettings,
                     namespace: str) -> Iterator[Finding]:
    """A sandbox runs as the namespace's default ServiceAccount, and without its token,
    unless the admin allow-listed the account (the operator could otherwise hand any
    account of the namespace, and its API rights, to whoever may create an AgentSandbox)."""
    account = service_account_of(pod_spec)
    for field in ("serviceAccountName", "serviceAccount"):
        if pod_spec.get(field) and account != DEFAULT_SERVICE_ACCOUNT:
            yield (f"{_TEMPLATE}.{field}", f"the ServiceAccount {account!r} is not allowed "
                   "for sandboxes", SERVICE_ACCOUNTS, account)
            return
    if pod_spec.get("automountServiceAccountToken") is True:
        yield (f"{_TEMPLATE}.automountServiceAccountToken", f"mounting the token of "
               f"ServiceAccount {account!r} is not allowed", SERVICE_ACCOUNTS, account)


def _secret_sources(path: str, name: Any, kind: str, source: KubeObject) -> Iterator[Finding]:
    """A Secret reached through a volume: a secret volume, a projected Secret or token, or
    any other volume type handing a Secret to its driver."""
    if kind == "secret":
        yield (path, f"volume {name!r} mounts Secret {source.get('secretName')!r}",
               SECRET_NAMESPACES, "")
    elif kind == "projected":
        for k, item in enumerate(source.get("sources") or []):
            for part in ("secret", "serviceAccountToken"):
                if (item or {}).get(part) is not None:
                    what = ("a ServiceAccount token" if part == "serviceAccountToken" else
                            f"Secret {((item or {}).get(part) or {}).get('name')!r}")
                    yield (f"{path}.sources[{k}].{part}", f"volume {name!r} projects {what}",
                           SECRET_NAMESPACES, "")
    else:
        for field in ("secretRef", "secretName", "nodePublishSecretRef"):
            if source.get(field):
                yield (f"{path}.{field}", f"volume {name!r} hands a Secret to its driver",
                       SECRET_NAMESPACES, "")


def _secret_env(path: str, container: KubeObject) -> Iterator[Finding]:
    for j, source in enumerate(container.get("envFrom") or []):
        if (source or {}).get("secretRef") is not None:
            yield (f"{path}.envFrom[{j}].secretRef", "the environment comes from Secret "
                   f"{((source or {}).get('secretRef') or {}).get('name')!r}",
                   SECRET_NAMESPACES, "")
    for j, var in enumerate(container.get("env") or []):
        ref = ((var or {}).get("valueFrom") or {}).get("secretKeyRef")
        if ref is not None:
            yield (f"{path}.env[{j}].valueFrom.secretKeyRef", f"variable "
                   f"{(var or {}).get('name')!r} comes from Secret {(ref or {}).get('name')!r}",
                   SECRET_NAMESPACES, "")


# -- placement ----------------------------------------------------------------------------

def _placement(pod_spec: KubeObject, placement: KubeObject) -> Iterator[Finding]:
    """Template fields that take a sandbox off spot nodes. A sandbox asks for spot nodes
    through spec.placement (spot, nodeSelector, tolerations, fallbackToOnDemandAfterSeconds:
    Hermit's API, visible in status.capacity); the template's own nodeSelector switches the
    spot requirement off (podspec.selects_spot_nodes) and its required node affinity can
    only exclude spot nodes, and its tolerations can place it on broken nodes."""
    spot = placement.get("spot", True) is not False
    if spot and pod_spec.get("nodeSelector"):
        yield (f"{_TEMPLATE}.nodeSelector", "a template nodeSelector switches the spot "
               "requirement off: set spec.placement.nodeSelector, which keeps it",
               ALLOW_PLACEMENT, "")
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = (required.get("nodeSelectorTerms") or []) if spot else []
    for t, term in enumerate(terms):
        for e, expr in enumerate((term or {}).get("matchExpressions") or []):
            if _excludes_spot(expr or {}):
                yield (f"{_TEMPLATE}.affinity.nodeAffinity.requiredDuringScheduling"
                       f"IgnoredDuringExecution.nodeSelectorTerms[{t}].matchExpressions[{e}]",
                       f"requires nodes that are not spot ({(expr or {}).get('key')})",
                       ALLOW_PLACEMENT, "")
    for where, tolerations in ((f"{_TEMPLATE}.tolerations", pod_spec.get("tolerations")),
                               ("spec.placement.tolerations", placement.get("tolerations"))):
        for i, toleration in enumerate(tolerations or []):
            toleration = toleration or {}
            if tolerates_interruption(toleration):
                yield (f"{where}[{i}]", f"{_describe(toleration)} tolerates the "
                       f"{protocol.TAINT_INTERRUPTION} taint, so a sandbox could be placed on "
                       "a node that is going away",
                       NO_EXEMPTION_INTERRUPTION, "")
                continue
            taint = _tolerated_health_taint(toleration)
            if taint:
                yield (f"{where}[{i}]", f"{_describe(toleration)} tolerates {taint}, "
                       "so the sandbox could run on a node that is broken or being "
                       "drained", ALLOW_PLACEMENT, "")


def tolerates_interruption(toleration: KubeObject) -> bool:
    """Whether a core/v1 Toleration tolerates the node-agent's interruption taint
    (key hermit.dev/interruption, effect NoSchedule, any value)."""
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    effect = toleration.get("effect") or ""
    if effect not in ("", "NoSchedule"):
        return False
    if key == "":
        return bool(operator == "Exists")  # an empty key with Exists matches every taint
    return bool(key == protocol.TAINT_INTERRUPTION)


def _describe(toleration: KubeObject) -> str:
    return "the toleration " + ", ".join(f"{k}={v}" for k, v in sorted(toleration.items()))


def _excludes_spot(expr: KubeObject) -> bool:
    """Whether a node selector requirement on a spot label admits no spot node."""
    spot_value = dict(SPOT_NODE_LABELS).get(str(expr.get("key")))
    if spot_value is None:
        return False
    operator, values = expr.get("operator"), [str(v) for v in expr.get("values") or []]
    return ((operator == "In" and spot_value not in values)
            or (operator == "NotIn" and spot_value in values)
            or operator == "DoesNotExist")


def _tolerated_health_taint(toleration: KubeObject) -> str | None:
    """The node-health taint(s) this toleration tolerates for good (a NoExecute toleration
    with tolerationSeconds, as Kubernetes adds to every pod, only delays the eviction)."""
    key, operator = toleration.get("key") or "", toleration.get("operator") or "Equal"
    effect = toleration.get("effect") or ""
    if effect == "NoExecute" and toleration.get("tolerationSeconds") is not None:
        return None
    if effect not in ("", "NoSchedule", "NoExecute"):
        return None
    if key == "" and operator == "Exists":
        return "every taint"  # (NoExecute ones: NoSchedule is the interruption rule's)
    return f"the {key} taint" if key in NODE_HEALTH_TAINTS else None


def _containers(pod_spec: KubeObject) -> Iterator[tuple[str, KubeObject]]:
    for kind in _CONTAINER_LISTS:
        for i, container in enumerate(pod_spec.get(kind) or []):
            yield f"{_TEMPLATE}.{kind}[{i}]", container or {}


# -- the builder's defaults ---------------------------------------------------------------

def secure_defaults(pod_spec: KubeObject, policy: PodPolicySettings) -> KubeObject:
    """``pod_spec`` (the pod being built, Hermit's init container included) with the fields
    the template left unset filled with the compliant value: no ServiceAccount token; and
    under the restricted profile a non-root user (65532:65532 when the template names no
    user), the RuntimeDefault seccomp profile, and in every container no privilege
    escalation and capabilities dropped (ALL; what the container adds is added back).
    Explicit values are kept: ``violations`` has refused the ones that do not comply."""
    out = copy.deepcopy(pod_spec)
    out.setdefault("automountServiceAccountToken", False)
    if policy.profile != PROFILE_RESTRICTED:
        return out
    context = out.setdefault("securityContext", {})
    main = ((out.get("containers") or [{}])[0] or {}).get("securityContext") or {}
    names_a_user = any(c.get(f) is not None for c in (context, main)
                       for f in ("runAsUser", "runAsNonRoot"))
    if not names_a_user:
        context["runAsUser"] = DEFAULT_USER
        context.setdefault("runAsGroup", DEFAULT_GROUP)
    context.setdefault("runAsNonRoot", True)
    if not context.get("seccompProfile"):
        context["seccompProfile"] = {"type": "RuntimeDefault"}
    for kind in _CONTAINER_LISTS:
        for container in out.get(kind) or []:
            sc = container.setdefault("securityContext", {})
            sc.setdefault("allowPrivilegeEscalation", False)
            caps = sc.setdefault("capabilities", {})
            drop = list(caps.get("drop") or [])
            if not any(str(d).upper() in ("ALL", "CAP_ALL") for d in drop):
                caps["drop"] = [*drop, "ALL"]
    return out
