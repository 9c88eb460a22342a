"""Dynamic loss scaling for the FP16 path (GPUs without BF16: V100, T4).

The loss is multiplied by `scale` before backward so small gradients survive FP16's narrow
range. When any rank finds an inf/nan gradient (the caller agrees on that across ranks first),
the step is skipped. After `hysteresis` such steps the scale is multiplied by `backoff_factor`
(never below `min_scale`); after `growth_interval` consecutive good steps it is multiplied by
`growth_factor` and the hysteresis budget is refilled (Megatron's semantics).
"""
from __future__ import annotations

from typing import Any

from megafp8.config import PrecisionConfig


class DynamicLossScaler:
    def __init__(self, initial_scale: float, growth_factor: float, backoff_factor: float, growth_interval: int,
                 hysteresis: int, min_scale: float) -> None:
        self.scale = initial_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis, self.min_scale = growth_interval, hysteresis, min_scale
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    @classmethod
    def from_config(cls, p: PrecisionConfig) -> "DynamicLossScaler":
        return cls(p.loss_scale_initial, p.loss_scale_growth_factor, p.loss_scale_backoff_factor,
                   p.loss_scale_growth_interval, p.loss_scale_hysteresis, p.loss_scale_min)

    def update(self, found_inf: bool) -> None:
        """Account for one step whose gradients were (not) finite on every rank."""
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps == self.growth_interval:
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])
