"""The sandbox pod built from an AgentSandbox: a pure function from the object to a V1Pod dict
(and the sandbox's PodDisruptionBudget, when it has one).

The first container runs under hermit-init (the PID 1 that CRIU dumps and restores
under): an init container copies the static binary from the Hermit image into a
shared emptyDir mounted at ``/.hermit``, and the container's command becomes
``/.hermit/hermit-init [--restore ...] -- <command>`` (``args`` stay as they are, so
the resulting argv is ``<init> -- <command> <args>``).
"""

from __future__ import annotations

import copy

from hermit_common import api, protocol
from hermit_common.errors import Permanent
from hermit_common.protocol import KubeObject
from hermit_common.settings import OperatorSettings, PodPolicySettings
from hermit_operator import podpolicy
from hermit_operator.checkpoints import STOPPING_WAIT

INIT_DIR = "/.hermit"
INIT_BINARY = f"{INIT_DIR}/hermit-init"
INIT_VOLUME = podpolicy.INIT_VOLUME  # the pod policy lets no other container mount these
INIT_CONTAINER = podpolicy.INIT_CONTAINER
WORKSPACE_VOLUME = podpolicy.WORKSPACE_VOLUME
DEFAULT_WORKSPACE_SIZE = "1Gi"
DEFAULT_WORKSPACE_PATH = protocol.DEFAULT_WORKSPACE_PATH
RESTORE_TIMEOUT_SECONDS = 300
# A move's replacement created while the checkpoint is still taken (overlap.py) waits for
# that too: at most the operator's STOPPING_WAIT (checkpoints.py) on top.
OVERLAP_RESTORE_TIMEOUT_SECONDS = RESTORE_TIMEOUT_SECONDS + int(STOPPING_WAIT.total_seconds())
# Without the termination hold nothing needs long: hermit-init ends the tree on SIGTERM.
# The operator deletes pods with this grace period too: it deletes one only when its tree
# has nothing left to save (an evicted one with grace 0: reconcile.Plan.release_pod).
TERMINATION_GRACE_SECONDS = 10

# The labels by which the usual provisioners mark spot (preemptible) nodes (podpolicy.py,
# whose placement rule reads them too). With placement.spot the pod requires a node that
# has any one of them: one nodeSelectorTerm per label (terms are ORed), so a sandbox
# schedules with or without Karpenter.
SPOT_NODE_LABELS = podpolicy.SPOT_NODE_LABELS
# At most this many nodeSelectorTerms after the user's required terms are crossed with the
# spot labels (user terms x spot labels); more is refused as InvalidSpec.
MAX_NODE_SELECTOR_TERMS = 60
# Taints that cloud spot pools commonly carry (AKS adds the first one itself).
SPOT_TOLERATIONS: tuple[dict[str, str], ...] = (
    {"key": "kubernetes.azure.com/scalesetpriority", "operator": "Equal", "value": "spot",
     "effect": "NoSchedule"},
    {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true",
     "effect": "NoSchedule"},
    {"key": "karpenter.sh/capacity-type", "operator": "Equal", "value": "spot",
     "effect": "NoSchedule"},
)



class InvalidSpec(Permanent):
    """The AgentSandbox spec cannot be turned into a pod; fixing the spec is the only cure."""


def pod_name(sandbox_name: str, incarnation: int) -> str:
    return f"{sandbox_name}-{incarnation}"


def init_command(command: list[str], restore_from: str | None, *,
                 overlap: bool = False) -> list[str]:
    """The first container's new command: hermit-init, its flags, then the original command.
    ``overlap``: the pod is created before its checkpoint is durable, its init waits longer."""
    if restore_from is None:
        return [INIT_BINARY, "--", *command]
    timeout = OVERLAP_RESTORE_TIMEOUT_SECONDS if overlap else RESTORE_TIMEOUT_SECONDS
    return [INIT_BINARY, "--restore", "--restore-timeout", str(timeout), "--", *command]


STRICT_POD_POLICY = PodPolicySettings()


