"""Training: building a run from a config, the loop, metrics and process setup."""
from megafp8.model import resolve_vocab_size
from megafp8.train.build import build_model
from megafp8.train.trainer import Trainer

__all__ = ["Trainer", "build_model", "resolve_vocab_size"]
