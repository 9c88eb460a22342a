"""A layer's FP8 weight, quantized once per weight version into tensors whose addresses never change.

The cache is keyed on the weight tensor's version counter, which every in-place update (the optimizer's
write-back) bumps, so the micro-batches of one step share one quantization and a stale copy is never used. A new
version is quantized by the backend straight into the kept tensors (no temporary, no copy): compiled blocks read
them as graph inputs and CUDA graphs replay them without copying (they are marked static).

The cache also hands compiled code the weight's FP32 `main_grad` to add its weight gradient into (see
`main_grad_alias`).
"""
from __future__ import annotations

from typing import Optional

import torch

from megafp8.precision.backends import Fp8Backend, QuantizedWeight
from megafp8.precision.formats import Fp8Format
from megafp8.precision.wgrad import main_grad_alias


class Fp8WeightCache:
    """One layer's quantized weight (and, if `keep_transpose`, its transpose), valid for exactly one version of the
    weight tensor.

    `prepare` fills it eagerly before a compiled block runs (see `megafp8.precision.fp8_linear`); a compiled layer
    then reads `entry` instead of quantizing the weight in its graph at every call."""

    def __init__(self, keep_transpose: bool = True) -> None:
        # Without the transpose kept, a GEMM that reads w^T (dgrad) has it made for that call only
        # (`Fp8Backend.weight_transposed`): 1 byte per weight less held through the step, one transpose per call.
        self.keep_transpose = keep_transpose
        self.entry: Optional[QuantizedWeight] = None
        self._version: Optional[tuple[int, int]] = None  # (data_ptr, _version) of the weight it was made from
        self.quantize_count = 0  # how many times the weight was quantized (for tests and metrics)
        self.prepared = False  # True once `prepare` has run: compiled code then reads the cache
        # A fresh alias of the weight's FP32 main_grad, made by each `prepare` (None without one): see
        # `megafp8.precision.wgrad.fresh_alias`.
        self.main_grad_alias: Optional[torch.Tensor] = None

    def get(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, power_of_two: bool) -> QuantizedWeight:
        """The quantization of `weight`'s current version (made now if the weight changed)."""
        version = (weight.data_ptr(), weight._version)
        if self.entry is None:
            self.entry = backend.empty_weight(weight.shape, fmt, weight.device, self.keep_transpose)
            for t in self.entry.tensors():  # unguarded: one compiled block's code serves every block, each its own cache
                if t is not None:
                    torch._dynamo.mark_static_address(t, guard=False)
        if self._version != version:
            with torch.no_grad():
                backend.quantize_weight_(weight.detach(), self.entry, fmt, power_of_two)
            self._version = version
            self.quantize_count += 1
        return self.entry

    @torch.compiler.disable
    def prepare(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, power_of_two: bool) -> None:
        """Quantize `weight` now if it changed since it was last quantized. Run eagerly (never traced) before each
        call of a compiled block, so the block's traced FP8 layers read a current cache.

        Contract: once prepared, compiled code trusts the cache, so `prepare` must run again before any compiled
        call that follows a change to the weight. `Block.forward` does this on every call (training, evaluation,
        recomputation and pipeline stages all go through it)."""
        self.get(weight, backend, fmt, power_of_two)
        self.prepared = True
        self.main_grad_alias = main_grad_alias(weight)

    def traced_entry(self) -> Optional[QuantizedWeight]:
        """What compiled code reads: the prepared quantization, or None (the graph then quantizes the weight)."""
        return self.entry if self.prepared else None

    def clear(self) -> None:
        """Forget the quantized weight (the next forward re-quantizes)."""
        self.entry, self._version, self.prepared, self.main_grad_alias = None, None, False, None
