"""Public helpers for working with runs and checkpoints."""

from comlrl.checkpoint import CheckpointError, find_latest_checkpoint, read_checkpoint_metadata

__all__ = ["read_checkpoint_metadata", "find_latest_checkpoint", "CheckpointError"]
