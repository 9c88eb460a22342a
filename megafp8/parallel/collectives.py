"""Tensor-parallel collectives, as plain functions and as conjugate autograd pairs.

Activations in sequence-parallel regions are token-major `(tokens, features)` tensors split
along dim 0: rank r holds the r-th contiguous 1/tp of the micro-batch's flattened tokens (norms
and residual adds are per token, so any token split works, and dim 0 keeps every gather and
reduce-scatter a contiguous, copy-free collective).

Pairs (forward / backward), Megatron's:
    copy_to_tp            identity     / all-reduce       (input of a TP region, no SP)
    reduce_from_tp        all-reduce   / identity         (output of a TP region, no SP)
    gather_from_sp        all-gather   / reduce-scatter   (input of a TP region, SP)
    reduce_scatter_to_sp  reduce-scatter / all-gather     (output of a TP region, SP)
    gather_from_tp_last   all-gather along the last dim / its slice (vocab-parallel logits for inference)
Every function is the identity on a TP group of one.

`all_gather_quantized` moves an activation quantized both ways (FP8 bytes along its features for the forward
GEMM and along its tokens for wgrad, plus their FP32 1x128 scales) instead of the BF16 tensor: as many bytes,
and no BF16 copy on every rank to quantize again. The column-parallel FP8 linear uses it under SP.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megafp8.parallel.dims import TensorParallel
from megafp8.parallel.flat import all_gather_flat, reduce_scatter_flat
from megafp8.precision.quantize import mn_major

# ------------------------------------------------------------------------------------ plain


def all_reduce(x: torch.Tensor, tp: TensorParallel, async_op: bool = False) -> Optional[dist.Work]:
    """Sum `x` over the TP group, in place."""
    if not tp.enabled:
        return None
    return dist.all_reduce(x, group=tp.group, async_op=async_op)


def all_gather_rows(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(n, ...) on each rank -> (tp * n, ...), rank order."""
    if not tp.enabled:
        return x
    if x.dtype.is_floating_point and x.element_size() == 1:  # FP8: move the bytes (not every backend knows FP8),
        # gathered into a byte tensor that is then viewed as FP8 (a traced graph then writes through no dtype view)
        out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=torch.uint8, device=x.device)
        all_gather_flat(out, x.contiguous().view(torch.uint8), group=tp.group)
        return out.view(x.dtype)
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x.contiguous(), group=tp.group)
    return out


def reduce_scatter_rows(x: torch.Tensor, tp: TensorParallel,
                        async_op: bool = False) -> tuple[torch.Tensor, Optional[dist.Work]]:
    """(tp * n, ...) partial sums on each rank -> this rank's (n, ...) rows of the sum."""
    if not tp.enabled:
        return x, None
    if x.shape[0] % tp.size != 0:
        raise ValueError(f"cannot reduce-scatter {x.shape[0]} tokens over {tp.size} tensor-parallel ranks")
    out = torch.empty((x.shape[0] // tp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = reduce_scatter_flat(out, x.contiguous(), group=tp.group, async_op=async_op)
    return out, work


def all_gather_quantized(x_fp8: torch.Tensor, x_scale: torch.Tensor, xt_fp8: Optional[torch.Tensor],
                         xt_scale: Optional[torch.Tensor], tp: TensorParallel) -> tuple[Optional[torch.Tensor], ...]:
    """Gather an activation quantized both ways (`quantize_rows_cols` layouts: FP8 rows (n, K) with (n, K/128)
    scales, x^T (K, n) with (K, n/128) scales; n a multiple of 128, so no tile along the rows straddles two ranks)
    -> every rank's rows in rank order, in the same layouts (scales column-major). xt_fp8 None: rows only."""
    if not tp.enabled:
        return x_fp8, x_scale, xt_fp8, xt_scale
    rows = all_gather_rows(x_fp8, tp)
    row_scales = mn_major(all_gather_rows(x_scale.contiguous(), tp))
    if xt_fp8 is None:  # quantized along the features only (no weight gradient)
        return rows, row_scales, None, None
    k, n = xt_fp8.shape
    # x^T's rows are features: gather them stacked by rank, then interleave into (K, tp * n).
    stacked = all_gather_rows(xt_fp8, tp).view(torch.uint8).view(tp.size, k, n)
    cols = stacked.permute(1, 0, 2).reshape(k, tp.size * n).view(xt_fp8.dtype)
    col_scales = all_gather_rows(xt_scale.t().contiguous(), tp).t()  # column-major: the rows' tiles are outermost
    return rows, row_scales, cols, col_scales


# ---------------------------------------------------------------------------- autograd pairs


class _CopyToTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, dy):
        dy = dy.clone()
        all_reduce(dy, ctx.tp)
        return dy, None


class _ReduceFromTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        x = x.clone()
        all_reduce(x, tp)
        return x

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _GatherFromSp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return all_gather_rows(x, tp)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter_rows(dy, ctx.tp)[0], None


class _ReduceScatterToSp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return reduce_scatter_rows(x, tp)[0]

    @staticmethod
    def backward(ctx, dy):
        return all_gather_rows(dy, ctx.tp), None


class _GatherFromTpLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        rows = all_gather_rows(x.movedim(-1, 0), tp)  # (tp * n_local, ...)
        return rows.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, dy):
        return dy.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _CopyToTp.apply(x, tp) if tp.enabled else x


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ReduceFromTp.apply(x, tp) if tp.enabled else x


def gather_from_sp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _GatherFromSp.apply(x, tp) if tp.enabled else x


def reduce_scatter_to_sp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _ReduceScatterToSp.apply(x, tp) if tp.enabled else x


def to_tp_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """An activation every TP rank needs whole inside a TP region (all tokens), whose gradient each rank's
    part of the region contributes to: gathered under SP, else replicated; gradients summed over TP."""
    return gather_from_sp(x, tp) if tp.sp else copy_to_tp(x, tp)


def gather_from_tp_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    return _GatherFromTpLast.apply(x, tp) if tp.enabled else x
