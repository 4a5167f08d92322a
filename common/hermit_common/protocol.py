"""The operator <-> node-agent protocol: one vocabulary for both sides.

The two components talk only through Kubernetes objects (docs/protocol.md says who
writes which field). Everything they must agree on lives here: Checkpoint phases and
reasons, restore phases, the labels, annotations and taint, the names of the
Checkpoints either side creates, the Checkpoint builder, the accessors that read a
Checkpoint the same way on both sides, and the time format. ``api`` holds the rest
of the API (group, kinds, AgentSandbox conditions).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from hermit_common.api import API_VERSION, CHECKPOINT_KIND, GROUP, SANDBOX_KIND

KubeObject = dict[str, Any]

# -- Checkpoint.status.phase (an empty status is Pending) ------------------------------
PENDING: Final = "Pending"
DUMPING: Final = "Dumping"
UPLOADING: Final = "Uploading"
COMPLETED: Final = "Completed"
FAILED: Final = "Failed"
CHECKPOINT_PHASES: Final = (PENDING, DUMPING, UPLOADING, COMPLETED, FAILED)
IN_FLIGHT: Final = (PENDING, DUMPING, UPLOADING)
ACTIVE: Final = (DUMPING, UPLOADING)  # a node-agent is working on it

# -- Checkpoint.spec.reason -------------------------------------------------------------
PREEMPTION: Final = "Preemption"  # a cloud notice (node-agent)
EVICTION: Final = "Eviction"  # a drain: cordon or another tool's taint (node-agent)
INTERVAL: Final = "Interval"  # spec.checkpoint.intervalSeconds (operator)
TURN: Final = "Turn"  # an agent turn ended (harness)
MANUAL: Final = "Manual"  # a user
SUSPEND: Final = "Suspend"  # spec.suspend (operator)
REBALANCE: Final = "Rebalance"  # an advisory rebalance recommendation (node-agent)
REASONS: Final = (PREEMPTION, EVICTION, INTERVAL, TURN, MANUAL, SUSPEND, REBALANCE)
# Reasons whose checkpoint ends the current incarnation once it is durable.
STOPPING_REASONS: Final = (PREEMPTION, EVICTION, SUSPEND)
# Stopping reasons after which the sandbox continues on a new pod at once.
MIGRATING_REASONS: Final = (PREEMPTION, EVICTION)

# -- turns (docs/turns.md): what the node-agent decided when a harness said a turn ended ---
TURN_SKIP: Final = "skip"  # nothing a recovery needs changed: no checkpoint, no bytes
TURN_FILES_ONLY: Final = "files-only"  # only files changed (taken as a full checkpoint today)
TURN_FULL: Final = "full"  # processes, sockets or memory changed, or no baseline: full
TURN_DECISIONS: Final = (TURN_SKIP, TURN_FILES_ONLY, TURN_FULL)
# The node-agent's endpoint: POST it with {"turn": N} and a bearer token.
TURNS_PATH: Final = "/v1/namespaces/{namespace}/agentsandboxes/{name}/turns"
# The permission a harness needs on the AgentSandbox (a SubjectAccessReview): the verb
# ``create`` on the (unserved) subresource ``agentsandboxes/turns``.
TURNS_SUBRESOURCE: Final = "turns"
TURNS_VERB: Final = "create"
DEFAULT_TURN_PORT: Final = 9103

# -- the termination hold (docs/protocol.md, "Evictions") --------------------------------
# Pods, set by the operator: "true" when the first container's preStop hook holds the pod's
# termination (a sleep of its grace period) so that the node-agent can save it first.
ANNOTATION_HOLD: Final = f"{GROUP}/termination-hold"
# Pods: the cluster autoscaler may evict them despite their emptyDir volumes and their
# controller it does not know (the workspace moves with the Eviction checkpoint).
ANNOTATION_SAFE_TO_EVICT: Final = "cluster-autoscaler.kubernetes.io/safe-to-evict"

# -- restore outcome on the restore pod (annotation hermit.dev/restore-phase) -----------
RESTORING: Final = "Restoring"
RESTORED: Final = "Restored"
RESTORE_FAILED: Final = "Failed"
RESTORE_PHASES: Final = (RESTORING, RESTORED, RESTORE_FAILED)

# -- labels, annotations, taint ---------------------------------------------------------
# On sandbox pods and Checkpoints: which sandbox, which incarnation (pod) of it.
LABEL_SANDBOX: Final = f"{GROUP}/sandbox"
LABEL_INCARNATION: Final = f"{GROUP}/incarnation"
# On Checkpoints: the node whose node-agent serves the request (the node its pod runs on).
# The API server lets a node-agent create, and write the status of, only Checkpoints
# labelled with its own node (the chart's ValidatingAdmissionPolicy); the node-agent
# cannot change labels (it only writes the status subresource).
LABEL_NODE: Final = f"{GROUP}/node"
# On Checkpoints, set by the operator: "true" once it saw the node label match the node
# its incarnation ran on. Only such checkpoints (or ones it can check now) are restored;
# the policy refuses a node-agent that creates a Checkpoint carrying it.
ANNOTATION_NODE_VERIFIED: Final = f"{GROUP}/node-verified"
# On sandbox pods, set by the operator: the capacity the pod asks for (api.CAPACITIES);
# absent when the sandbox does not require spot nodes. Only the operator reads it.
LABEL_CAPACITY: Final = f"{GROUP}/capacity"
# Pods, set by the operator: restore this Checkpoint (the init waits for it).
ANNOTATION_RESTORE_FROM: Final = f"{GROUP}/restore-from"
# Pods, set by the operator: the workspace mount path to capture.
ANNOTATION_WORKSPACE_PATH: Final = f"{GROUP}/workspace-path"
# Pods, set by the operator: "false" when spec.checkpoint.onPreemption is false (no
# checkpoint on a notice or a drain).
ANNOTATION_ON_PREEMPTION: Final = f"{GROUP}/on-preemption"
# Restore pods, written by the node-agent: RESTORE_PHASES, a message, and with Failed
# whether the same checkpoint may restore on a new pod ("true": S3 or the API was
# unreachable, the agent restarted; "false": refused as corrupt, foreign, incompatible).
ANNOTATION_RESTORE_PHASE: Final = f"{GROUP}/restore-phase"
ANNOTATION_RESTORE_MESSAGE: Final = f"{GROUP}/restore-message"
ANNOTATION_RESTORE_RETRYABLE: Final = f"{GROUP}/restore-retryable"
# Nodes, set by the node-agent with a cordon: this node is going away.
TAINT_INTERRUPTION: Final = f"{GROUP}/interruption"
# Nodes, set by the node-agent once it is ready (and never removed by it): sandbox pods
# require it (HERMIT_REQUIRE_READY_NODE_AGENT), so no sandbox lands on a node whose
# node-agent never came up (a new node without Hermit, a Windows or virtual node).
LABEL_NODE_AGENT: Final = f"{GROUP}/node-agent"
NODE_AGENT_READY: Final = "ready"
# Nodes, set by the node-agent with its ready label: the CHECKPOINT_FORMAT_LEVEL it reads,
# a decimal integer ("2"). A pod that restores a checkpoint of level L > 1 requires it to be
# greater than L - 1 (operator Gt, which compares integers); a node without it (a node-agent
# of a release from before levels) takes no such pod. The agent changes it, never removes it.
LABEL_CHECKPOINT_FORMAT: Final = f"{GROUP}/checkpoint-format"

# -- the checkpoint format level (docs/operations.md, "The node-agent and the manifests") --
# The level of what this release writes (the manifest and the objects it names) and the
# highest it reads: a node-agent reads every level up to its own. 1 is every release from
# before levels were recorded (no Checkpoint status.formatLevel, no node label); 2 added
# manifests with ``chunk_lengths`` (docs/criu.md), which level-1 node-agents refuse. Bump it
# whenever a node-agent of the previous level would refuse or misread what this release
# writes (a new manifest field, a new chunk or image layout), and never otherwise: each bump
# makes restores of new checkpoints wait for upgraded nodes during the next rollout.
CHECKPOINT_FORMAT_LEVEL: Final = 2
# The highest level the CRDs accept (status.formatLevel's maximum): far above any real one,
# low enough that ``str(level - 1)`` is a label value Kubernetes parses as an integer.
MAX_FORMAT_LEVEL: Final = 1_000_000

# -- what a node-agent may write (the chart's node-agent-policy.yaml holds it to this) ---
# The only pod annotations a node-agent writes: a restore's outcome.
NODE_AGENT_POD_ANNOTATIONS: Final = (ANNOTATION_RESTORE_PHASE, ANNOTATION_RESTORE_MESSAGE,
                                     ANNOTATION_RESTORE_RETRYABLE)
# The only Checkpoints a node-agent creates (Interval and Suspend are the operator's,
# Manual a user's).
NODE_AGENT_REASONS: Final = (PREEMPTION, EVICTION, REBALANCE, TURN)
# How every name a node-agent gives a Checkpoint ends (``checkpoint_name`` for its reasons;
# when another node took that name first, a secret 8-hex-digit tag after it:
# hermit_node/control/requests.py): the policy refuses any other, so a node can never take the
# name of the operator's next Interval or Suspend request.
NODE_AGENT_CHECKPOINT_NAMES: Final = \
    "-[0-9]+-(preempt|evict|rebalance|turn[0-9]+)(-r[0-9]+)?(-[0-9a-f]{8})?$"

DEFAULT_WORKSPACE_PATH: Final = "/workspace"
NAME_LIMIT: Final = 253
MESSAGE_LIMIT: Final = 1024  # status.message and restore-message stay short and on one line


# -- reading a Checkpoint (or a pod) the same way on both sides --------------------------

def meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def name_of(obj: Mapping[str, Any]) -> str:
    return str(meta(obj).get("name") or "")


def phase_of(ckpt: Mapping[str, Any]) -> str:
    """status.phase; an empty status is Pending."""
    return str((ckpt.get("status") or {}).get("phase") or PENDING)


def reason_of(ckpt: Mapping[str, Any]) -> str:
    return str((ckpt.get("spec") or {}).get("reason") or "")


def sandbox_of(ckpt: Mapping[str, Any]) -> str | None:
    """The AgentSandbox a Checkpoint is of (spec.sandboxRef.name), or None."""
    ref = ((ckpt.get("spec") or {}).get("sandboxRef") or {}).get("name")
    return str(ref) if ref else None


def incarnation_of(obj: Mapping[str, Any]) -> int | None:
    """The incarnation label of a pod or Checkpoint; None when absent or malformed."""
    try:
        return int((meta(obj).get("labels") or {})[LABEL_INCARNATION])
    except (KeyError, TypeError, ValueError):
        return None


def node_of(ckpt: Mapping[str, Any]) -> str | None:
    """The node label of a Checkpoint (whose node-agent serves it); None when absent."""
    value = (meta(ckpt).get("labels") or {}).get(LABEL_NODE)
    return str(value) if value else None


def format_level_of(ckpt: Mapping[str, Any]) -> int | None:
    """status.formatLevel: the CHECKPOINT_FORMAT_LEVEL the node-agent wrote the checkpoint in
    (recorded with Dumping and Completed); None when absent (a release from before levels:
    level 1) or malformed."""
    value = (ckpt.get("status") or {}).get("formatLevel")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 1 <= value <= MAX_FORMAT_LEVEL else None


def node_selector(node: str) -> str:
    """The label selector of the Checkpoints whose node-agent is ``node``'s."""
    return f"{LABEL_NODE}={node}"