def validate(sandbox: KubeObject, policy: PodPolicySettings = STRICT_POD_POLICY) -> None:
    """Raise InvalidSpec when the sandbox's spec cannot be run or breaks the pod ``policy``
    (the strictest by default); the pod builder calls it too."""
    spec = sandbox.get("spec") or {}
    pod_spec = (spec.get("podTemplate") or {}).get("spec") or {}
    problems = podpolicy.violations(
        pod_spec, policy, namespace=str((sandbox.get("metadata") or {}).get("namespace") or ""),
        placement=spec.get("placement") or {})
    if problems:
        raise InvalidSpec(podpolicy.describe(problems))
    check_main_container(pod_spec, workspace(spec)[1], "spec.podTemplate.spec")
    spot_node_selector_terms(spec)  # refuses a required node affinity too big to combine


tolerates_interruption = podpolicy.tolerates_interruption


def build_sandbox_pod(sandbox: KubeObject, settings: OperatorSettings, incarnation: int,
                      restore_from: str | None, *, on_demand: bool = False,
                      overlap: bool = False, format_level: int | None = None) -> KubeObject:
    """The V1Pod manifest for this incarnation of the sandbox (restoring ``restore_from``).

    ``on_demand``: a sandbox that requires spot nodes asks for a node that is not spot
    instead (spec.placement.fallbackToOnDemandAfterSeconds has passed); see
    ``pod_capacity`` for the label that records which. ``overlap``: the pod is created
    while ``restore_from`` is still being taken (overlap.py): its init waits longer.
    ``format_level``: the checkpoint format level of ``restore_from`` (its
    status.formatLevel; None: level 1): above 1, only a node whose node-agent reads it may
    take the pod (``format_requirement``)."""
    validate(sandbox, settings.pod_policy)
    meta = sandbox["metadata"]
    spec = sandbox.get("spec") or {}
    template = spec["podTemplate"]
    tmeta = template.get("metadata") or {}
    pod_spec: KubeObject = copy.deepcopy(template["spec"])

    labels = {**(tmeta.get("labels") or {}), protocol.LABEL_SANDBOX: meta["name"],
              protocol.LABEL_INCARNATION: str(incarnation)}
    labels.pop(protocol.LABEL_CAPACITY, None)
    capacity = pod_capacity(spec, on_demand)
    if capacity is not None:
        labels[protocol.LABEL_CAPACITY] = capacity
    size, mount_path = workspace(spec)
    annotations = _pod_annotations(sandbox, tmeta, mount_path, restore_from)

    add_hermit_init(pod_spec, annotations, settings, size=size, mount_path=mount_path,
                    restore_from=restore_from, overlap=overlap, saves=on_preemption(sandbox))
    pod_spec["restartPolicy"] = "Never"
    pod_spec.setdefault("hostname", meta["name"])
    _apply_placement(pod_spec, spec, on_demand=capacity == api.CAPACITY_ON_DEMAND)
    if settings.require_ready_node_agent:
        _require_ready_node_agent(pod_spec)
    requirement = format_requirement(format_level) if restore_from else None
    if requirement is not None:
        _require_in_every_term(pod_spec, requirement)
    pod_spec = podpolicy.secure_defaults(pod_spec, settings.pod_policy)

    pod_meta = _pod_metadata(sandbox, incarnation, labels, annotations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": pod_spec}


def add_hermit_init(pod_spec: KubeObject, annotations: dict[str, str],
                    settings: OperatorSettings, *, size: str, mount_path: str,
                    restore_from: str | None, overlap: bool, saves: bool) -> None:
    """What every pod Hermit saves needs, applied in place to a pod spec already checked
    (``validate``, or sigpod.py for a SIG Sandbox's pod): the first container under
    hermit-init with the init dir and the workspace mounted, the init container that copies
    hermit-init, their emptyDirs, the termination grace period when unset, and the
    termination hold (its annotations into ``annotations``) when ``saves`` (onPreemption).
    Placement, restartPolicy and the secure defaults stay the caller's."""
    _wrap_main_container(pod_spec["containers"][0], mount_path, restore_from, overlap)
    pod_spec.setdefault("terminationGracePeriodSeconds",
                        settings.termination_grace_seconds if settings.termination_hold
                        else TERMINATION_GRACE_SECONDS)
    if _add_hold(pod_spec["containers"][0], settings, int(
            pod_spec["terminationGracePeriodSeconds"] or 0), saves):
        annotations[protocol.ANNOTATION_HOLD] = "true"
        # The cluster autoscaler skips nodes with emptyDir pods (or pods of a controller
        # it does not know) without this; the workspace moves with the checkpoint.
        annotations.setdefault(protocol.ANNOTATION_SAFE_TO_EVICT, "true")
    pod_spec["initContainers"] = [_init_container(settings),
                                  *(pod_spec.get("initContainers") or [])]
    pod_spec["volumes"] = [*(pod_spec.get("volumes") or []), *_hermit_volumes(size)]


def check_main_container(pod_spec: KubeObject, mount_path: str, where: str) -> None:
    """InvalidSpec unless Hermit can wrap the pod's first container: it has a command, no
    init container takes Hermit's name, and no mount takes the init dir or the workspace
    (``where``: the pod spec's path in the user's object, for the messages)."""
    containers = pod_spec.get("containers") or []
    if not containers:
        raise InvalidSpec(f"{where}.containers needs at least one container")
    command = containers[0].get("command")
    if not command or not isinstance(command, list):
        raise InvalidSpec(
            f"{where}.containers[0].command is required: Hermit runs it under its init")
    init_names = {c.get("name") for c in pod_spec.get("initContainers") or []}
    if INIT_CONTAINER in init_names:
        raise InvalidSpec(f"{where}.initContainers: the name {INIT_CONTAINER!r} "
                          "is reserved for Hermit")
    for mount in containers[0].get("volumeMounts") or []:
        if mount.get("mountPath") in (INIT_DIR, mount_path):
            raise InvalidSpec(
                f"{where}.containers[0].volumeMounts: {mount.get('mountPath')} "
                "is reserved for Hermit's init and workspace")
    names = {v.get("name") for v in pod_spec.get("volumes") or []}
    for reserved in (INIT_VOLUME, WORKSPACE_VOLUME):
        if reserved in names:
            raise InvalidSpec(f"{where}.volumes: the name {reserved!r} is reserved for Hermit")


def _pod_annotations(sandbox: KubeObject, template_meta: KubeObject, mount_path: str,
                     restore_from: str | None) -> dict[str, str]:
    """The template's annotations, with the protocol keys the operator owns set here rather
    than copied (workspace path, restore source, on-preemption opt-out) and the node-agent's
    restore phase, message and retryable keys dropped."""
    annotations = dict(template_meta.get("annotations") or {})
    annotations[protocol.ANNOTATION_WORKSPACE_PATH] = mount_path
    annotations.pop(protocol.ANNOTATION_RESTORE_FROM, None)
    if restore_from is not None:
        annotations[protocol.ANNOTATION_RESTORE_FROM] = restore_from
    for key in (protocol.ANNOTATION_RESTORE_PHASE, protocol.ANNOTATION_RESTORE_MESSAGE,
                protocol.ANNOTATION_RESTORE_RETRYABLE):
        annotations.pop(key, None)  # the node-agent's to write
    annotations.pop(protocol.ANNOTATION_ON_PREEMPTION, None)
    annotations.pop(protocol.ANNOTATION_HOLD, None)  # the operator's to set (build_sandbox_pod)
    if not on_preemption(sandbox):
        annotations[protocol.ANNOTATION_ON_PREEMPTION] = "false"  # the node-agent leaves it alone
    return annotations


def _wrap_main_container(main: KubeObject, mount_path: str, restore_from: str | None,
                         overlap: bool = False) -> None:
    """Runs the first container under hermit-init and mounts the init dir and the workspace."""
    main["command"] = init_command(list(main["command"]), restore_from, overlap=overlap)
    main["volumeMounts"] = [
        *(main.get("volumeMounts") or []),
        {"name": INIT_VOLUME, "mountPath": INIT_DIR, "readOnly": True},
        {"name": WORKSPACE_VOLUME, "mountPath": mount_path},
    ]


def _add_hold(main: KubeObject, settings: OperatorSettings, grace: int, saves: bool) -> bool:
    """The termination hold: a preStop hook that sleeps for the pod's whole grace period,
    so that the kubelet sends no signal while the node-agent, which sees the pod being
    deleted, takes its stopping checkpoint; once that is durable the operator removes the
    pod (docs/protocol.md "Evictions"). A sleep, not an httpGet to the node-agent: the Pod
    Security Standards' baseline (Kubernetes 1.34+) refuses a lifecycle ``httpGet.host``,
    and without one the kubelet would call the sandbox's own IP. Not added when the hold
    is off, the sandbox saves nothing on a drain (onPreemption false), the grace period is
    0, or the template's first container has a preStop hook of its own (kept; the sandbox
    then keeps a PodDisruptionBudget instead: ``wants_disruption_budget``). True when
    added."""
    lifecycle = main.get("lifecycle") or {}
    if not settings.termination_hold or not saves or grace <= 0 or lifecycle.get("preStop"):
        return False
    main["lifecycle"] = {**lifecycle, "preStop": {"sleep": {"seconds": grace}}}
    return True


def holds_termination(pod: KubeObject | None) -> bool:
    """Whether the pod carries the termination hold (a pod made by an older operator, or
    with the template's own preStop hook, does not)."""
    annotations = ((pod or {}).get("metadata") or {}).get("annotations") or {}
    return annotations.get(protocol.ANNOTATION_HOLD) == "true"


def held(pod: KubeObject) -> bool:
    """Whether ``pod`` is being deleted under its termination hold: with a grace period
    (its preStop sleep holds it; grace 0 goes at once) and carrying the hold."""
    meta = pod.get("metadata") or {}
    return (bool(meta.get("deletionTimestamp")) and holds_termination(pod)
            and meta.get("deletionGracePeriodSeconds") != 0)


def hold_to_cut(pod: KubeObject, sandbox: KubeObject | None, *,
                namespace_terminating: bool = False) -> bool:
    """Whether ``pod``'s termination hold has nothing left to wait for: the pod is being
    deleted with a grace period (its preStop sleep holds it), carries the hold, and the
    AgentSandbox that owns it is gone (``sandbox``: the one of that name as read now, None
    when there is none) or being deleted, or their namespace is (``namespace_terminating``:
    no Checkpoint can be created in it). Its tree has nothing to save, so the operator
    removes the object (grace 0) rather than leave it sleeping out its grace period."""
    if not held(pod):
        return False
    if namespace_terminating:
        return True
    meta = pod.get("metadata") or {}
    owners = {o.get("uid") for o in meta.get("ownerReferences") or []
              if o.get("controller") and o.get("kind") == api.SANDBOX_KIND}
    if sandbox is None:
        return bool(owners)
    sandbox_meta = sandbox.get("metadata") or {}
    return (sandbox_meta.get("uid") not in owners
            or bool(sandbox_meta.get("deletionTimestamp")))


def wants_disruption_budget(sandbox: KubeObject, settings: OperatorSettings,
                            pod: KubeObject | None) -> bool:
    """Whether the sandbox gets a blocking PodDisruptionBudget: never when it saves nothing
    on a drain (onPreemption false); always with HERMIT_DISRUPTION_BUDGET (opt-in); else
    only while its current pod lacks the termination hold (made before the hold existed,
    the hold off, or the template's own preStop hook), which would lose its work to an
    eviction."""
    if not on_preemption(sandbox):
        return False
    if settings.disruption_budget:
        return True
    return pod is not None and not holds_termination(pod)


def _hermit_volumes(workspace_size: str) -> list[KubeObject]:
    """The emptyDirs Hermit adds: the init binary's and the workspace."""
    return [
        {"name": INIT_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}},
        {"name": WORKSPACE_VOLUME, "emptyDir": {"sizeLimit": workspace_size}},
    ]


