"""The small stateful parts of a run that a checkpoint holds besides the model and optimizer: the step, the RNG.

Each follows torch's `Stateful` protocol (`state_dict` / `load_state_dict`), as the data loader and the loss
scaler do, so the checkpointer (`megafp8/train/checkpointing.py`) saves and restores them without knowing what
they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TrainState:
    """Where the training loop is: optimizer steps taken (applied or skipped) since the run began, and the tokens
    they read. The tokens are counted, not derived from the step: a run started from a checkpoint under another
    `training.global_batch_size` or `data.seq_len` (a new stage) reads another number of tokens a step."""

    tokens_per_step: int = 0  # this run's: global batch x data.seq_len
    step: int = 0
    consumed_tokens: int = 0

    def advance(self) -> None:
        """One optimizer step taken (its data read, whether its update is applied or skipped)."""
        self.step += 1
        self.consumed_tokens += self.tokens_per_step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "consumed_tokens": self.consumed_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        counted = state.get("consumed_tokens")
        self.consumed_tokens = int(counted) if counted is not None else self.step * self._saved_tokens_per_step(state)

    def _saved_tokens_per_step(self, state: dict[str, Any]) -> int:
        """The tokens a step read in the run that saved `state` without a count of them (a checkpoint written before
        it was kept): its config's global batch x data.seq_len, else (an import: no config) this run's."""
        config = state.get("config")
        try:
            return int(config["training"]["global_batch_size"]) * int(config["data"]["seq_len"])
        except (KeyError, TypeError, ValueError):
            return self.tokens_per_step


class RngState:
    """The process's torch RNG (and the CUDA generator of `device` on a GPU), so a resumed run draws what the
    uninterrupted one would have."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)
