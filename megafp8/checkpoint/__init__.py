"""Saving and loading training checkpoints."""
from megafp8.checkpoint.loading import check_tensors_match, load_checkpoint
from megafp8.checkpoint.local import find_latest, list_checkpoints, save_checkpoint

__all__ = ["check_tensors_match", "find_latest", "list_checkpoints", "load_checkpoint", "save_checkpoint"]
