"""Learning-rate schedules: linear warmup, then cosine, linear, warmup-stable-decay (WSD) or constant."""
from __future__ import annotations

import math

from megafp8.config import OptimizerConfig


def lr_at(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) in a run of `total_steps` steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay_style == "constant":
        return cfg.lr
    if cfg.decay_style == "wsd":
        # The decay phase's first step is at `lr` and its last at `min_lr`: it needs two steps to decay at all (one,
        # which a small fraction of a short run rounds to, ended the run at its peak learning rate).
        decay_steps = max(2, round(total_steps * cfg.wsd_decay_fraction))
        decay_start = max(cfg.warmup_steps, total_steps - decay_steps)
        if step < decay_start:
            return cfg.lr
        progress = (step - decay_start) / max(1, total_steps - 1 - decay_start)
        return cfg.lr + (cfg.min_lr - cfg.lr) * min(1.0, progress)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - 1 - cfg.warmup_steps))
    if cfg.decay_style == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
