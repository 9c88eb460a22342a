"""Optimizers and learning-rate schedules."""
from megafp8.optim.lr_schedule import lr_at
from megafp8.optim.mixed_precision import MixedPrecisionAdamW

__all__ = ["MixedPrecisionAdamW", "lr_at"]