def is_stopping(reason: str) -> bool:
    """Whether a checkpoint of this reason ends the current incarnation once durable."""
    return reason in STOPPING_REASONS


# -- names and the builder ----------------------------------------------------------------

_SUFFIX: Final = {PREEMPTION: "preempt", EVICTION: "evict", SUSPEND: "suspend", INTERVAL: "i"}


def checkpoint_name(sandbox: str, incarnation: int, reason: str, tag: str = "") -> str:
    """``<sandbox>-<incarnation>-<kind><tag>`` (``box-3-preempt``, ``box-3-i1767268800``):
    the name either side gives a Checkpoint it creates; the sandbox part is cut so the
    unique tail always fits."""
    tail = f"-{incarnation}-{_SUFFIX.get(reason, reason.lower())}{tag}"
    return sandbox[:NAME_LIMIT - len(tail)].rstrip("-.") + tail


def owner_reference(sandbox: Mapping[str, Any]) -> KubeObject:
    """The controller reference to an AgentSandbox (its Checkpoints, pods, PDB)."""
    m = meta(sandbox)
    return {"apiVersion": sandbox.get("apiVersion", API_VERSION),
            "kind": sandbox.get("kind", SANDBOX_KIND), "name": m.get("name"),
            "uid": m.get("uid"), "controller": True, "blockOwnerDeletion": True}


