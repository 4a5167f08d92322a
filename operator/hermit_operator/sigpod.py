"""The pod of an opted-in SIG Sandbox (kubernetes-sigs/agent-sandbox, ``agents.x-k8s.io``),
as Hermit needs it: a pure function from the pod the SIG's controller is creating to the
pod Hermit admits, or a refusal (docs/agent-sandbox.md, "Opting a Sandbox in").

A Sandbox opts in with the label ``hermit.dev/checkpoint: enabled`` in
``spec.podTemplate.metadata.labels``: the SIG's controller copies that metadata to the pod
(a SandboxTemplate's to the Sandboxes of its claims and warm pools), so the admission
webhook sees the opt-in and the checkpoint settings on the pod itself, without reading the
Sandbox. The settings are two JSON annotations beside it, with the fields and meaning of
an AgentSandbox's ``spec.checkpoint`` and ``spec.workspace``.

The pod is changed with podspec.py's own pieces (``add_hermit_init``, the pod policy's
``violations`` and ``secure_defaults``): the same init, workspace, termination hold and
policy as an AgentSandbox's pod. What differs is what the SIG's controller owns: the
pod's name, owner, restartPolicy and placement stay as it made them.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hermit_common import api, protocol
from hermit_common.protocol import KubeObject
from hermit_common.settings import OperatorSettings
from hermit_operator import podpolicy, podspec
from hermit_operator.podspec import InvalidSpec

SIG_GROUP = "agents.x-k8s.io"
SIG_KIND = "Sandbox"
# The opt-in: this label with this value, on the pod template (so on the pod).
LABEL_OPT_IN = f"{api.GROUP}/checkpoint"
OPT_IN_VALUE = "enabled"
# AgentSandbox.spec.checkpoint and .spec.workspace, as JSON objects.
ANNOTATION_CHECKPOINT = f"{api.GROUP}/checkpoint"
ANNOTATION_WORKSPACE = f"{api.GROUP}/workspace"
# The Sandbox's name, on its mutated pod: what Hermit's later parts find it by. Not
# protocol.LABEL_SANDBOX, which names an AgentSandbox (the operator and the node-agent act
# on every pod that has it, and one of the same name may exist).
LABEL_SIG_SANDBOX = f"{api.GROUP}/sig-sandbox"
TEMPLATE = "spec.podTemplate"
WHERE = f"{TEMPLATE}.spec"
# The API server defaults terminationGracePeriodSeconds to this before admission: a pod
# that has it is taken as one whose template left it unset (Hermit's grace period then).
API_DEFAULT_GRACE_SECONDS = 30
# The volume the ServiceAccount admission plugin adds before any webhook runs when the pod
# does not say automountServiceAccountToken: false (the pod policy refuses the token; an
# AgentSandbox's pod says false before it is created).
TOKEN_VOLUME_PREFIX = "kube-api-access-"

_CHECKPOINT_FIELDS = {"intervalSeconds", "onPreemption", "onTurn", "retain", "storage"}
_WORKSPACE_FIELDS = {"size", "mountPath"}
_STORAGE_FIELDS = {"bucket", "prefix", "endpoint", "region", "secretRef"}


def sig_sandbox_owner(pod: KubeObject) -> str | None:
    """The name of the SIG Sandbox that controls the pod, or None."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        group = str(ref.get("apiVersion") or "").split("/")[0]
        if ref.get("controller") and ref.get("kind") == SIG_KIND and group == SIG_GROUP:
            return str(ref.get("name") or "") or None
    return None


def opted_in(pod: KubeObject) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_OPT_IN) == OPT_IN_VALUE


def applies_to(pod: KubeObject) -> bool:
    """Whether Hermit changes this pod: opted in, and made for a SIG Sandbox. A pod with
    the label that is no Sandbox's is let through as it is."""
    return opted_in(pod) and sig_sandbox_owner(pod) is not None


