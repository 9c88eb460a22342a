"""Triton kernels of `megafp8.parallel.permute` (imported only on CUDA: CPU-only installs never need Triton).

Each computes exactly the sums of its pure-torch twin in `permute` in the same order (FP32, slot by slot, from
+0.0; `enable_fp_fusion=False` keeps a product and its sum two roundings, as torch's are), except the combine's
weight gradient, a dot product over the features whose summation order is the kernel's own.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megafp8.precision.kernels.launch import FastLaunch

BLOCK_H = 128  # features per program (the hidden size is a multiple of 128 wherever FP8 runs; masked otherwise)


@triton.jit
def _gather_sum_kernel(d_ptr, idx_ptr, out_ptr, S, H, stride_d, stride_out,
                       R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_s = s < S
    mask = in_s[:, None] & (h < H)[None, :]
    acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(R):
        row = tl.load(idx_ptr + s * R + j, mask=in_s, other=0).to(tl.int64)
        acc += tl.load(d_ptr + row[:, None] * stride_d + h[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + s[:, None].to(tl.int64) * stride_out + h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, N, H, stride_y, stride_out,
                    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_t = t < N
    mask = in_t[:, None] & (h < H)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(pos_ptr + t * K + j, mask=in_t, other=0).to(tl.int64)
        w = tl.load(w_ptr + t * K + j, mask=in_t, other=0.0)
        acc += tl.load(y_ptr + row[:, None] * stride_y + h[None, :], mask=mask, other=0.0).to(tl.float32) * w[:, None]
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_out + h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _combine_backward_kernel(dout_ptr, y_ptr, pos_ptr, w_ptr, dy_ptr, dw_ptr, N, H, stride_dout, stride_y,
                             stride_dy, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                             WRITE_DY: tl.constexpr = True):
    """One slot j of BLOCK_N tokens (slots vary fastest over the grid, so a token block's dout is read from L2).
    Without WRITE_DY only the weights' gradient (dy is quantized from dout by the experts' own backward)."""
    j = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_t = t < N
    row = tl.load(pos_ptr + t * K + j, mask=in_t, other=0).to(tl.int64)
    w = tl.load(w_ptr + t * K + j, mask=in_t, other=0.0)
    dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = in_t[:, None] & (h < H)[None, :]
        g = tl.load(dout_ptr + t[:, None].to(tl.int64) * stride_dout + h[None, :], mask=mask, other=0.0)
        g = g.to(tl.float32)
        yv = tl.load(y_ptr + row[:, None] * stride_y + h[None, :], mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(g * yv, axis=1)
        if WRITE_DY:
            tl.store(dy_ptr + row[:, None] * stride_dy + h[None, :], (g * w[:, None]).to(dy_ptr.dtype.element_ty),
                     mask=mask)
    tl.store(dw_ptr + t * K + j, dot, mask=in_t)


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, out_ptr, M, H, stride_src, stride_out, ROWS_FIRST: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[i] = src[idx[i]] for BLOCK_M rows x BLOCK_H features: a copy. ROWS_FIRST: the grid's first axis walks
    the row blocks, so the programs running at once read one BLOCK_H-wide column of the source (`gather_rows`)."""
    pm = tl.program_id(0 if ROWS_FIRST else 1)
    ph = tl.program_id(1 if ROWS_FIRST else 0)
    i = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    h = ph * BLOCK_H + tl.arange(0, BLOCK_H)
    in_i = i < M
    mask = in_i[:, None] & (h < H)[None, :]
    row = tl.load(idx_ptr + i, mask=in_i, other=0).to(tl.int64)
    values = tl.load(src_ptr + row[:, None] * stride_src + h[None, :], mask=mask)
    tl.store(out_ptr + i[:, None].to(tl.int64) * stride_out + h[None, :], values, mask=mask)


# Triton's JIT once per static signature, then the compiled kernels (`launch.FastLaunch`): each MoE layer launches
# these every micro-batch, and with several EP ranks they run eagerly between compiled regions.
_GATHER_SUM = FastLaunch(_gather_sum_kernel)
_COMBINE = FastLaunch(_combine_kernel)
_COMBINE_BACKWARD = FastLaunch(_combine_backward_kernel)
_GATHER_ROWS = FastLaunch(_gather_rows_kernel)
GATHER_BLOCK_M = 32  # rows per program of `gather_rows`