def checkpoint_object(sandbox: str, name: str, reason: str, incarnation: int | None = None,
                      *, namespace: str | None = None, node: str | None = None,
                      owner: Mapping[str, Any] | None = None) -> KubeObject:
    """A Checkpoint to create (status empty: Pending), labelled with its sandbox and,
    when known, the incarnation it is of and the node its pod runs on; ``owner``: the
    AgentSandbox object."""
    if reason not in REASONS:
        raise ValueError(f"unknown checkpoint reason {reason!r}")
    labels = {LABEL_SANDBOX: sandbox}
    if incarnation is not None:
        labels[LABEL_INCARNATION] = str(incarnation)
    if node is not None:
        labels[LABEL_NODE] = node
    metadata: KubeObject = {"name": name, "labels": labels}
    if namespace is not None:
        metadata["namespace"] = namespace
    if owner is not None:
        metadata["ownerReferences"] = [owner_reference(owner)]
    return {"apiVersion": API_VERSION, "kind": CHECKPOINT_KIND, "metadata": metadata,
            "spec": {"sandboxRef": {"name": sandbox}, "reason": reason}}


# -- time and messages ------------------------------------------------------------------------

def rfc3339(moment: datetime) -> str:
    """The API's timestamp format (seconds, UTC, Z)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 timestamp as an aware datetime; None when absent or malformed."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def one_line(message: object, limit: int = MESSAGE_LIMIT, *, mark: str = "...") -> str:
    """A message for a status field, an annotation, an Event or an error: one line, at
    most ``limit`` chars, a longer one cut to end with ``mark``. An exception without
    text reads as its type's name. The one helper for this in both components."""
    text = " ".join(str(message).split())
    if not text and isinstance(message, BaseException):
        return type(message).__name__
    return text if len(text) <= limit else text[:limit - len(mark)] + mark
