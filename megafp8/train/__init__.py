"""Training: building a run from a config, the loop, metrics and process setup.

The package's names are imported on first use, so that a module that only reads a run's files
(`megafp8.train.plots`, behind tools/compare_runs.py and tools/plot_runs.py) loads without torch."""
from __future__ import annotations

from typing import Any

__all__ = ["Trainer", "build_model", "resolve_vocab_size"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        from megafp8.train.trainer import Trainer
        return Trainer
    if name == "build_model":
        from megafp8.train.build import build_model
        return build_model
    if name == "resolve_vocab_size":
        from megafp8.model import resolve_vocab_size
        return resolve_vocab_size
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
