"""Saving and loading training checkpoints."""
from megafp8.checkpoint.local import check_tensors_match, find_latest, list_checkpoints, load_checkpoint, save_checkpoint

__all__ = ["check_tensors_match", "find_latest", "list_checkpoints", "load_checkpoint", "save_checkpoint"]
