"""Saving and loading training checkpoints."""
from megafp8.checkpoint.local import find_latest, list_checkpoints, load_checkpoint, save_checkpoint

__all__ = ["find_latest", "list_checkpoints", "load_checkpoint", "save_checkpoint"]