def _pod_metadata(sandbox: KubeObject, incarnation: int, labels: dict[str, str],
                  annotations: dict[str, str]) -> KubeObject:
    """The pod's name, namespace, labels, owner (the sandbox) and annotations if any."""
    meta = sandbox["metadata"]
    pod_meta: KubeObject = {
        "name": pod_name(meta["name"], incarnation),
        "namespace": meta.get("namespace"),
        "labels": labels,
        "ownerReferences": [_owner(sandbox)],
    }
    if annotations:
        pod_meta["annotations"] = annotations
    return pod_meta

def _owner(sandbox: KubeObject) -> KubeObject:
    meta = sandbox["metadata"]
    return {
        "apiVersion": sandbox.get("apiVersion", api.API_VERSION),
        "kind": sandbox.get("kind", api.SANDBOX_KIND),
        "name": meta["name"],
        "uid": meta.get("uid"),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def on_preemption(sandbox: KubeObject) -> bool:
    """spec.checkpoint.onPreemption (default true): checkpoint on a notice or a drain."""
    value = ((sandbox.get("spec") or {}).get("checkpoint") or {}).get("onPreemption", True)
    return value is not False


def pdb_name(sandbox_name: str) -> str:
    return sandbox_name


def disruption_budget(sandbox: KubeObject) -> KubeObject | None:
    """The sandbox's PodDisruptionBudget: maxUnavailable 0 over its pods, so an eviction (a
    drain) is refused while the node-agent checkpoints the pod and the operator moves it by
    deleting the pod. None when spec.checkpoint.onPreemption is false. Only made when
    ``wants_disruption_budget``: by default evictions are allowed and held instead."""
    if not on_preemption(sandbox):
        return None
    meta = sandbox["metadata"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": pdb_name(meta["name"]), "namespace": meta.get("namespace"),
                     "labels": {protocol.LABEL_SANDBOX: meta["name"]},
                     "ownerReferences": [_owner(sandbox)]},
        "spec": {"maxUnavailable": 0,
                 "selector": {"matchLabels": {protocol.LABEL_SANDBOX: meta["name"]}}},
    }


