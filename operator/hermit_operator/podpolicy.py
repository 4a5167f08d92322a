"""The sandbox pod policy: what a pod template may ask for, as pure functions.

The operator creates every sandbox pod itself, so without a policy anyone allowed to create
an AgentSandbox would get any pod the namespace's admission lets the *operator* create (a
confused deputy). By default a template must meet the Kubernetes Pod Security Standards
"baseline" level (no privileged containers, host namespaces, hostPath volumes, host ports,
added capabilities beyond the baseline set, unmasked /proc, unconfined seccomp or AppArmor,
unsafe sysctls) and may not pick its node with ``nodeName``. A cluster admin loosens it per
exemption (``HERMIT_POD_POLICY_ALLOW``) or with extra capabilities
(``HERMIT_POD_POLICY_CAPABILITIES``); see docs/security.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from hermit_common.settings import (
    ALLOW_HOST_NAMESPACES,
    ALLOW_HOST_PATH,
    ALLOW_HOST_PORTS,
    ALLOW_NODE_NAME,
    ALLOW_PRIVILEGED,
    ALLOW_PROC_MOUNT,
    ALLOW_UNCONFINED,
    ALLOW_UNSAFE_SYSCTLS,
    PodPolicySettings,
)

KubeObject = dict[str, Any]

# The capabilities the baseline Pod Security Standard lets a container add.
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
    "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# The sysctls Kubernetes calls safe (namespaced, no effect outside the pod).
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"})
HOST_NAMESPACE_FIELDS = ("hostNetwork", "hostPID", "hostIPC")
_TEMPLATE = "spec.podTemplate.spec"
CAPABILITIES = "capabilities"  # not an exemption: extra capabilities are named one by one
_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def violations(pod_spec: KubeObject, policy: PodPolicySettings) -> list[str]:
    """Every way ``pod_spec`` (an AgentSandbox's podTemplate.spec) breaks ``policy``, each
    as '<field path>: <what is wrong> (<how an admin allows it>)'; empty when it complies."""
    found = [*_pod_level(pod_spec), *_volumes(pod_spec)]
    for path, container in _containers(pod_spec):
        found.extend(_container(path, container, policy))
    return [f"{path}: {what} ({_how_to_allow(exemption)})"
            for path, what, exemption in found if exemption not in policy.allow]


def _how_to_allow(exemption: str) -> str:
    if exemption == CAPABILITIES:
        return "allowed by operator.podPolicy.extraCapabilities"
    return f"allowed by operator.podPolicy.allow: [{exemption}]"


def describe(problems: list[str]) -> str:
    """The one message of an InvalidSpec for these violations."""
    return ("the pod template could escape the sandbox, which the operator's pod policy "
            "refuses: " + "; ".join(problems))


def _pod_level(pod_spec: KubeObject) -> Iterator[tuple[str, str, str]]:
    for name in HOST_NAMESPACE_FIELDS:
        if pod_spec.get(name):
            yield f"{_TEMPLATE}.{name}", "host namespaces are not allowed", ALLOW_HOST_NAMESPACES
    if pod_spec.get("nodeName"):
        yield (f"{_TEMPLATE}.nodeName", "a sandbox may not pick its node (use "
               "spec.placement)", ALLOW_NODE_NAME)
    context = pod_spec.get("securityContext") or {}
    yield from _profiles(f"{_TEMPLATE}.securityContext", context)
    for i, sysctl in enumerate(context.get("sysctls") or []):
        if (sysctl or {}).get("name") not in SAFE_SYSCTLS:
            yield (f"{_TEMPLATE}.securityContext.sysctls[{i}]",
                   f"sysctl {(sysctl or {}).get('name')!r} is not a safe sysctl",
                   ALLOW_UNSAFE_SYSCTLS)


def _volumes(pod_spec: KubeObject) -> Iterator[tuple[str, str, str]]:
    for i, volume in enumerate(pod_spec.get("volumes") or []):
        if (volume or {}).get("hostPath") is not None:
            yield (f"{_TEMPLATE}.volumes[{i}].hostPath",
                   f"volume {(volume or {}).get('name')!r} mounts a host path", ALLOW_HOST_PATH)


def _containers(pod_spec: KubeObject) -> Iterator[tuple[str, KubeObject]]:
    for kind in _CONTAINER_LISTS:
        for i, container in enumerate(pod_spec.get(kind) or []):
            yield f"{_TEMPLATE}.{kind}[{i}]", container or {}


def _container(path: str, container: KubeObject,
               policy: PodPolicySettings) -> Iterator[tuple[str, str, str]]:
    context = container.get("securityContext") or {}
    if context.get("privileged"):
        yield (f"{path}.securityContext.privileged", "privileged containers are not allowed",
               ALLOW_PRIVILEGED)
    allowed = BASELINE_CAPABILITIES | policy.extra_capabilities
    added = [str(c).upper().removeprefix("CAP_")
             for c in (context.get("capabilities") or {}).get("add") or []]
    beyond = sorted(c for c in added if c not in allowed)
    if beyond:
        yield (f"{path}.securityContext.capabilities.add",
               f"capabilities {', '.join(beyond)} are beyond the allowed set",
               CAPABILITIES)
    if context.get("procMount") not in (None, "Default"):
        yield f"{path}.securityContext.procMount", "an unmasked /proc is not allowed", \
            ALLOW_PROC_MOUNT
    yield from _profiles(f"{path}.securityContext", context)
    for j, port in enumerate(container.get("ports") or []):
        if (port or {}).get("hostPort"):
            yield (f"{path}.ports[{j}].hostPort", "host ports are not allowed",
                   ALLOW_HOST_PORTS)


def _profiles(path: str, context: KubeObject) -> Iterator[tuple[str, str, str]]:
    for field in ("seccompProfile", "appArmorProfile"):
        if ((context.get(field) or {}).get("type")) == "Unconfined":
            yield f"{path}.{field}.type", "Unconfined profiles are not allowed", \
                ALLOW_UNCONFINED
