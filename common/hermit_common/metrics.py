"""Metric names, in one place so dashboards and code agree. Labels come from small fixed sets."""

from typing import Final

NODE_NOTICES: Final = "hermit_node_interruption_notices_total"  # labels: provider, kind
NODE_CHECKPOINT_SECONDS: Final = "hermit_node_checkpoint_duration_seconds"  # labels: phase, result
NODE_CHECKPOINT_BYTES: Final = "hermit_node_checkpoint_bytes_total"  # labels: kind
NODE_RESTORE_SECONDS: Final = "hermit_node_restore_duration_seconds"  # labels: result
