"""The FP8 linear: `y = x @ w^T` whose fprop, dgrad and wgrad GEMMs run in per-tile scaled FP8.

    forward   x -> x_fp8 (1x128 along K);  y  = x_fp8 @ w_fp8^T            (BF16 out)
    dgrad     dy -> dy_fp8 (1x128 along N); dx = dy_fp8 @ w_fp8               (BF16 out)
    wgrad     dy^T, x^T (1x128 along M);   dw = dy_fp8^T @ x_fp8            (BF16 out, FP32 accumulation)

Forward saves the FP8 input and its scales (1 byte + 1/32 byte per element instead of BF16's
2), and backward re-tiles it along tokens for wgrad. The weight is quantized in 128x128 blocks
once per weight version, together with its transpose for dgrad (128x128 blocks are
transpose-invariant, so both hold the same FP8 values): the cache is keyed on the tensor's
version counter, which every in-place update (the optimizer's write-back) bumps, so
micro-batches of one step share it and a stale copy can never be used.

Every GEMM accumulates in FP32 inside (per 128-wide K block, scales applied in FP32) and
writes BF16, like a BF16 GEMM. The weight gradient is then added into `weight.main_grad`
(FP32, set by the gradient buffer) when the parameter has one, so micro-batches accumulate in
FP32; otherwise it is returned as the weight's gradient.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megafp8.precision.backends import Fp8Backend
from megafp8.precision.formats import FORMATS, TILE, Fp8Format


@dataclass
class _QuantizedWeight:
    version: tuple[int, int]  # (data_ptr, _version) of the weight it was made from
    w_fp8: torch.Tensor  # (N, K)
    w_scale: torch.Tensor  # (N/128, K/128), in the backend's GEMM layout
    wt_fp8: torch.Tensor  # (K, N): the same blocks, transposed, for dgrad
    wt_scale: torch.Tensor  # (K/128, N/128), in the backend's GEMM layout


class Fp8WeightCache:
    """One layer's quantized weight, valid for exactly one version of the weight tensor."""

    def __init__(self) -> None:
        self._entry: Optional[_QuantizedWeight] = None
        self.quantize_count = 0  # how many times the weight was quantized (for tests and metrics)

    def get(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, pow2: bool) -> _QuantizedWeight:
        version = (weight.data_ptr(), weight._version)
        if self._entry is None or self._entry.version != version:
            w_fp8, w_scale, wt_fp8, wt_scale = backend.quantize_blocks_with_transpose(weight.detach(), fmt, pow2)
            self._entry = _QuantizedWeight(version, w_fp8, backend.block_scales_for_gemm(w_scale),
                                           wt_fp8, backend.block_scales_for_gemm(wt_scale))
            self.quantize_count += 1
        return self._entry

    def clear(self) -> None:
        """Forget the quantized weight (the next forward re-quantizes)."""
        self._entry = None


@dataclass(frozen=True)
class Fp8GemmConfig:
    """What one FP8 linear needs from the recipe (kept small so it can ride along into autograd)."""

    fmt: Fp8Format
    grad_fmt: Fp8Format
    power_of_two: bool
    fprop: bool
    dgrad: bool
    wgrad: bool

    @classmethod
    def from_names(cls, fmt: str, grad_fmt: str, power_of_two: bool, fprop: bool, dgrad: bool, wgrad: bool):
        return cls(FORMATS[fmt], FORMATS[grad_fmt], power_of_two, fprop, dgrad, wgrad)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, cache: Fp8WeightCache, cfg: Fp8GemmConfig, backend: Fp8Backend):
        in_shape = x.shape
        x2d = x.reshape(-1, in_shape[-1])  # (M, K)
        entry = cache.get(weight, backend, cfg.fmt, cfg.power_of_two)
        x_fp8 = x_scale = None
        if cfg.fprop or cfg.wgrad:
            x_fp8, x_scale = backend.quantize_tiles(x2d, cfg.fmt, cfg.power_of_two)
        if cfg.fprop:
            y = backend.gemm(x_fp8, x_scale, entry.w_fp8, entry.w_scale, True, x.dtype)
        else:
            y = F.linear(x2d, weight)
        # wgrad in FP8 needs only the FP8 input; otherwise keep the BF16 input.
        ctx.save_for_backward(*((x_fp8, x_scale) if cfg.wgrad else (x2d,)), weight)
        ctx.entry, ctx.cfg, ctx.backend, ctx.in_shape = entry, cfg, backend, in_shape
        return y.reshape(*in_shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        cfg, backend, entry = ctx.cfg, ctx.backend, ctx.entry
        *saved, weight = ctx.saved_tensors
        dy2d = dy.reshape(-1, dy.shape[-1])  # (M, N)
        dx = None
        if ctx.needs_input_grad[0]:
            if cfg.dgrad:
                dy_fp8, dy_scale = backend.quantize_tiles(dy2d, cfg.grad_fmt, cfg.power_of_two)
                dx = backend.gemm(dy_fp8, dy_scale, entry.wt_fp8, entry.wt_scale, True, dy.dtype)
            else:
                dx = dy2d @ weight
            dx = dx.reshape(ctx.in_shape)
        dw = None
        if ctx.needs_input_grad[1]:
            if cfg.wgrad:
                x_fp8, x_scale = saved
                dyt_fp8, dyt_scale = backend.quantize_tiles_transposed(dy2d, cfg.grad_fmt, cfg.power_of_two)
                xt_fp8, xt_scale = backend.retile_transposed(x_fp8, x_scale, cfg.fmt, cfg.power_of_two)
                dw = backend.gemm(dyt_fp8, dyt_scale, xt_fp8, xt_scale, False, dy.dtype)
            else:
                (x2d,) = saved
                dw = dy2d.t() @ x2d
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is not None:
                main_grad.add_(dw)  # FP32 accumulation across micro-batches; the weight itself gets no grad
                dw = None
        return dx, dw, None, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, cache: Fp8WeightCache, cfg: Fp8GemmConfig,
               backend: Fp8Backend) -> torch.Tensor:
    """`x @ weight^T` with FP8 GEMMs; x (..., K) BF16, weight (N, K). Token count M need not be a multiple of 128."""
    m = x.numel() // x.shape[-1]
    if cfg.wgrad and m % TILE != 0 and weight.requires_grad and torch.is_grad_enabled():
        # The wgrad GEMM contracts over tokens in 128-wide tiles: pad tokens with zero rows (zeros add nothing).
        pad = TILE - m % TILE
        x_pad = torch.cat([x.reshape(m, -1), x.new_zeros(pad, x.shape[-1])])
        return _Fp8LinearFn.apply(x_pad, weight, cache, cfg, backend)[:m].reshape(*x.shape[:-1], weight.shape[0])
    return _Fp8LinearFn.apply(x, weight, cache, cfg, backend)