def _rows_block(n: int) -> int:
    return 16 if n >= 16 else max(1, triton.next_power_of_2(n))


def gather_sum(d: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out[s] = sum_j d[index[s, j]] (FP32, rounded once to d's dtype); d (M, H) row-major, index (S, r)."""
    assert d.stride(1) == 1, "gather_sum needs a row-major input"
    index = index.contiguous()
    s_rows, r = index.shape
    out = torch.empty(s_rows, d.shape[1], dtype=d.dtype, device=d.device)
    if s_rows:
        block = _rows_block(s_rows)
        _GATHER_SUM.launch((triton.cdiv(s_rows, block), triton.cdiv(d.shape[1], BLOCK_H)),
                           (d, index, out, s_rows, d.shape[1], d.stride(0), out.stride(0)),
                           dict(R=r, BLOCK_S=block, BLOCK_H=BLOCK_H, num_warps=4))
    return out


def gather_rows(source: torch.Tensor, index: torch.Tensor, rows_first: bool = True) -> torch.Tensor:
    """source.index_select(0, index) (source (S, H) row-major, index (M,) of valid rows), the same bytes. With
    `rows_first` the grid walks the row blocks first, one 128-feature column at a time: in the MoE dispatch each
    source row is read into top_k rows far apart, and walking each row block's features first reads it from HBM
    once per expert where the source outgrows L2 (`rows_cols_gluon.launch` walks the FP8 gathers so too)."""
    assert source.stride(1) == 1, "gather_rows needs a row-major source"
    index = index.contiguous()
    m, h = index.shape[0], source.shape[1]
    out = torch.empty(m, h, dtype=source.dtype, device=source.device)
    if m:
        row_blocks, columns = triton.cdiv(m, GATHER_BLOCK_M), triton.cdiv(h, BLOCK_H)
        _GATHER_ROWS.launch((row_blocks, columns) if rows_first else (columns, row_blocks),
                            (source, index, out, m, h, source.stride(0), out.stride(0)),
                            dict(ROWS_FIRST=rows_first, BLOCK_M=GATHER_BLOCK_M, BLOCK_H=BLOCK_H, num_warps=4))
    return out


def combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[pos[t, j]] (FP32, rounded once to y's dtype)."""
    pos, weights = pos.contiguous(), weights.contiguous()
    n, k = pos.shape
    out = torch.empty(n, y.shape[1], dtype=y.dtype, device=y.device)
    if n:
        block = _rows_block(n)
        _COMBINE.launch((triton.cdiv(n, block), triton.cdiv(y.shape[1], BLOCK_H)),
                        (y, pos, weights, out, n, y.shape[1], y.stride(0), out.stride(0)),
                        dict(K=k, BLOCK_N=block, BLOCK_H=BLOCK_H, num_warps=4, enable_fp_fusion=False))
    return out


def combine_backward(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                     dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, d weights) of `combine`: dy[pos[t, j]] = (w[t, j] * dout[t]) in y's dtype, written into `dy` (whose
    other rows the caller has zeroed); d w[t, j] = <dout[t], y[pos[t, j]]> in FP32."""
    return dy, _combine_backward(dout, y, pos, weights.contiguous(), dy)


def combine_weights_grad(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """d w[t, j] = <dout[t], y[pos[t, j]]> in FP32: `combine_backward`'s second output alone."""
    return _combine_backward(dout, y, pos, None, None)


def _combine_backward(dout: torch.Tensor, y: torch.Tensor, pos: torch.Tensor, weights: Optional[torch.Tensor],
                      dy: Optional[torch.Tensor]) -> torch.Tensor:
    """The weights' gradient (returned), and with `dy` given `w * dout` written into it (`combine_backward`)."""
    pos = pos.contiguous()
    n, k = pos.shape
    dweights = torch.empty(n, k, dtype=torch.float32, device=y.device)
    if n:
        write_dy = dy is not None
        w, dy = (weights, dy) if write_dy else (dweights, y)  # unused pointers without dy
        block = _rows_block(n)
        _COMBINE_BACKWARD.launch((k, triton.cdiv(n, block)),
                                 (dout, y, pos, w, dy, dweights, n, y.shape[1], dout.stride(0), y.stride(0),
                                  dy.stride(0)),
                                 dict(K=k, BLOCK_N=block, BLOCK_H=BLOCK_H, WRITE_DY=write_dy, num_warps=4,
                                      enable_fp_fusion=False))
    return dweights
