"""The row permutations around MoE experts: gathering token rows into expert order, and the weighted combine back.

A MoE layer moves every (token, slot) assignment to its expert's row and back. Both directions are many-to-one
or one-to-many maps between row spaces, given as index tensors (never as Python lists, so nothing syncs with the
host):

    gather_rows(source, rows)         out[i] = source[rows.row_to_source[i]]                 (the dispatch)
        backward                      d source[s] = sum_j d out[rows.source_to_rows[s, j]]   (a gather-sum)
    weighted_combine(y, pos, w)       out[t] = sum_j w[t, j] * y[pos[t, j]], in FP32         (the combine)
        backward                      d y[pos[t, j]] = w[t, j] * d out[t];  d w[t, j] = <d out[t], y[pos[t, j]]>

Both backwards are gathers, not scatter-adds: each output row is summed by one program in a fixed order, so the
results are deterministic and no atomics run. On CUDA they are Triton kernels (`permute_kernels`); elsewhere the
pure-torch twins below, which compute the same sums in the same order. Every sum is in FP32, rounded once to the
activation dtype (the combine's FP32 sum is DeepSeek-V3's; torch's default index backward would add the k slots
of a token in BF16).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from megafp8.precision.eager import eager_custom_op, run_eagerly


@dataclass
class RowSource:
    """Rows as a map into the tensor they come from, with no copy made: row i is `source[row_to_source[i]]`, and
    `source_to_rows[s]` lists the rows that source row s feeds (each row is fed by exactly one source row, every
    source row feeds `source_to_rows.shape[1]` rows)."""

    source: torch.Tensor  # (S, hidden)
    row_to_source: torch.Tensor  # (M,) int64
    source_to_rows: torch.Tensor  # (S, r) int64, M = S * r


def _sum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels (FP32 sums) compute this: CUDA tensors of 32 bits or less."""
    return t.is_cuda and t.element_size() <= 4 and importlib.util.find_spec("triton") is not None


