"""The grouped linear of MoE experts: rows sorted by expert, one stacked weight, any precision.

    y[rows of e] = x[rows of e] @ w[e]^T     x (M, K), w (E, N, K), counts[e] rows per expert

One autograd function computes all experts. Under FP8 each expert's rows are first laid out
from a 128-row boundary (zero rows fill each expert's last tile: `ExpertRows`), so every 1x128
tile along the rows belongs to one expert. Then every tensor is quantized once for all experts
(x and dy along their rows, dy and x again along the rows for wgrad, the stacked weight in
128x128 blocks once per weight version) and each GEMM is one grouped call over all experts: the
Triton grouped kernels on GPU, a loop of the backend's GEMM for the reference backend. The FP8
operands are exactly those of one FP8 linear per expert; results differ only by summation order. The weight
gradient is one stacked (E, N, K) tensor, added into `main_grad` (FP32) when the weight has one.

BF16 (no FP8 recipe) takes the same path with plain matmuls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megafp8.precision.backends import Fp8Backend
from megafp8.precision.fp8_linear import Fp8GemmConfig, WeightGradQueue, quantize_input, weight_grad_or_defer
from megafp8.precision.formats import TILE, Fp8Format


@dataclass
class _QuantizedExperts:
    version: tuple[int, int]
    w_fp8: torch.Tensor  # (E, N, K)
    w_scale: torch.Tensor  # (E, N/128, K/128)
    wt_fp8: torch.Tensor  # (E, K, N)
    wt_scale: torch.Tensor  # (E, K/128, N/128)


class GroupedWeightCache:
    """The stacked expert weight quantized in 128x128 blocks (and transposed), for one weight version."""

    def __init__(self) -> None:
        self._entry: Optional[_QuantizedExperts] = None
        self.quantize_count = 0

    def get(self, weight: torch.Tensor, backend: Fp8Backend, fmt: Fp8Format, pow2: bool) -> _QuantizedExperts:
        version = (weight.data_ptr(), weight._version)
        if self._entry is None or self._entry.version != version:
            e, n, k = weight.shape
            w_fp8, w_scale = backend.quantize_blocks(weight.detach().reshape(e * n, k), fmt, pow2)
            w_fp8, w_scale = w_fp8.view(e, n, k), w_scale.view(e, n // TILE, k // TILE)
            # 128x128 blocks are transpose-invariant: each expert's w^T is its w, transposed.
            wt_fp8 = w_fp8.view(torch.uint8).transpose(1, 2).contiguous().view(w_fp8.dtype)
            self._entry = _QuantizedExperts(version, w_fp8, w_scale, wt_fp8, w_scale.transpose(1, 2).contiguous())
            self.quantize_count += 1
        return self._entry


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
    def forward(ctx, x, weight, counts, cache, cfg: Optional[Fp8GemmConfig], backend: Optional[Fp8Backend],
                queue: Optional[WeightGradQueue]):
        ctx.cfg, ctx.backend, ctx.queue = cfg, backend, queue
        if cfg is None:
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
        entry = cache.get(weight, backend, cfg.fmt, cfg.power_of_two)
        xp_fp8, xp_scale = quantize_input(_to_padded_layout(x, rows), cfg, backend)  # one launch for all experts
        yp = backend.grouped_gemm(xp_fp8, xp_scale, entry.w_fp8, entry.w_scale, rows, x.dtype)
        ctx.rows, ctx.entry = rows, entry
        ctx.save_for_backward(xp_fp8, xp_scale, weight)
        return _from_padded_layout(yp, rows)

    @staticmethod
    def backward(ctx, dy):
        cfg, backend = ctx.cfg, ctx.backend
        *saved, weight = ctx.saved_tensors
        dy = dy.contiguous()
        if cfg is None:
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
        xp_fp8, xp_scale = saved
        rows, entry = ctx.rows, ctx.entry
        dyp = _to_padded_layout(dy, rows)
        dy_fp8, dy_scale = backend.quantize_tiles(dyp, cfg.grad_fmt, cfg.power_of_two)
        dxp = backend.grouped_gemm(dy_fp8, dy_scale, entry.wt_fp8, entry.wt_scale, rows, dy.dtype)
        dx = _from_padded_layout(dxp, rows)

        def fp8_wgrad() -> torch.Tensor:
            # wgrad contracts over each expert's rows: both operands in 1x128 tiles along the (padded) rows.
            dyt_fp8, dyt_scale = backend.quantize_tiles_transposed(dyp, cfg.grad_fmt, cfg.power_of_two)
            xt_fp8, xt_scale = backend.retile_transposed(xp_fp8, xp_scale, cfg.fmt, cfg.power_of_two)
            return backend.grouped_wgrad(dyt_fp8, dyt_scale, xt_fp8, xt_scale, rows, weight.shape[0], dy.dtype)
        return dx, weight_grad_or_defer(weight, fp8_wgrad, ctx.queue), None, None, None, None, None


@torch.compiler.disable  # like the eager FP8 linear: a cached weight, our own kernels; compiled code runs around it
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int], cache: Optional[GroupedWeightCache],
                   cfg: Optional[Fp8GemmConfig], backend: Optional[Fp8Backend],
                   wgrad_queue: Optional[WeightGradQueue] = None) -> torch.Tensor:
    """x (M, K) rows sorted by expert, `counts[e]` of them for expert e; weight (E, N, K) -> (M, N).
    `cfg` None: BF16/FP32 matmuls; else FP8 per-tile GEMMs through `backend` with the weight cached in `cache`.
    `wgrad_queue` defers the weight-gradient GEMMs (zero-bubble pipelines)."""
    if sum(counts) != x.shape[0] or len(counts) != weight.shape[0]:
        raise ValueError(f"{len(counts)} expert row counts summing to {sum(counts)} for {x.shape[0]} rows and "
                         f"{weight.shape[0]} experts")
    if x.shape[0] == 0:  # no rows reached this rank's experts: nothing to quantize (the plain path handles it)
        cfg = None
    return _GroupedLinearFn.apply(x, weight, counts, cache, cfg, backend, wgrad_queue)
