"""The grouped linear of MoE experts: rows sorted by expert, one stacked weight, any precision.

    y[rows of e] = x[rows of e] @ w[e]^T     x (M, K), w (E, N, K), counts[e] rows per expert

One autograd function computes all experts, so per step each tensor is quantized once rather
than once per expert: the rows of x (forward) and of dy (dgrad) in one 1x128 quantizer launch
each (row tiles never straddle experts), the stacked weight in one 128x128 launch per weight
version. Only the token-contracting wgrad operands are quantized per expert (their tiles run
along the expert's own rows). The GEMMs then run per expert through the backend's GEMM (a
grouped-GEMM kernel is the next step). The weight gradient is one stacked (E, N, K) tensor, added
into `main_grad` (FP32) when the weight has one, so experts' gradients never cost a full-size
tensor each.

BF16 (no FP8 recipe) takes the same path with plain matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megafp8.precision.backends import Fp8Backend
from megafp8.precision.fp8_linear import Fp8GemmConfig, accumulate_wgrad, quantize_input, wgrad
from megafp8.precision.formats import Fp8Format


@dataclass
class _QuantizedExperts:
    version: tuple[int, int]
    w_fp8: torch.Tensor  # (E, N, K)
    w_scale: list[torch.Tensor]  # per expert, in the backend's GEMM layout
    wt_fp8: torch.Tensor  # (E, K, N)
    wt_scale: list[torch.Tensor]


class GroupedWeightCache:
    """The stacked expert weight quantized in 128x128 blocks (and transposed), for one weight version."""

    def __init__(self) -> None:
        self._entry: Optional[_QuantizedExperts] = None
        self.quantize_count = 0

    def get(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, pow2: bool) -> _QuantizedExperts:
        version = (weight.data_ptr(), weight._version)
        if self._entry is None or self._entry.version != version:
            e, n, k = weight.shape
            w_fp8, w_scale, _, _ = backend.quantize_blocks_with_transpose(weight.detach().reshape(e * n, k), fmt, pow2)
            w_fp8, w_scale = w_fp8.view(e, n, k), w_scale.view(e, n // 128, k // 128)
            # 128x128 blocks are transpose-invariant: each expert's w^T is its w, transposed.
            wt_fp8 = w_fp8.view(torch.uint8).transpose(1, 2).contiguous().view(w_fp8.dtype)
            wt_scale = w_scale.transpose(1, 2)
            self._entry = _QuantizedExperts(
                version, w_fp8, [backend.block_scales_for_gemm(s) for s in w_scale],
                wt_fp8, [backend.block_scales_for_gemm(s.contiguous()) for s in wt_scale])
            self.quantize_count += 1
        return self._entry


def _segments(counts: list[int]) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows."""
    out, start = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append((e, start, start + c))
        start += c
    return out


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, cache, cfg: Optional[Fp8GemmConfig], backend: Optional[Fp8Backend]):
        segments = _segments(counts)
        y = x.new_empty(x.shape[0], weight.shape[1])
        if cfg is None:
            for e, lo, hi in segments:
                torch.matmul(x[lo:hi], weight[e].t(), out=y[lo:hi])
            ctx.save_for_backward(x, weight)
        else:
            entry = cache.get(weight, backend, cfg.fmt, cfg.power_of_two)
            x_fp8, x_scale = quantize_input(x, cfg, backend)
            for e, lo, hi in segments:
                y[lo:hi] = backend.gemm(x_fp8[lo:hi], x_scale[lo:hi], entry.w_fp8[e], entry.w_scale[e], True, x.dtype)
            ctx.save_for_backward(x_fp8, x_scale, weight)
            ctx.entry = entry
        ctx.segments, ctx.cfg, ctx.backend = segments, cfg, backend
        return y

    @staticmethod
    def backward(ctx, dy):
        cfg, backend, segments = ctx.cfg, ctx.backend, ctx.segments
        *saved, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.zeros(dy.shape[0], weight.shape[2], dtype=dy.dtype, device=dy.device)
        dw = torch.zeros(weight.shape, dtype=dy.dtype, device=dy.device)
        if cfg is None:
            (x,) = saved
            for e, lo, hi in segments:
                dx[lo:hi] = dy[lo:hi] @ weight[e]
                dw[e] = dy[lo:hi].t() @ x[lo:hi]
        else:
            x_fp8, x_scale = saved
            entry = ctx.entry
            dy_fp8, dy_scale = backend.quantize_tiles(dy, cfg.grad_fmt, cfg.power_of_two)
            for e, lo, hi in segments:
                dx[lo:hi] = backend.gemm(dy_fp8[lo:hi], dy_scale[lo:hi], entry.wt_fp8[e], entry.wt_scale[e], True,
                                         dy.dtype)
                dw[e] = wgrad(dy[lo:hi], (x_fp8[lo:hi], x_scale[lo:hi]), cfg, backend)
        return dx, accumulate_wgrad(weight, dw), None, None, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], cache: Optional[GroupedWeightCache],
                   cfg: Optional[Fp8GemmConfig], backend: Optional[Fp8Backend]) -> torch.Tensor:
    """x (M, K) rows sorted by expert, `counts[e]` of them for expert e; weight (E, N, K) -> (M, N).
    `cfg` None: BF16/FP32 matmuls; else FP8 per-tile GEMMs through `backend` with the weight cached in `cache`."""
    if sum(counts) != x.shape[0] or len(counts) != weight.shape[0]:
        raise ValueError(f"{len(counts)} expert row counts summing to {sum(counts)} for {x.shape[0]} rows and "
                         f"{weight.shape[0]} experts")
    return _GroupedLinearFn.apply(x, weight, counts, cache, cfg, backend)
