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

from megafp8.precision.backends import Fp8Backend, QuantizedWeight, StaleExperts
from megafp8.precision.eager import mark_static_address, run_eagerly
from megafp8.precision.formats import Fp8Format
from megafp8.precision.wgrad import main_grad_alias


class Fp8WeightCache:
    """One layer's quantized weight (and, if `keep_transpose`, its transpose), valid for exactly one version of the
    weight tensor.

    `prepare` fills it eagerly before a compiled block runs (see `megafp8.precision.fp8_linear`); a compiled layer
    then reads `entry` instead of quantizing the weight in its graph at every call.

    `per_expert` (stacked expert weights): each expert is quantized when a micro-batch first gives it rows, not when
    the weight changes. The cache keeps each expert's version on the device (`stale`), `prepare` only moves the
    current version on, and the experts' MLP quantizes the experts of its layout that are stale
    (`get_for_rows`, or traced, `megafp8.precision.fp8_ops.quantize_stale_experts`); `get` brings every expert
    up to date. An expert without rows keeps old bytes that no GEMM reads; every expert a GEMM reads has the
    quantization of the current weight, as without `per_expert`."""

    def __init__(self, keep_transpose: bool = True, per_expert: bool = False) -> None:
        # Without the transpose kept, a GEMM that reads w^T (dgrad) has it made for that call only
        # (`Fp8Backend.weight_transposed`): 1 byte per weight less held through the step, one transpose per call.
        self.keep_transpose = keep_transpose
        self.per_expert = per_expert
        self.entry: Optional[QuantizedWeight] = None
        self.stale: Optional[StaleExperts] = None  # per_expert: each expert's version and the current one (device)
        self._version: Optional[tuple[int, int]] = None  # (data_ptr, _version) of the weight it was made from
        self._serial = 0  # per_expert: the current version's number
        self._all_current = False  # per_expert: every expert quantized at the current version (known on the host)
        self.quantize_count = 0  # how many weight versions were quantized (for tests and metrics)
        self.prepared = False  # True once `prepare` has run: compiled code then reads the cache
        # A fresh alias of the weight's FP32 main_grad, made by each `prepare` (None without one): see
        # `megafp8.precision.wgrad.fresh_alias`.
        self.main_grad_alias: Optional[torch.Tensor] = None

    def _allocate(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format) -> None:
        if self.entry is not None:
            return
        self.entry = backend.empty_weight(weight.shape, fmt, weight.device, self.keep_transpose)
        tensors = list(self.entry.tensors())
        if self.per_expert:
            self.stale = StaleExperts(torch.full((weight.shape[0],), -1, dtype=torch.int64, device=weight.device),
                                      torch.zeros(1, dtype=torch.int64, device=weight.device))
            tensors += [self.stale.version, self.stale.current]
        for t in tensors:  # unguarded: one compiled block's code serves every block, each its own cache
            if t is not None:
                mark_static_address(t)

    def _advance(self, weight: torch.Tensor) -> bool:
        """Take note of the weight's version; True where it changed (per_expert: every expert is stale now)."""
        version = (weight.data_ptr(), weight._version)
        if self._version == version:
            return False
        self._version = version
        self.quantize_count += 1
        if self.per_expert:
            self._serial += 1
            with torch.no_grad():
                self.stale.current.fill_(self._serial)
            self._all_current = False
        return True

    def get(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, power_of_two: bool) -> QuantizedWeight:
        """The quantization of `weight`'s current version (made now if the weight changed), of every expert."""
        self._allocate(weight, backend, fmt)
        changed = self._advance(weight)
        with torch.no_grad():
            if not self.per_expert and changed:
                backend.quantize_weight_(weight.detach(), self.entry, fmt, power_of_two)
            elif self.per_expert and not self._all_current:
                backend.quantize_weight_(weight.detach(), self.entry, fmt, power_of_two, self.stale)
                self._all_current = True
        return self.entry

    def get_for_rows(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, power_of_two: bool,
                     tiles_per_expert: torch.Tensor) -> QuantizedWeight:
        """As `get`, for the experts with tiles in `tiles_per_expert` (E,) (a layout's, on the device) only, where
        `per_expert`."""
        if not self.per_expert:
            return self.get(weight, backend, fmt, power_of_two)
        self._allocate(weight, backend, fmt)
        self._advance(weight)
        if not self._all_current:
            with torch.no_grad():
                backend.quantize_weight_(weight.detach(), self.entry, fmt, power_of_two,
                                         StaleExperts(self.stale.version, self.stale.current, tiles_per_expert))
        return self.entry

    @run_eagerly
    def prepare(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, power_of_two: bool) -> None:
        """Quantize `weight` now if it changed since it was last quantized (per_expert: only note its version; the
        experts' MLP quantizes the experts it gives rows). Run eagerly (never traced) before each call of a compiled
        block, so the block's traced FP8 layers read a current cache.

        Contract: once prepared, compiled code trusts the cache, so `prepare` must run again before any compiled
        call that follows a change to the weight. `Block.forward` does this on every call (training, evaluation,
        recomputation and pipeline stages all go through it)."""
        if self.per_expert:
            self._allocate(weight, backend, fmt)
            self._advance(weight)
        else:
            self.get(weight, backend, fmt, power_of_two)
        self.prepared = True
        self.main_grad_alias = main_grad_alias(weight)

    def traced_entry(self) -> Optional[QuantizedWeight]:
        """What compiled code reads: the prepared quantization, or None (the graph then quantizes the weight).
        per_expert: the experts with rows are brought up to date by the graph first."""
        return self.entry if self.prepared else None

    def clear(self) -> None:
        """Forget the quantized weight (the next forward re-quantizes)."""
        self.entry, self._version, self.prepared, self.main_grad_alias = None, None, False, None
        self.stale, self._all_current = None, False
