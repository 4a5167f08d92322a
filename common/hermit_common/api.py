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