def workspace(spec: KubeObject) -> tuple[str, str]:
    ws = spec.get("workspace") or {}
    return str(ws.get("size", DEFAULT_WORKSPACE_SIZE)), ws.get("mountPath", DEFAULT_WORKSPACE_PATH)


def _init_container(settings: OperatorSettings) -> KubeObject:
    return {
        "name": INIT_CONTAINER,
        "image": settings.init_image,
        "imagePullPolicy": settings.init_pull_policy,
        # hermit-init copies itself: the init image holds nothing else (no cp, no shell).
        "command": [settings.init_path, "--install", INIT_BINARY],
        "volumeMounts": [{"name": INIT_VOLUME, "mountPath": INIT_DIR}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"},
                      "limits": {"memory": "64Mi"}},
        # Non-root so that pods with runAsNonRoot accept it; the emptyDir is world-writable.
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                            "readOnlyRootFilesystem": True},
    }


def selects_spot_nodes(spec: KubeObject) -> bool:
    """Whether the sandbox pod requires a spot node: placement.spot (default true), unless the
    pod template has a nodeSelector of its own. A template nodeSelector means the user chose
    the nodes (and their capacity type) and Hermit adds no spot requirement to it;
    placement.nodeSelector is added to the spot requirement instead."""
    placement = spec.get("placement") or {}
    pod_spec = (spec.get("podTemplate") or {}).get("spec") or {}
    return placement.get("spot", True) is not False and not pod_spec.get("nodeSelector")