# The labels by which the operator and the node-agent know an AgentSandbox's pods: a SIG
# Sandbox's template may not bring them (its pod would pass for an AgentSandbox's).
RESERVED_LABELS = (protocol.LABEL_SANDBOX, protocol.LABEL_INCARNATION, protocol.LABEL_NODE,
                   protocol.LABEL_CAPACITY)


def _json_annotation(annotations: dict[str, str], key: str, fields: set[str]
                     ) -> KubeObject:
    raw = annotations.get(key)
    if raw is None:
        return {}
    where = f"{TEMPLATE}.metadata.annotations[{key!r}]"
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise InvalidSpec(f"{where} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidSpec(f"{where} must be a JSON object")
    unknown = sorted(set(value) - fields)
    if unknown:
        raise InvalidSpec(f"{where}: unknown field(s) {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(fields))})")
    return value


def checkpoint_settings(annotations: dict[str, str]) -> KubeObject:
    """The ``hermit.dev/checkpoint`` annotation as AgentSandbox.spec.checkpoint, checked as
    its CRD schema checks it (InvalidSpec naming the field)."""
    ckpt = _json_annotation(annotations, ANNOTATION_CHECKPOINT, _CHECKPOINT_FIELDS)
    where = f"{TEMPLATE}.metadata.annotations[{ANNOTATION_CHECKPOINT!r}]"
    for flag in ("onPreemption", "onTurn"):
        if flag in ckpt and not isinstance(ckpt[flag], bool):
            raise InvalidSpec(f"{where}.{flag} must be true or false")
    for number, minimum in (("intervalSeconds", 30), ("retain", 1)):
        value = ckpt.get(number)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < minimum):
            raise InvalidSpec(f"{where}.{number} must be a whole number of at least {minimum}")
    storage = ckpt.get("storage")
    if storage is not None:
        if not isinstance(storage, dict) or not isinstance(storage.get("bucket"), str):
            raise InvalidSpec(f"{where}.storage must be an object with a bucket")
        unknown = sorted(set(storage) - _STORAGE_FIELDS)
        if unknown:
            raise InvalidSpec(f"{where}.storage: unknown field(s) {', '.join(unknown)}")
        if "endpoint" in storage and "secretRef" not in storage:
            raise InvalidSpec(f"{where}.storage.endpoint needs storage.secretRef; the "
                              "node-agent's own credentials only go to its own endpoint")
    return ckpt


def workspace_settings(annotations: dict[str, str]) -> KubeObject:
    ws = _json_annotation(annotations, ANNOTATION_WORKSPACE, _WORKSPACE_FIELDS)
    where = f"{TEMPLATE}.metadata.annotations[{ANNOTATION_WORKSPACE!r}]"
    if "mountPath" in ws and not (isinstance(ws["mountPath"], str)
                                  and ws["mountPath"].startswith("/")):
        raise InvalidSpec(f"{where}.mountPath must be an absolute path")
    if "size" in ws and not isinstance(ws["size"], str | int):
        raise InvalidSpec(f"{where}.size must be a quantity such as 10Gi")
    return ws


