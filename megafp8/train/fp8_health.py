"""Sampled FP8 health monitoring of a model's FP8 layers (inputs, weights, output gradients).

Every `interval` steps the first micro-batch's FP8 layers report `megafp8.precision.health`
statistics of what they quantize: the input (1x128 tiles), the weight (128x128 blocks) and the
gradient arriving at the output (1x128 tiles, gradient format). Hooks are attached only for that
micro-batch, so other steps pay nothing.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn as nn

from megafp8.parallel import ExpertLinear, ParallelLinear
from megafp8.precision.health import fp8_stats

log = logging.getLogger("megafp8")


class Fp8HealthMonitor:
    def __init__(self, model: nn.Module, interval: int, underflow_warn: float, at_max_warn: float) -> None:
        self.model, self.interval = model, interval
        self.underflow_warn, self.at_max_warn = underflow_warn, at_max_warn
        self._stats: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._handles: list[Any] = []

    def arm(self, step: int) -> bool:
        """Attach one-shot hooks if `step` is sampled; returns whether it is."""
        if self.interval <= 0 or step % self.interval != 0:
            return False
        self._stats = {}
        for name, layer in self.model.named_modules():
            if isinstance(layer, (ParallelLinear, ExpertLinear)) and layer.runs_fp8:
                self._handles.append(layer.register_forward_hook(self._make_hook(name)))
        return bool(self._handles)

    def _make_hook(self, name: str):
        # The hooks run eagerly even inside a compiled block: traced, each layer's hook (a closure over its name)
        # would be compiled anew, and 64 layers exhaust torch._dynamo's recompile limit on every sampled step.
        @torch.compiler.disable
        def hook(layer: ParallelLinear, inputs: tuple, output: torch.Tensor) -> None:
            if name in self._stats:
                return  # later micro-batches of the sampled step
            cfg = layer.recipe.fp8.gemm_config
            self._stats[name] = {
                "input": fp8_stats(inputs[0], cfg.fmt, power_of_two=cfg.power_of_two),
                # Stacked expert weights (E, N, K) as (E*N, K): their 128x128 blocks never straddle two experts.
                "weight": fp8_stats(layer.weight.reshape(-1, layer.weight.shape[-1]), cfg.fmt, blocks=True,
                                    power_of_two=cfg.power_of_two),
            }
            if output.requires_grad:
                @torch.compiler.disable
                def grad_hook(grad: torch.Tensor) -> None:
                    if "grad" not in self._stats[name]:
                        self._stats[name]["grad"] = fp8_stats(grad, cfg.grad_fmt, power_of_two=cfg.power_of_two)

                output.register_hook(grad_hook)

        return hook

    def collect(self, step: int) -> dict[str, Any]:
        """Detach the hooks and return {layer: {tensor: {stat: float}}}; warns about drifting layers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        keys = [(name, kind, stat) for name, kinds in self._stats.items() for kind, stats in kinds.items()
                for stat in stats]
        values = torch.stack([self._stats[n][k][s].float() for n, k, s in keys]).tolist() if keys else []
        report: dict[str, Any] = {}
        for (name, kind, stat), value in zip(keys, values):  # one device-to-host copy for all statistics
            report.setdefault(name, {}).setdefault(kind, {})[stat] = value
        for name, kinds in report.items():
            for kind, stats in kinds.items():
                if stats["underflow"] > self.underflow_warn or stats["at_max"] > self.at_max_warn:
                    log.warning("step %d: fp8 health of %s %s: %.1f%% underflow, %.1f%% at the FP8 maximum, "
                                "SNR %.1f dB (warn above %.1f%% / %.1f%%)", step, name, kind, 100 * stats["underflow"],
                                100 * stats["at_max"], stats["snr_db"], 100 * self.underflow_warn,
                                100 * self.at_max_warn)
        return report
