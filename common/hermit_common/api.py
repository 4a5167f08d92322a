"""API constants shared by the operator and the node-agent: one place for names."""

from typing import Final

GROUP: Final = "hermit.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"

SANDBOX_KIND: Final = "AgentSandbox"
SANDBOX_PLURAL: Final = "agentsandboxes"
CHECKPOINT_KIND: Final = "Checkpoint"
CHECKPOINT_PLURAL: Final = "checkpoints"

# AgentSandbox.status.phase, derived from conditions by the operator.
PHASE_PENDING: Final = "Pending"
PHASE_RUNNING: Final = "Running"
PHASE_CHECKPOINTING: Final = "Checkpointing"
PHASE_MIGRATING: Final = "Migrating"
PHASE_RESTORING: Final = "Restoring"
PHASE_SUSPENDED: Final = "Suspended"
PHASE_SUCCEEDED: Final = "Succeeded"
PHASE_FAILED: Final = "Failed"
SANDBOX_PHASES: Final = (
    PHASE_PENDING, PHASE_RUNNING, PHASE_CHECKPOINTING, PHASE_MIGRATING, PHASE_RESTORING,
    PHASE_SUSPENDED, PHASE_SUCCEEDED, PHASE_FAILED,
)
PHASES_FINISHED: Final = (PHASE_SUCCEEDED, PHASE_FAILED)

# Pod.status.phase (Kubernetes' own values), as the operator and the node-agent read them.
POD_PENDING: Final = "Pending"
POD_RUNNING: Final = "Running"
POD_SUCCEEDED: Final = "Succeeded"
POD_FAILED: Final = "Failed"
POD_ENDED: Final = (POD_SUCCEEDED, POD_FAILED)

# AgentSandbox.status.conditions[].type, written by the operator only.
COND_ACCEPTED: Final = "Accepted"  # the spec is valid and can be run
COND_READY: Final = "Ready"  # the sandbox pod runs and its containers are ready
COND_CHECKPOINTING: Final = "Checkpointing"
COND_RESTORING: Final = "Restoring"
COND_MIGRATING: Final = "Migrating"
COND_SUSPENDED: Final = "Suspended"
COND_SUCCEEDED: Final = "Succeeded"  # the sandbox's command exited 0
COND_FAILED: Final = "Failed"  # the sandbox's command failed; Hermit does not restart it

# Condition reasons (CamelCase, one meaning each).
REASON_SPEC_VALID: Final = "SpecValid"
REASON_INVALID_SPEC: Final = "InvalidSpec"
REASON_POD_CREATING: Final = "PodCreating"
REASON_POD_PENDING: Final = "PodPending"
REASON_POD_RUNNING: Final = "PodRunning"
REASON_POD_NOT_READY: Final = "ContainersNotReady"
REASON_POD_SUCCEEDED: Final = "PodSucceeded"
REASON_POD_FAILED: Final = "PodFailed"
REASON_POD_LOST: Final = "PodLost"  # deleted, evicted or disrupted under a live sandbox
# The kubelet refused a bound pod at admission, before anything ran (a Normal Event).
REASON_POD_REJECTED: Final = "PodRejected"
REASON_POD_TERMINATING: Final = "PodTerminating"
REASON_SUSPEND_REQUESTED: Final = "SuspendRequested"
REASON_RESUMED: Final = "Resumed"
REASON_NOT_SUSPENDED: Final = "NotSuspended"
# Condition and Event reasons of the checkpoint/restore protocol.
REASON_CHECKPOINT_IN_PROGRESS: Final = "CheckpointInProgress"
REASON_CHECKPOINT_COMPLETED: Final = "CheckpointCompleted"
REASON_CHECKPOINT_FAILED: Final = "CheckpointFailed"
REASON_NO_CHECKPOINT_IN_PROGRESS: Final = "NoCheckpointInProgress"
REASON_RESTORE_FAILED: Final = "RestoreFailed"
REASON_RESTORE_STARTED: Final = "RestoreStarted"
# Event on a pod whose restore the node-agent refuses to start (not the operator's pod, or
# from a checkpoint it did not verify: hermit_node.control.planner.restore_authority).
REASON_RESTORE_REFUSED: Final = "RestoreRefused"
REASON_RESTORE_COMPLETED: Final = "RestoreCompleted"
# A move's replacement pod, created while its checkpoint is taken (overlap), and deleted
# when that checkpoint does not complete.
REASON_REPLACEMENT_CREATED: Final = "ReplacementCreated"
REASON_REPLACEMENT_DELETED: Final = "ReplacementDeleted"
REASON_RUNNING: Final = "Running"  # Succeeded/Failed=False while the sandbox is alive
# Ready=False while the pod waits for a node: for a spot node (WaitingForSpotCapacity), or
# for any node its requirements allow (Unschedulable); both carry the scheduler's message.
REASON_WAITING_FOR_SPOT: Final = "WaitingForSpotCapacity"
REASON_UNSCHEDULABLE: Final = "Unschedulable"
# No spot node took the pod within spec.placement.fallbackToOnDemandAfterSeconds: it is
# replaced by one that asks for an on-demand node (condition reason and Warning Event).
REASON_ON_DEMAND_FALLBACK: Final = "OnDemandFallback"

# AgentSandbox.status.capacity (and the pod label hermit.dev/capacity): the capacity the
# current pod asks for.
CAPACITY_SPOT: Final = "spot"
CAPACITY_ON_DEMAND: Final = "on-demand"
CAPACITIES: Final = (CAPACITY_SPOT, CAPACITY_ON_DEMAND)

# The operator <-> node-agent protocol (phases, reasons, labels, annotations) is in
# hermit_common.protocol.

# operator
# AgentSandbox condition and Event reasons for restores that need another try or another
# checkpoint, for losses and for forks whose checkpoint is not usable (yet).
REASON_RESTORE_RETRYING: Final = "RestoreRetrying"  # transient failure: same checkpoint, later
REASON_RESTORE_FALLBACK: Final = "RestoreFallback"  # refused: the previous checkpoint instead
REASON_NO_USABLE_CHECKPOINT: Final = "NoUsableCheckpoint"  # refused, none older: from scratch
REASON_WORK_LOST: Final = "WorkLost"  # a lost pod's newest checkpoint predates its end
REASON_CHECKPOINT_NOT_FOUND: Final = "CheckpointNotFound"
# A Checkpoint whose node the operator could not verify: failed when it is mislabelled,
# not restored by a fork (spec.restoreFrom) while it lacks the node-verified mark.
REASON_CHECKPOINT_UNTRUSTED: Final = "CheckpointUntrusted"
# Event on a Checkpoint whose spec.sandboxRef names no AgentSandbox (the operator fails it).
REASON_SANDBOX_NOT_FOUND: Final = "SandboxNotFound"

# Keys of the Secret that spec.checkpoint.storage.secretRef names (S3 credentials, the AWS
# SDKs' own names); the session token is optional (temporary credentials).
STORAGE_SECRET_ACCESS_KEY_ID: Final = "AWS_ACCESS_KEY_ID"
STORAGE_SECRET_SECRET_ACCESS_KEY: Final = "AWS_SECRET_ACCESS_KEY"
STORAGE_SECRET_SESSION_TOKEN: Final = "AWS_SESSION_TOKEN"
