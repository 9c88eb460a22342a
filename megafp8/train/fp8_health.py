"""Sampled FP8 health monitoring of a model's FP8 layers (inputs, weights, output gradients).

Every `interval` steps the first micro-batch's FP8 layers report `megafp8.precision.health`
statistics of what they quantize: the input (1x128 tiles), the weight (128x128 blocks) and the
gradient arriving at the output (1x128 tiles, gradient format). Hooks are attached only for that
micro-batch, so other steps pay nothing; compiled blocks run uncompiled during the sampled step
(`Block.observed`), so no hook ever enters a compiled graph, and recomputed, so that step keeps no more for
backward than a compiled one would (the hooks record on the first forward only). The two projections of a fused
FP8 SwiGLU MLP never run as modules of their own: the MLP's hook measures the gate/up input, and its observer
(`MlpObserver`) the tensors the fused function makes on the way (the gate/up output gu in forward; the output
gradient and SwiGLU's output gradient in backward), from which SwiGLU's output and gu's gradient are measured as
the fused path quantizes them, in FP32; what the step computes is untouched and no GEMM is recomputed.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megafp8.model.attention import Attention
from megafp8.model.mlp import SwiGLU
from megafp8.model.moe import RoutedExperts
from megafp8.model.transformer import Block
from megafp8.parallel import ParallelLinear
from megafp8.precision import GemmLayer, MlpObserver
from megafp8.precision.eager import run_eagerly
from megafp8.precision.health import ChunkSums, RowMaker, fp8_stats, fp8_stats_of_rows
from megafp8.precision.producers import swiglu, swiglu_backward

log = logging.getLogger("megafp8")


def is_sampled(step: int, interval: int) -> bool:
    """Whether the 0-based training `step` samples FP8 health every `interval` steps (0: never)."""
    return interval > 0 and step % interval == 0


def every_stage(report: dict[str, Any], pp_group: Optional[dist.ProcessGroup], pp: int) -> dict[str, Any]:
    """The FP8 health of every pipeline stage's layers: this rank's `report` (its stages' layers, named as in the
    whole model) joined with the other stages' (collective over `pp_group`; `report` itself without pipelining).
    Rank 0 alone writes the record, and it holds only its own stages' layers."""
    if pp_group is None:
        return report
    stages: list[Any] = [None] * pp
    dist.all_gather_object(stages, report, group=pp_group)
    return {name: kinds for stage in stages for name, kinds in stage.items()}


def _sums_of(layer: nn.Module) -> ChunkSums:
    """The layer's FP8 backend's health sums (one pass over each tensor on a GPU backend)."""
    return layer.fp8_backend_for(layer.weight.device).health_sums


