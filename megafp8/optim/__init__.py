"""Optimizers and learning-rate schedules."""
from megafp8.optim.lr_schedule import lr_at
from megafp8.optim.distributed import DistributedAdamW

__all__ = ["DistributedAdamW", "lr_at"]