def spot_node_selector_terms(spec: KubeObject) -> list[KubeObject] | None:
    """The nodeSelectorTerms of the sandbox pod's required node affinity, or None when Hermit
    adds none (see ``selects_spot_nodes``).

    One term per label of SPOT_NODE_LABELS. A pod template that already requires node
    affinity gets those terms ANDed with the spot ones: each of its terms is repeated once per
    spot label with that label's requirement appended to its matchExpressions (an empty term
    matches no node and stays as it is). More than MAX_NODE_SELECTOR_TERMS terms is refused:
    such a template should set placement.spot: false and require spot nodes itself."""
    if not selects_spot_nodes(spec):
        return None
    spot_terms: list[KubeObject] = [
        {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}]}
        for key, value in SPOT_NODE_LABELS]
    user_terms = _required_node_selector_terms(
        (spec.get("podTemplate") or {}).get("spec") or {})
    if not user_terms:
        return spot_terms
    combined = [term for user in user_terms for term in _and_terms(user, spot_terms)]
    if len(combined) > MAX_NODE_SELECTOR_TERMS:
        raise InvalidSpec(
            f"spec.podTemplate.spec.affinity.nodeAffinity."
            f"requiredDuringSchedulingIgnoredDuringExecution: its {len(user_terms)} "
            f"nodeSelectorTerms, each combined with the {len(SPOT_NODE_LABELS)} spot node "
            f"labels, make more than {MAX_NODE_SELECTOR_TERMS} terms; set "
            "spec.placement.spot: false and require spot nodes in these terms yourself")
    return combined


