"""The grouped linear of MoE experts: rows sorted by expert, one stacked weight, any precision.

    y[rows of e] = x[rows of e] @ w[e]^T     x (M, K), w (E, N, K), counts[e] rows per expert

One autograd function computes all experts. Under FP8 each expert's rows are first laid out
from a 128-row boundary (zero rows fill each expert's last tile: `ExpertRows`), so every 1x128
tile along the rows belongs to one expert. Then every tensor is quantized once for all experts
(x and dy along their features and, from the same read, along their rows for wgrad; the stacked weight in
128x128 blocks once per weight version) and each GEMM is one grouped call over all experts: the
Triton grouped kernels on GPU, a loop of the reference GEMM for the reference backend. The FP8
operands are exactly those of one FP8 linear per expert; results differ only by summation order. The weight
gradient is one stacked (E, N, K) tensor, added into `main_grad` (FP32) when the weight has one.

BF16 (no FP8 recipe) takes the same path with plain matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megafp8.precision.backends import Fp8Backend
from megafp8.precision.formats import TILE
from megafp8.precision.recipe import Fp8Recipe
from megafp8.precision.weight_cache import Fp8WeightCache
from megafp8.precision.wgrad import WeightGradQueue, weight_grad_or_defer


@dataclass
class ExpertRows:
    """Rows sorted by expert, and the padded layout the FP8 GEMMs use: each expert's rows start on a
    128-row boundary (zero rows fill the gaps), so no 1x128 tile along the rows straddles two experts."""

    counts: list[int]
    segments: list[tuple[int, int, int]]  # (expert, first padded row, end padded row) of experts with rows
    total: int  # padded rows
    index: torch.Tensor  # (rows,) padded position of each row
    tile_expert: torch.Tensor  # (total / 128,) int32: the expert of each 128-row tile
    tile_start: torch.Tensor  # (E,) int32: first tile of each expert
    tile_count: torch.Tensor  # (E,) int32: tiles of each expert


def expert_rows(counts: list[int], device: torch.device) -> ExpertRows:
    tiles = [-(-c // TILE) for c in counts]
    starts, padded_starts, segments = [], [], []
    row = padded = 0
    for e, (c, t) in enumerate(zip(counts, tiles)):
        starts.append(row)
        padded_starts.append(padded)
        if c:
            segments.append((e, padded, padded + t * TILE))
        row += c
        padded += t * TILE
    table = torch.tensor([counts, [p - s for p, s in zip(padded_starts, starts)], tiles,
                          [p // TILE for p in padded_starts]], dtype=torch.int64)
    if device.type == "cuda":  # one copy to the device, queued (a copy from pageable memory waits for the GPU)
        table = table.pin_memory().to(device, non_blocking=True)
    else:
        table = table.to(device)
    index = torch.arange(row, device=device) + torch.repeat_interleave(table[1], table[0], output_size=row)
    experts = torch.arange(len(counts), device=device, dtype=torch.int32)
    tile_expert = torch.repeat_interleave(experts, table[2], output_size=padded // TILE)
    return ExpertRows(counts, segments, padded, index, tile_expert, table[3].to(torch.int32),
                      table[2].to(torch.int32))


def _to_padded_layout(x: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    # index_copy_ is a plain row copy; `padded[index] = x` goes through index_put, ~10x slower on an H200.
    return x.new_zeros(rows.total, x.shape[1]).index_copy_(0, rows.index, x)


def _from_padded_layout(padded: torch.Tensor, rows: ExpertRows) -> torch.Tensor:
    return padded.index_select(0, rows.index)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, counts, cache: Optional[Fp8WeightCache], recipe: Optional[Fp8Recipe],
                backend: Optional[Fp8Backend], queue: Optional[WeightGradQueue]):
        ctx.recipe, ctx.backend, ctx.queue = recipe, backend, queue
        if recipe is None:
            segments, y, start = [], x.new_empty(x.shape[0], weight.shape[1]), 0
            for e, c in enumerate(counts):
                if c:
                    torch.matmul(x[start:start + c], weight[e].t(), out=y[start:start + c])
                    segments.append((e, start, start + c))
                start += c
            ctx.segments = segments
            ctx.save_for_backward(x, weight)
            return y
        rows = expert_rows(counts, x.device)
        entry = cache.get(weight, backend, recipe.fmt, recipe.power_of_two_scales)
        # One launch for all experts; the rows' transpose (for wgrad) comes from the same read of x.
        xp_fp8, xp_scale, xt_fp8, xt_scale = backend.quantize_rows_cols(_to_padded_layout(x, rows), recipe.fmt,
                                                                        recipe.power_of_two_scales)
        yp = backend.grouped_gemm_1x128_128x128(xp_fp8, xp_scale, entry, False, rows, x.dtype)
        ctx.rows, ctx.entry = rows, entry
        ctx.save_for_backward(xt_fp8, xt_scale, weight)
        return _from_padded_layout(yp, rows)

    @staticmethod
    def backward(ctx, dy):
        recipe, backend = ctx.recipe, ctx.backend
        *saved, weight = ctx.saved_tensors
        dy = dy.contiguous()
        if recipe is None:
            (x,) = saved
            dx = torch.zeros(dy.shape[0], weight.shape[2], dtype=dy.dtype, device=dy.device)
            for e, lo, hi in ctx.segments:
                dx[lo:hi] = dy[lo:hi] @ weight[e]

            def plain_wgrad() -> torch.Tensor:
                dw = torch.zeros(weight.shape, dtype=dy.dtype, device=dy.device)
                for e, lo, hi in ctx.segments:
                    dw[e] = dy[lo:hi].t() @ x[lo:hi]
                return dw
            return dx, weight_grad_or_defer(weight, plain_wgrad, ctx.queue), None, None, None, None, None
        xt_fp8, xt_scale = saved
        rows, entry = ctx.rows, ctx.entry
        dy_fp8, dy_scale, dyt_fp8, dyt_scale = backend.quantize_rows_cols(
            _to_padded_layout(dy, rows), recipe.grad_fmt, recipe.power_of_two_scales)
        dx = _from_padded_layout(backend.grouped_gemm_1x128_128x128(dy_fp8, dy_scale, entry, True, rows, dy.dtype),
                                 rows)

        def fp8_wgrad() -> torch.Tensor:
            # wgrad contracts over each expert's rows: both operands in 1x128 tiles along the (padded) rows.
            return backend.grouped_gemm_1x128_1x128(dyt_fp8, dyt_scale, xt_fp8, xt_scale, rows, weight.shape[0],
                                                    dy.dtype)
        return dx, weight_grad_or_defer(weight, fp8_wgrad, ctx.queue), None, None, None, None, None


@torch.compiler.disable  # like the eager FP8 linear: a cached weight, our own kernels; compiled code runs around it
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], cache: Optional[Fp8WeightCache],
                   recipe: Optional[Fp8Recipe], backend: Optional[Fp8Backend],
                   wgrad_queue: Optional[WeightGradQueue] = None) -> torch.Tensor:
    """x (M, K) rows sorted by expert, `counts[e]` of them for expert e; weight (E, N, K) -> (M, N).
    `recipe` None: BF16/FP32 matmuls; else FP8 per-tile GEMMs through `backend` with the weight cached in `cache`.
    `wgrad_queue` defers the weight-gradient GEMMs (zero-bubble pipelines)."""
    if sum(counts) != x.shape[0] or len(counts) != weight.shape[0]:
        raise ValueError(f"{len(counts)} expert row counts summing to {sum(counts)} for {x.shape[0]} rows and "
                         f"{weight.shape[0]} experts")
    if x.shape[0] == 0:  # no rows reached this rank's experts: nothing to quantize (the plain path handles it)
        recipe = None
    return _GroupedLinearFn.apply(x, weight, counts, cache, recipe, backend, wgrad_queue)