class Fp8HealthMonitor:
    def __init__(self, model: nn.Module, interval: int, underflow_warn: float, at_max_warn: float) -> None:
        self.model, self.interval = model, interval
        self.underflow_warn, self.at_max_warn = underflow_warn, at_max_warn
        self._stats: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._handles: list[Any] = []

    def arm(self, step: int) -> bool:
        """Attach one-shot hooks if `step` is sampled; returns whether it is. What an earlier sample left attached
        (a step that raised before `collect`) is detached first."""
        self._detach()
        if not is_sampled(step, self.interval):
            return False
        self._stats = {}
        names = {m: n for n, m in self.model.named_modules()}
        for layer, name in names.items():
            if isinstance(layer, GemmLayer) and layer.runs_fp8:
                self._handles.append(layer.register_forward_hook(self._make_hook(name)))
            # The MLP's hook and observer stand in for its projections' hooks where it may run fused, which needs
            # both in FP8; with one kept BF16 (precision.bf16_layers) the FP8 one reports through its own hook.
            elif isinstance(layer, SwiGLU) and layer.gate_up_proj.runs_fp8 and layer.down_proj.runs_fp8:
                gate_up_name, down_name = names[layer.gate_up_proj], names[layer.down_proj]
                self._handles.append(layer.register_forward_hook(self._make_mlp_hook(gate_up_name), with_kwargs=True))
                layer.observer = self._mlp_observer(layer, gate_up_name, down_name)
        self._set_observed(bool(self._handles))
        return bool(self._handles)

    def _set_observed(self, observed: bool) -> None:
        """Compiled blocks run uncompiled while observed (see `Block.observed`): the hooks never enter a graph; the
        experts' fused FP8 MLP runs as its two grouped linears (`RoutedExperts.observed`), and the QKV projection
        without RoPE fused in (`Attention.observed`): their own hooks then fire."""
        for module in self.model.modules():
            if isinstance(module, (Block, RoutedExperts, Attention)):
                module.observed = observed
            elif isinstance(module, SwiGLU) and not observed:
                module.observer = None

    def _record(self, name: str, layer: nn.Module, x: torch.Tensor) -> None:
        x2d = x.reshape(-1, x.shape[-1])
        self._record_rows(name, layer, lambda start, stop: x2d[start:stop], *x2d.shape)

    def _record_rows(self, name: str, layer: nn.Module, rows: RowMaker, count: int, width: int) -> None:
        """`_record` of an input (count, width) that `rows(start, stop)` makes a chunk of rows at a time."""
        fp8, sums = layer.recipe.fp8, _sums_of(layer)
        self._stats[name] = {
            "input": fp8_stats_of_rows(rows, count, width, fp8.fmt, power_of_two=fp8.power_of_two_scales, sums=sums),
            # Stacked expert weights (E, N, K) as (E*N, K): their 128x128 blocks never straddle two experts.
            "weight": fp8_stats(layer.weight.reshape(-1, layer.weight.shape[-1]), fp8.fmt, blocks=True,
                                power_of_two=fp8.power_of_two_scales, sums=sums),
        }

    def _record_grad(self, name: str, layer: nn.Module, grad: torch.Tensor) -> None:
        grad2d = grad.reshape(-1, grad.shape[-1])
        self._record_grad_rows(name, layer, lambda start, stop: grad2d[start:stop], *grad2d.shape)

    def _record_grad_rows(self, name: str, layer: nn.Module, rows: RowMaker, count: int, width: int) -> None:
        if name in self._stats and "grad" not in self._stats[name]:
            fp8 = layer.recipe.fp8
            self._stats[name]["grad"] = fp8_stats_of_rows(rows, count, width, fp8.grad_fmt,
                                                          power_of_two=fp8.power_of_two_scales, sums=_sums_of(layer))

    def _make_hook(self, name: str):
        # The hooks run eagerly even inside a compiled block: traced, each layer's hook (a closure over its name)
        # would be compiled anew, and 64 layers exhaust torch._dynamo's recompile limit on every sampled step.
        @run_eagerly
        def hook(layer: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            if name in self._stats:
                return  # later micro-batches of the sampled step
            with torch.no_grad():
                x = layer.gemm_input(inputs) if isinstance(layer, ParallelLinear) else inputs[0]
            self._record(name, layer, x)
            if output.requires_grad:
                output.register_hook(run_eagerly(lambda grad: self._record_grad(name, layer, grad)))

        return hook

    def _make_mlp_hook(self, gate_up_name: str):
        """For a SwiGLU whose projections may run as one fused FP8 function (their own hooks then do not fire): the
        gate/up projection's input, norm(x) where the MLP is called with a norm (a keyword: the hook is registered
        `with_kwargs`), in the model's dtype as every layer's hook measures a fused norm's output (the fused FP8 path
        quantizes the norm's FP32 output; these are the statistics of its BF16 rounding). Its output and SwiGLU's
        tensors come from the MLP's observer."""
        @run_eagerly
        def hook(mlp: SwiGLU, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if gate_up_name in self._stats:
                return  # the layers ran (and were observed) one by one, or a later micro-batch or recomputation
            with torch.no_grad():
                norm = kwargs.get("norm", args[1] if len(args) > 1 else None)
                x = args[0] if norm is None else norm(args[0])
            self._record(gate_up_name, mlp.gate_up_proj, x)

        return hook

    def _mlp_observer(self, mlp: SwiGLU, gate_up_name: str, down_name: str) -> MlpObserver:
        """What the fused FP8 MLP hands over as it runs (`MlpObserver`): the down projection's input, SwiGLU's
        output in FP32 as the fused path quantizes it, from the gate/up output gu; in backward the output gradient
        and gu's gradient, from gu and SwiGLU's output gradient. Each is measured a chunk of rows at a time
        (`fp8_stats_of_rows`) and nothing is kept: no GEMM is recomputed and no (tokens, 2 x FFN) tensor is made.
        Under sequence parallelism these tensors hold the tensor-parallel group's gathered tokens (what the fused
        path quantizes), the gate/up input this rank's. Like the hooks, the callbacks run eagerly if ever traced."""
        gate_up, down = mlp.gate_up_proj, mlp.down_proj

        @run_eagerly
        def forward(gu: torch.Tensor) -> None:
            if down_name in self._stats:
                return  # a later micro-batch, or the forward recomputed
            with torch.no_grad():
                self._record_rows(down_name, down, lambda start, stop: swiglu(gu[start:stop]), gu.shape[0],
                                  gu.shape[1] // 2)

        @run_eagerly
        def backward(dy: torch.Tensor, gu: torch.Tensor, da: torch.Tensor) -> None:
            with torch.no_grad():
                self._record_grad(down_name, down, dy)
                self._record_grad_rows(gate_up_name, gate_up,
                                       lambda start, stop: swiglu_backward(gu[start:stop], da[start:stop]),
                                       gu.shape[0], gu.shape[1])

        return MlpObserver(forward, backward)

    def _detach(self) -> None:
        if not self._handles:  # nothing attached (the flags and observers are set only with hooks)
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._set_observed(False)

    def collect(self, step: int) -> dict[str, Any]:
        """Detach the hooks and return {layer: {tensor: {stat: float}}}; warns about drifting layers."""
        self._detach()
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