def pod_capacity(spec: KubeObject, on_demand: bool) -> str | None:
    """The capacity a pod of this spec asks for: api.CAPACITY_SPOT, api.CAPACITY_ON_DEMAND
    (``on_demand``: after the fallback), or None when the sandbox requires no spot node."""
    if not selects_spot_nodes(spec):
        return None
    return api.CAPACITY_ON_DEMAND if on_demand else api.CAPACITY_SPOT


def capacity_of(pod: KubeObject | None) -> str | None:
    """The capacity a sandbox pod asks for (its hermit.dev/capacity label), or None."""
    labels = ((pod or {}).get("metadata") or {}).get("labels") or {}
    value = labels.get(protocol.LABEL_CAPACITY)
    return str(value) if value in api.CAPACITIES else None


def fallback_after_seconds(sandbox: KubeObject) -> int | None:
    """spec.placement.fallbackToOnDemandAfterSeconds: how long a pod may wait for a spot
    node before it is replaced by an on-demand one; None: never (unset, or the sandbox does
    not require spot nodes)."""
    spec = sandbox.get("spec") or {}
    value = (spec.get("placement") or {}).get("fallbackToOnDemandAfterSeconds")
    if value is None or isinstance(value, bool) or not selects_spot_nodes(spec):
        return None
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return None


def on_demand_node_selector_terms(spec: KubeObject) -> list[KubeObject] | None:
    """The nodeSelectorTerms of a fallback pod: a node that carries none of the spot labels
    of SPOT_NODE_LABELS (NotIn also matches a node without the label), ANDed with each of the
    template's own required terms; None when the sandbox requires no spot node."""
    if not selects_spot_nodes(spec):
        return None
    not_spot = {"matchExpressions": [{"key": key, "operator": "NotIn", "values": [value]}
                                     for key, value in SPOT_NODE_LABELS]}
    user_terms = _required_node_selector_terms(
        (spec.get("podTemplate") or {}).get("spec") or {})
    if not user_terms:
        return [not_spot]
    return [term for user in user_terms for term in _and_terms(user, [not_spot])]