def gather_sum_reference(d: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out[s] = sum_j d[index[s, j]] in FP32 (j in order, from +0.0; FP64 stays FP64), rounded once to d's
    dtype."""
    acc = torch.zeros(index.shape[0], d.shape[1], dtype=_sum_dtype(d), device=d.device)
    for j in range(index.shape[1]):
        acc += d.index_select(0, index[:, j]).to(acc.dtype)
    return acc.to(d.dtype)


@eager_custom_op("megafp8::gather_sum", mutates_args=())
def _gather_sum_op(d: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if _use_triton(d):
        from megafp8.parallel import permute_kernels

        return permute_kernels.gather_sum(d, index)
    return gather_sum_reference(d, index)


@_gather_sum_op.register_fake
def _(d, index):
    return d.new_empty(index.shape[0], d.shape[1])


def gather_sum(d: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`gather_sum_reference`, through a Triton kernel on CUDA (one op in a compiled graph)."""
    return _gather_sum_op(d if d.stride(-1) == 1 else d.contiguous(), index)


def combine_reference(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[pos[t, j]] in FP32 (j in order, from +0.0; FP64 stays FP64), rounded once
    to y's dtype."""
    acc = torch.zeros(pos.shape[0], y.shape[1], dtype=_sum_dtype(y), device=y.device)
    for j in range(pos.shape[1]):
        acc += y.index_select(0, pos[:, j]).to(acc.dtype) * weights[:, j:j + 1].to(acc.dtype)
    return acc.to(y.dtype)


def combine_backward_reference(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor,
                               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, d weights) of `combine_reference`: dy[pos[t, j]] = w[t, j] * dout[t] (rows of y no pos names stay
    zero), d w[t, j] = sum over features of dout[t] * y[pos[t, j]] in FP32."""
    dy = _grad_rows(y, pos)
    g = dout.to(_sum_dtype(dout))
    dy.index_copy_(0, pos.reshape(-1), (g.unsqueeze(1) * weights.unsqueeze(-1).to(g.dtype)).to(y.dtype).flatten(0, 1))
    dweights = (g.unsqueeze(1) * y[pos].to(g.dtype)).sum(dim=-1)
    return dy, dweights.to(weights.dtype)


def _grad_rows(y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The gradient of y, to be written at the rows `pos` names: zero-filled only where some rows are not named
    (`pos` names distinct rows; with as many entries as y has rows, it names them all)."""
    return torch.empty_like(y) if pos.numel() == y.shape[0] else torch.zeros_like(y)


def _triton_combine(y: torch.Tensor, weights: torch.Tensor) -> bool:
    return _use_triton(y) and weights.dtype == torch.float32


@eager_custom_op("megafp8::weighted_combine", mutates_args=())
def _combine_op(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if _triton_combine(y, weights):
        from megafp8.parallel import permute_kernels

        return permute_kernels.combine(y, pos, weights)
    return combine_reference(y, pos, weights)


@_combine_op.register_fake
def _(y, pos, weights):
    return y.new_empty(pos.shape[0], y.shape[1])


def combine_rows(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`weighted_combine`'s forward alone (no autograd): for code that owns the backward (`CombinedOutput`)."""
    return _combine_op(y, pos, weights)


@eager_custom_op("megafp8::weighted_combine_backward", mutates_args=())
def _combine_backward_op(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    if _triton_combine(y, weights):
        from megafp8.parallel import permute_kernels

        return permute_kernels.combine_backward(dout, y, pos, weights, _grad_rows(y, pos))
    return combine_backward_reference(dout, y, pos, weights)


@_combine_backward_op.register_fake
def _(dout, y, pos, weights):
    return torch.empty_like(y), weights.new_empty(pos.shape)


def combine_weights_grad_reference(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """d w[t, j] = sum over features of dout[t] * y[pos[t, j]] in FP32: `combine_backward_reference`'s second
    output, where the experts' own backward quantizes dy from dout (`megafp8.precision.grouped.CombinedOutput`)."""
    g = dout.to(_sum_dtype(dout))
    return (g.unsqueeze(1) * y[pos].to(g.dtype)).sum(dim=-1)


@eager_custom_op("megafp8::weighted_combine_weights_grad", mutates_args=())
def combine_weights_grad(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`combine_weights_grad_reference`, through a Triton kernel on CUDA (one op in a compiled graph)."""
    if _use_triton(y):
        from megafp8.parallel import permute_kernels

        return permute_kernels.combine_weights_grad(dout.contiguous(), y, pos)
    return combine_weights_grad_reference(dout, y, pos)


@combine_weights_grad.register_fake
def _(dout, y, pos):
    return dout.new_empty(pos.shape, dtype=torch.promote_types(dout.dtype, torch.float32))


# Whether the dispatch's gather (BF16 experts) runs `permute_kernels.gather_rows`, walking the row blocks first (the
# FP8 gathers' `rows_cols_gluon.GATHER_ROWS_FIRST`), rather than `index_select`. Job GG (`rows_cols_variants.py`,
# H200, 131072x2048 BF16): `index_select` 0.265 ms, gather_rows 0.170 ms (0.241 walking the features first).
GATHER_ROWS_BY_BLOCKS = True


@eager_custom_op("megafp8::gather_rows", mutates_args=())
def _gather_rows_op(source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if _use_triton(source):
        from megafp8.parallel import permute_kernels

        return permute_kernels.gather_rows(source, index)
    return source.index_select(0, index)


@_gather_rows_op.register_fake
def _(source, index):
    return source.new_empty(index.shape[0], source.shape[1])


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, source, row_to_source, source_to_rows):
        ctx.save_for_backward(source_to_rows)
        if GATHER_ROWS_BY_BLOCKS and source.stride(-1) == 1:
            return _gather_rows_op(source, row_to_source)
        return source.index_select(0, row_to_source)

    @staticmethod
    def backward(ctx, dout):
        (source_to_rows,) = ctx.saved_tensors
        return gather_sum(dout.contiguous(), source_to_rows), None, None


def gather_rows(rows: RowSource) -> torch.Tensor:
    """The rows, copied out of their source (M, hidden); the backward sums each source row's rows in FP32 (a
    custom op in a compiled graph)."""
    return _GatherRows.apply(rows.source, rows.row_to_source, rows.source_to_rows)


class _WeightedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, pos, weights):
        ctx.save_for_backward(y, pos, weights)
        return _combine_op(y, pos, weights)

    @staticmethod
    def backward(ctx, dout):
        y, pos, weights = ctx.saved_tensors
        dy, dweights = _combine_backward_op(dout.contiguous(), y, pos, weights)
        return dy, None, dweights


def weighted_combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y (rows, hidden), pos (N, k) distinct rows of y, weights (N, k) FP32 -> (N, hidden) in y's dtype:
    out[t] = sum_j weights[t, j] * y[pos[t, j]], summed in FP32. Rows of y that `pos` does not name get no
    gradient (zero). Traced by `torch.compile` as two custom ops (forward, backward)."""
    if y.stride(-1) != 1:
        y = y.contiguous()
    if weights.dtype not in (torch.float32, torch.float64):
        weights = weights.float()
    return _WeightedCombine.apply(y, pos, weights.contiguous())


# Eager entry points, for callers whose surroundings cannot be traced (expert parallelism: the all-to-all's split
# sizes are read on the host, so each step's row counts would recompile the graph).
eager_gather_rows = run_eagerly(gather_rows)
eager_weighted_combine = run_eagerly(weighted_combine)