def as_agent_sandbox_spec(pod: KubeObject) -> KubeObject:
    """The AgentSandbox spec this pod stands for: its settings from the annotations, and a
    placement that Hermit leaves alone (spot false: the SIG Sandbox's template places its
    pod, and the pod policy's spot rules, which name spec.placement, do not apply)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return {"checkpoint": checkpoint_settings(annotations),
            "workspace": workspace_settings(annotations),
            "placement": {"spot": False},
            "podTemplate": {"spec": pod.get("spec") or {}}}


def _without_injected_token(pod_spec: KubeObject) -> KubeObject:
    """The spec without the ServiceAccount token volume that the API server added, unless
    the template asked for the token (then the pod policy judges it)."""
    if pod_spec.get("automountServiceAccountToken") is True:
        return pod_spec
    out = copy.deepcopy(pod_spec)
    injected = {v.get("name") for v in out.get("volumes") or []
                if str(v.get("name") or "").startswith(TOKEN_VOLUME_PREFIX)
                and v.get("projected") is not None}
    if not injected:
        return out
    out["volumes"] = [v for v in out.get("volumes") or [] if v.get("name") not in injected]
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in out.get(kind) or []:
            mounts = [m for m in container.get("volumeMounts") or []
                      if m.get("name") not in injected]
            if mounts:
                container["volumeMounts"] = mounts
            else:
                container.pop("volumeMounts", None)
    out["automountServiceAccountToken"] = False
    return out


def mutate(pod: KubeObject, settings: OperatorSettings, *, hold: bool = False) -> KubeObject:
    """The pod Hermit admits in place of ``pod`` (which ``applies_to``): InvalidSpec, with
    a message naming the template's field, when its pod spec breaks the pod policy or
    cannot run under hermit-init.

    ``hold``: add the termination hold (a preStop sleep for the grace period) when the
    Sandbox saves on a drain. Off until Hermit checkpoints Sandbox pods (issue 20, points
    3 and 4): today nothing would take the checkpoint or cut the sleep short, so every
    suspend, drain and delete of an opted-in Sandbox would only wait its grace period."""
    meta = pod.get("metadata") or {}
    taken = sorted(set(meta.get("labels") or {}) & set(RESERVED_LABELS))
    if taken:
        raise InvalidSpec(f"{TEMPLATE}.metadata.labels: {', '.join(taken)} "
                          f"{'is' if len(taken) == 1 else 'are'} Hermit's own")
    spec = as_agent_sandbox_spec(pod)
    pod_spec = _without_injected_token(pod.get("spec") or {})
    problems = podpolicy.violations(pod_spec, settings.pod_policy,
                                    namespace=str(meta.get("namespace") or ""),
                                    placement=spec["placement"])
    if problems:
        raise InvalidSpec(podpolicy.describe(problems))
    size, mount_path = podspec.workspace(spec)
    podspec.check_main_container(pod_spec, mount_path, WHERE)

    annotations = dict(meta.get("annotations") or {})
    for key in (protocol.ANNOTATION_RESTORE_FROM, protocol.ANNOTATION_HOLD,
                protocol.ANNOTATION_ON_PREEMPTION, *protocol.NODE_AGENT_POD_ANNOTATIONS):
        annotations.pop(key, None)  # Hermit's to set, never the template's
    annotations[protocol.ANNOTATION_WORKSPACE_PATH] = mount_path
    saves = podspec.on_preemption({"spec": spec})
    if not saves:
        annotations[protocol.ANNOTATION_ON_PREEMPTION] = "false"
    if hold and pod_spec.get("terminationGracePeriodSeconds") == API_DEFAULT_GRACE_SECONDS:
        pod_spec.pop("terminationGracePeriodSeconds")  # the hold's grace period instead
    podspec.add_hermit_init(pod_spec, annotations, settings, size=size,
                            mount_path=mount_path, restore_from=None, overlap=False,
                            saves=saves and hold)
    pod_spec = podpolicy.secure_defaults(pod_spec, settings.pod_policy)

    labels = {**(meta.get("labels") or {}),
              LABEL_SIG_SANDBOX: str(sig_sandbox_owner(pod))}
    out: KubeObject = copy.deepcopy(pod)
    out["metadata"] = {**meta, "labels": labels, "annotations": annotations}
    out["spec"] = pod_spec
    return out


def patch(pod: KubeObject, mutated: KubeObject) -> list[dict[str, Any]]:
    """The JSONPatch from ``pod`` to ``mutated`` (whole labels, annotations and spec:
    ``add`` replaces a member that exists)."""
    return [{"op": "add", "path": "/metadata/labels", "value": mutated["metadata"]["labels"]},
            {"op": "add", "path": "/metadata/annotations",
             "value": mutated["metadata"]["annotations"]},
            {"op": "replace", "path": "/spec", "value": mutated["spec"]}]