def _required_node_selector_terms(pod_spec: KubeObject) -> list[KubeObject]:
    node_affinity = (pod_spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    return list(required.get("nodeSelectorTerms") or [])


def _and_terms(user: KubeObject, spot_terms: list[KubeObject]) -> list[KubeObject]:
    """The user's term ANDed with each spot term (one term each)."""
    if not user.get("matchExpressions") and not user.get("matchFields"):
        return [copy.deepcopy(user)]
    return [{**copy.deepcopy(user),
             "matchExpressions": [*copy.deepcopy(user.get("matchExpressions") or []),
                                  *spot["matchExpressions"]]}
            for spot in spot_terms]


READY_NODE_AGENT: KubeObject = {
    "key": protocol.LABEL_NODE_AGENT, "operator": "In", "values": [protocol.NODE_AGENT_READY]}


def _require_ready_node_agent(pod_spec: KubeObject) -> None:
    """Only a node whose node-agent is ready (it labels its node): READY_NODE_AGENT is added
    to every required nodeSelectorTerm (``_require_in_every_term``). A node without Hermit
    (new, Windows, virtual) then never gets a sandbox it could not save."""
    _require_in_every_term(pod_spec, READY_NODE_AGENT)


def format_requirement(level: int | None) -> KubeObject | None:
    """The node selector requirement of a pod that restores a checkpoint of format ``level``:
    a node whose node-agent reads it, i.e. labels its node protocol.LABEL_CHECKPOINT_FORMAT
    with a level of at least ``level`` (Gt compares label values as integers; a node
    without the label, a node-agent from before levels, does not match). None for level 1
    or unknown (a checkpoint from before levels): every node-agent reads those."""
    if level is None or level <= 1:
        return None
    return {"key": protocol.LABEL_CHECKPOINT_FORMAT, "operator": "Gt", "values": [str(level - 1)]}


def required_format_level(pod: KubeObject) -> int | None:
    """The checkpoint format level a pod built here requires of its node (the lowest its
    required terms ask for, as any one of them may place it); None: none required."""
    spec = pod.get("spec") or {}
    terms = _required_node_selector_terms(spec)
    levels: list[int] = []
    for term in terms:
        if not (term.get("matchExpressions") or term.get("matchFields")):
            continue  # an empty term matches no node: it places nothing
        asked = [int(e["values"][0]) + 1 for e in term.get("matchExpressions") or []
                 if e.get("key") == protocol.LABEL_CHECKPOINT_FORMAT and e.get("operator") == "Gt"
                 and len(e.get("values") or []) == 1 and str(e["values"][0]).isdigit()]
        if not asked:
            return None
        levels.append(max(asked))
    return min(levels) if levels else None


def _require_in_every_term(pod_spec: KubeObject, requirement: KubeObject) -> None:
    """``requirement`` is added to every required nodeSelectorTerm, as terms are ORed (an
    empty term, which matches no node, stays as it is), or is the only term when there is
    none."""
    affinity = pod_spec.get("affinity") or {}
    node_affinity = affinity.get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    terms = [_with_requirement(term, requirement)
             for term in required.get("nodeSelectorTerms") or []]
    pod_spec["affinity"] = {**affinity, "nodeAffinity": {
        **node_affinity, "requiredDuringSchedulingIgnoredDuringExecution": {
            **required, "nodeSelectorTerms": terms or [
                {"matchExpressions": [copy.deepcopy(requirement)]}]}}}


def _with_requirement(term: KubeObject, requirement: KubeObject) -> KubeObject:
    """``term`` ANDed with ``requirement`` (as it is when empty or already has it)."""
    expressions = term.get("matchExpressions") or []
    if requirement in expressions or not (expressions or term.get("matchFields")):
        return term
    return {**term, "matchExpressions": [*expressions, copy.deepcopy(requirement)]}


def _apply_placement(pod_spec: KubeObject, spec: KubeObject, *, on_demand: bool) -> None:
    """Spot node affinity and tolerations, merged with what the user asked for.

    The node selector is the template's with placement.nodeSelector added; spot nodes are
    selected by a required node affinity (ANDed with the node selector by the scheduler), see
    ``spot_node_selector_terms``; ``on_demand`` requires a node that is not spot instead
    (``on_demand_node_selector_terms``). The spot tolerations come with placement.spot even
    when the template's nodeSelector turned the spot affinity off: tolerating a taint never
    narrows where the pod may run."""
    placement = spec.get("placement") or {}
    selector = {**(pod_spec.get("nodeSelector") or {}), **(placement.get("nodeSelector") or {})}
    if selector:
        pod_spec["nodeSelector"] = selector
    terms = on_demand_node_selector_terms(spec) if on_demand else spot_node_selector_terms(spec)
    if terms is not None:
        affinity = pod_spec.get("affinity") or {}
        node_affinity = affinity.get("nodeAffinity") or {}
        required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
        pod_spec["affinity"] = {**affinity, "nodeAffinity": {
            **node_affinity,
            "requiredDuringSchedulingIgnoredDuringExecution": {**required,
                                                              "nodeSelectorTerms": terms}}}
    spot = placement.get("spot", True) is not False
    tolerations: list[KubeObject] = []
    extra = list(SPOT_TOLERATIONS) if spot else []
    for tol in [*(pod_spec.get("tolerations") or []), *(placement.get("tolerations") or []),
                *extra]:
        if tol not in tolerations:
            tolerations.append(dict(tol))
    if tolerations:
        pod_spec["tolerations"] = tolerations
