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
    """Where the training loop is: optimizer steps taken (applied or skipped) since the run began."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


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
