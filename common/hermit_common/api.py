"""API constants shared by the operator and the node-agent: one place for names."""

from typing import Final

GROUP: Final = "hermit.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"

SANDBOX_KIND: Final = "AgentSandbox"
SANDBOX_PLURAL: Final = "agentsandboxes"
CHECKPOINT_KIND: Final = "Checkpoint"
CHECKPOINT_PLURAL: Final = "checkpoints"

# Checkpoint.spec.reason
REASONS: Final = ("Preemption", "Eviction", "Interval", "Turn", "Manual", "Suspend")

# Checkpoint.status.phase
CHECKPOINT_PHASES: Final = ("Pending", "Dumping", "Uploading", "Completed", "Failed")

# AgentSandbox.status.phase, derived from conditions by the operator.
SANDBOX_PHASES: Final = (
    "Pending", "Running", "Checkpointing", "Migrating", "Restoring",
    "Suspended", "Succeeded", "Failed",
)

# Labels and annotations the components agree on.
LABEL_SANDBOX: Final = f"{GROUP}/sandbox"
ANNOTATION_RESTORE_FROM: Final = f"{GROUP}/restore-from"
TAINT_INTERRUPTION: Final = f"{GROUP}/interruption"
LABEL_INCARNATION: Final = f"{GROUP}/incarnation"

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
REASON_POD_TERMINATING: Final = "PodTerminating"
REASON_SUSPEND_REQUESTED: Final = "SuspendRequested"
REASON_RESUMED: Final = "Resumed"
REASON_NOT_SUSPENDED: Final = "NotSuspended"
REASON_RESTORE_STARTED: Final = "RestoreStarted"
REASON_RESTORE_COMPLETED: Final = "RestoreCompleted"
REASON_RUNNING: Final = "Running"  # Succeeded/Failed=False while the sandbox is alive

# --- The operator <-> node-agent protocol (see docs/protocol.md) ---------------
# Pods: the operator sets these; the node-agent reads them.
ANNOTATION_WORKSPACE_PATH: Final = f"{GROUP}/workspace-path"  # mount path of the workspace
# Restore outcome, written by the node-agent on the restore pod; read by the operator.
ANNOTATION_RESTORE_PHASE: Final = f"{GROUP}/restore-phase"  # Restoring | Restored | Failed
ANNOTATION_RESTORE_MESSAGE: Final = f"{GROUP}/restore-message"
RESTORE_PHASES: Final = ("Restoring", "Restored", "Failed")
# Checkpoint objects carry the sandbox label (LABEL_SANDBOX) so both sides can select them.
# Reasons whose checkpoint ends the current incarnation once it is durable.
STOPPING_REASONS: Final = ("Preemption", "Eviction", "Suspend")
