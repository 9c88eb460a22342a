"""Standalone Triton quantizers, bit for bit those of `megafp8.precision.quantize`.

- `quantize_rows`: x (M, K) in 1x128 tiles along K.
- `quantize_rows_cols`: the same and x^T in 1x128 tiles along the rows, from one read of x (the input and the
  output gradient of every FP8 GEMM whose producer is not fused). One program quantizes one 128x128 tile both ways.
  `gather_quantize_rows_cols` reads x's rows through an index (MoE tokens into the padded expert layout).
- `quantize_weight_`: a weight (N, K) or stacked experts (E, N, K) in 128x128 blocks, with its transpose (or not),
  into tensors the caller keeps (in place, so their addresses never change); `transpose_blocks` makes the transpose
  later from the FP8 values.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megafp8.precision.formats import TILE, Fp8Format
from megafp8.precision.kernels import tiles
from megafp8.precision.kernels.launch import FastLaunch
from megafp8.precision.kernels.limits import check_offsets


# Rows per program: every configuration computes the same bits; the autotuner picks per (K, format).
@triton.autotune(configs=[triton.Config({"BLOCK_M": bm}, num_warps=w) for bm in (16, 32, 64) for w in (4, 8)],
                 key=["K", "FP8_MAX", "POW2"])
@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                          FP8_MAX: tl.constexpr, POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(0)
    cols = kb * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None], other=0.0)
    tiles.store_rows(x.to(tl.float32), rows, cols, M, kb, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk,
                     FP8_MAX, POW2)


@triton.jit
def rows_cols_tile(x_ptr, rstd_ptr, w_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_xm, stride_qm, stride_sm,
                   stride_sk, stride_qt, stride_st_k, stride_st_m,
                   FP8_MAX: tl.constexpr, POW2: tl.constexpr, NORM: tl.constexpr, GATHER: tl.constexpr):
    """This program's 128x128 tile of x (M, K) both ways; rows past M read as zeros (x^T's padding). With NORM, of
    RMSNorm(x): (x * rstd[row]) * w[col] in FP32. With GATHER, row i is x[idx[i]] (a zero row where idx[i] < 0)."""
    kb = tl.program_id(0)
    mb = tl.program_id(1)
    rows = mb * 128 + tl.arange(0, 128)
    cols = kb * 128 + tl.arange(0, 128)
    if GATHER:
        src = tl.load(idx_ptr + rows, mask=rows < M, other=-1)
        x = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=(src >= 0)[:, None],
                    other=0.0)
    else:
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None], other=0.0)
    x = x.to(tl.float32)
    if NORM:
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        x = (x * rstd[:, None]) * tl.load(w_ptr + cols).to(tl.float32)[None, :]
    tiles.store_rows(x, rows, cols, M, kb, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk, FP8_MAX, POW2)
    tiles.store_cols(x, rows, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX, POW2)


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16)], key=["K", "FP8_MAX", "POW2"])
@triton.jit
def _gather_scale_quantize_rows_cols_kernel(x_ptr, idx_ptr, f_ptr, ones_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K,
                                            stride_xm, stride_qm, stride_sm, stride_sk, stride_qt, stride_st_k,
                                            stride_st_m, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    # RMSNorm's path with the row factors as its inverse RMS and ones as its weight: (x * f[row]) * 1.0, exact.
    rows_cols_tile(x_ptr, f_ptr, ones_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_xm, stride_qm, stride_sm,
                   stride_sk, stride_qt, stride_st_k, stride_st_m, FP8_MAX, POW2, True, True)


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16)],
                 key=["K", "FP8_MAX", "POW2", "GATHER"])
@triton.jit
def _quantize_rows_cols_kernel(x_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, stride_xm, stride_qm, stride_sm,
                               stride_sk, stride_qt, stride_st_k, stride_st_m,
                               FP8_MAX: tl.constexpr, POW2: tl.constexpr, GATHER: tl.constexpr):
    rows_cols_tile(x_ptr, x_ptr, x_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_xm, stride_qm, stride_sm,
                   stride_sk, stride_qt, stride_st_k, stride_st_m, FP8_MAX, POW2, False, GATHER)


@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16)], key=["K", "FP8_MAX", "POW2"])
@triton.jit
def _rmsnorm_quantize_kernel(h_ptr, rstd_ptr, w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, K, stride_hm, stride_qm,
                             stride_sm, stride_sk, stride_qt, stride_st_k, stride_st_m,
                             FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    # RMSNorm's producer tiles (`producers.rmsnorm_quantize`): x * rstd[row] * w[col] in FP32, quantized both ways.
    rows_cols_tile(h_ptr, rstd_ptr, w_ptr, h_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_hm, stride_qm, stride_sm,
                   stride_sk, stride_qt, stride_st_k, stride_st_m, FP8_MAX, POW2, True, False)


@triton.jit
def _quantize_weight_kernel(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, used_ptr, version_ptr, current_ptr, n_blocks,
                            stride_we, stride_wn, stride_qe, stride_qn, stride_qte, stride_qtk,
                            stride_se, stride_sn, stride_sk, stride_ste, stride_stn, stride_stk,
                            FP8_MAX: tl.constexpr, POW2: tl.constexpr, TRANSPOSE: tl.constexpr,
                            STALE_ONLY: tl.constexpr, USED_ONLY: tl.constexpr):
    """One 128x128 block of w[e] (N, K): its values at q[e] and (with TRANSPOSE), transposed, at qt[e] (K, N);
    its scale at s[e, nb, kb] and st[e, kb, nb] (strides given as [e, n block, k block] of each). The expert index
    is int64: a layer's stacked experts may span more than 2^31 elements, one expert may not. With STALE_ONLY, an
    expert whose version_ptr[e] equals current_ptr[0] is left alone, and with USED_ONLY too one whose used_ptr[e]
    is 0."""
    e = (tl.program_id(1) // n_blocks).to(tl.int64)
    go = True
    if STALE_ONLY:
        go = tl.load(version_ptr + e) != tl.load(current_ptr)
        if USED_ONLY:
            go = go & (tl.load(used_ptr + e) != 0)
    if go:
        _quantize_weight_block(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, e, n_blocks, stride_we, stride_wn, stride_qe,
                               stride_qn, stride_qte, stride_qtk, stride_se, stride_sn, stride_sk, stride_ste,
                               stride_stn, stride_stk, FP8_MAX, POW2, TRANSPOSE)


@triton.jit
def _quantize_weight_block(w_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, e, n_blocks, stride_we, stride_wn, stride_qe,
                           stride_qn, stride_qte, stride_qtk, stride_se, stride_sn, stride_sk, stride_ste, stride_stn,
                           stride_stk, FP8_MAX: tl.constexpr, POW2: tl.constexpr, TRANSPOSE: tl.constexpr):
    nb = tl.program_id(1) % n_blocks
    kb = tl.program_id(0)
    n = nb * 128 + tl.arange(0, 128)
    k = kb * 128 + tl.arange(0, 128)
    w = tl.load(w_ptr + e * stride_we + n[:, None] * stride_wn + k[None, :]).to(tl.float32)
    block_amax = tiles.amax(tiles.amax(tl.abs(w), 1), 0)
    scale, inv = tiles.tile_scale(block_amax, FP8_MAX, POW2)
    q = tiles.to_fp8(w, inv, FP8_MAX, q_ptr.dtype.element_ty)
    tl.store(q_ptr + e * stride_qe + n[:, None] * stride_qn + k[None, :], q)
    tl.store(s_ptr + e * stride_se + nb * stride_sn + kb * stride_sk, scale)
    if TRANSPOSE:
        tl.store(qt_ptr + e * stride_qte + k[:, None] * stride_qtk + n[None, :], tl.trans(q))
        tl.store(st_ptr + e * stride_ste + kb * stride_stn + nb * stride_stk, scale)


@triton.jit
def _transpose_blocks_kernel(q_ptr, s_ptr, qt_ptr, st_ptr, used_ptr, n_blocks, stride_qe, stride_qn, stride_qte,
                             stride_qtk, stride_se, stride_sn, stride_sk, stride_ste, stride_stn, stride_stk,
                             ONLY_USED: tl.constexpr):
    """One 128x128 block of an FP8 weight q[e] (N, K) and its scale, stored transposed into qt[e] (K, N), st
    (the expert index in int64, as in `_quantize_weight_kernel`). With ONLY_USED, an expert whose count at
    used_ptr[e] is 0 is left alone (no GEMM reads its transpose)."""
    e = (tl.program_id(1) // n_blocks).to(tl.int64)
    nb = tl.program_id(1) % n_blocks
    kb = tl.program_id(0)
    used = True
    if ONLY_USED:
        used = tl.load(used_ptr + e) != 0
    if used:
        n = nb * 128 + tl.arange(0, 128)
        k = kb * 128 + tl.arange(0, 128)
        q = tl.load(q_ptr + e * stride_qe + n[:, None] * stride_qn + k[None, :])
        tl.store(qt_ptr + e * stride_qte + k[:, None] * stride_qtk + n[None, :], tl.trans(q))
        scale = tl.load(s_ptr + e * stride_se + nb * stride_sn + kb * stride_sk)
        tl.store(st_ptr + e * stride_ste + kb * stride_stn + nb * stride_stk, scale)


# The weight kernels by Triton's JIT once per static signature, then compiled (`launch.FastLaunch`): the transpose
# runs in every FP8 layer's backward.
_QUANTIZE_WEIGHT = FastLaunch(_quantize_weight_kernel)
_TRANSPOSE_BLOCKS = FastLaunch(_transpose_blocks_kernel)


def quantize_rows(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, K), scales (M, K/128) along K, column-major."""
    assert x.stride(1) == 1, "quantize_rows needs a row-major input"
    m, k = x.shape
    q = torch.empty(m, k, dtype=fmt.dtype, device=x.device)
    s = tiles.mn_major_scales(m, k // TILE, x.device)
    check_offsets("quantize_rows", x, q)
    _quantize_rows_kernel[lambda meta: (k // TILE, triton.cdiv(m, meta["BLOCK_M"]))](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), POW2=power_of_two,
        **tiles.format_constants(fmt))
    return q, s


def quantize_rows_cols(x: torch.Tensor, fmt: Fp8Format, power_of_two: bool,
                       cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
    """x (M, K) -> (q (M, K), scales (M, K/128), x^T q (K, M_pad), scales (K, M_pad/128)), one read of x; x^T in
    128x128 blocks with `cols_in_blocks` (scales (K/128, M_pad/128))."""
    assert x.stride(1) == 1, "quantize_rows_cols needs a row-major input"
    m, k = x.shape
    out = tiles.rows_cols_outputs(m, k, fmt, x.device, cols_in_blocks)
    check_offsets("quantize_rows_cols", x, *out)
    if not m:
        return out
    launch_rows_cols(x, None, None, out, fmt, power_of_two, cols_in_blocks=cols_in_blocks)
    return out


def launch_rows_cols(x: torch.Tensor, rstd: Optional[torch.Tensor], weight: Optional[torch.Tensor], out: tuple,
                     fmt: Fp8Format, power_of_two: bool, index: Optional[torch.Tensor] = None,
                     cols_in_blocks: bool = False) -> None:
    """Fill `out` (from `tiles.rows_cols_outputs`) with a 128x128-tiled tensor quantized both ways: x (M, K) itself,
    RMSNorm(x) given its rstd (M,) and weight (K,), the rows x[index[i]] (M = len(index); a zero row where
    index[i] < 0), or with both rstd and index the gathered rows scaled by rstd[i] (weight: ones). On SM90 by the
    Gluon kernel (`rows_cols_gluon.launch`, the same bytes in fewer instructions), elsewhere by the Triton ones
    (`launch_rows_cols_triton`). x^T in 128x128 blocks (`cols_in_blocks`, out from `tiles.rows_cols_outputs` with
    it) only by the Gluon kernel: the backends that take them (`Fp8Backend.wgrad_input_blocks`) run on SM90."""
    gluon = tiles.hopper_gluon(x.device, "rows_cols_gluon")
    if gluon:
        gluon.launch(x, rstd, weight, out, fmt, power_of_two, index=index, cols_in_blocks=cols_in_blocks)
        return
    if cols_in_blocks:
        raise ValueError("x^T in 128x128 blocks (precision.fp8_wgrad_input_blocks) is quantized by the Gluon kernel, "
                         "which needs an SM90 GPU and Triton's Gluon")
    launch_rows_cols_triton(x, rstd, weight, out, fmt, power_of_two, index=index)


def launch_rows_cols_triton(x: torch.Tensor, rstd: Optional[torch.Tensor], weight: Optional[torch.Tensor],
                            out: tuple, fmt: Fp8Format, power_of_two: bool,
                            index: Optional[torch.Tensor] = None) -> None:
    """`launch_rows_cols` by the Triton kernels, whichever GPU: the twin the Gluon kernel is checked against."""
    m, k = (x.shape[0] if index is None else index.shape[0]), x.shape[1]
    grid = (k // TILE, triton.cdiv(m, TILE))
    tail = (*out, m, k, x.stride(0), *tiles.rows_cols_strides(*out))
    constants = dict(POW2=power_of_two, **tiles.format_constants(fmt))
    if rstd is None:
        _quantize_rows_cols_kernel[grid](x, x if index is None else index, *tail, GATHER=index is not None,
                                         **constants)
    elif index is None:
        _rmsnorm_quantize_kernel[grid](x, rstd, weight, *tail, **constants)
    else:
        _gather_scale_quantize_rows_cols_kernel[grid](x, index, rstd, weight, *tail, **constants)


def _gathered_outputs(name: str, source: torch.Tensor, index: torch.Tensor, fmt: Fp8Format,
                      cols_in_blocks: bool = False) -> tuple[int, int, tuple[torch.Tensor, ...]]:
    """(M, K, outputs) of a gathering row + column quantizer `name` over the rows source[index[i]]."""
    assert source.stride(1) == 1, f"{name} needs a row-major source"
    m, k = index.shape[0], source.shape[1]
    out = tiles.rows_cols_outputs(m, k, fmt, source.device, cols_in_blocks)
    check_offsets(name, *out)  # source rows are indexed in int64
    return m, k, out


def gather_quantize_rows_cols(source: torch.Tensor, index: torch.Tensor, fmt: Fp8Format,
                              power_of_two: bool, cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
    """`quantize_rows_cols` of x (M, K) with x[i] = source[index[i]] (a zero row where index[i] < 0), reading
    the source rows in place: the gather into a layout and the quantization in one pass."""
    m, _, out = _gathered_outputs("gather_quantize_rows_cols", source, index, fmt, cols_in_blocks)
    if not m:
        return out
    launch_rows_cols(source, None, None, out, fmt, power_of_two, index=index.contiguous(),
                     cols_in_blocks=cols_in_blocks)
    return out


def gather_scale_quantize_rows_cols(source: torch.Tensor, index: torch.Tensor, factor: torch.Tensor, fmt: Fp8Format,
                                    power_of_two: bool) -> tuple[torch.Tensor, ...]:
    """`quantize_rows_cols` of x (M, K) with x[i] = factor[i] * source[index[i]] in FP32 (a zero row where
    index[i] < 0), quantized from FP32: the MoE combine's backward writing the experts' output gradient in FP8."""
    m, k, out = _gathered_outputs("gather_scale_quantize_rows_cols", source, index, fmt)
    if not m:
        return out
    index, factor = index.contiguous(), factor.to(torch.float32).contiguous()
    ones = torch.ones(k, dtype=torch.float32, device=source.device)
    launch_rows_cols(source, factor, ones, out, fmt, power_of_two, index=index)
    return out


def quantize_weight_(w: torch.Tensor, q: torch.Tensor, s_nk: torch.Tensor, qt: Optional[torch.Tensor],
                     st_nk: Optional[torch.Tensor], fmt: Fp8Format, power_of_two: bool,
                     stale: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None) -> None:
    """w (N, K) or (E, N, K) -> q (same shape), qt (w^T per expert; None: not written), in place; block scales
    written through `s_nk` ([E,] N/128, K/128) and `st_nk` ([E,] K/128, N/128), views of any layout (see
    `Fp8Backend.block_scales_nk`). `stale` (version (E,) int64, current (1,) int64, used (E,) or None), all on the
    device: only the experts whose version is not current (and, with `used`, whose entry there is nonzero) are
    quantized, and their versions then set to current."""
    transpose = qt is not None
    qt, st_nk = (qt, st_nk) if transpose else (q, s_nk)  # unused pointers when not transposing
    assert w.stride(-1) == 1 and q.is_contiguous() and qt.is_contiguous(), "quantize_weight_ needs row-major tensors"
    w3, q3, qt3, s3, st3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (w, q, qt, s_nk, st_nk))
    experts, n, k = w3.shape
    check_offsets("quantize_weight_", w3[:1], q3[:1], qt3[:1])  # one expert: experts are indexed in int64
    version, current, used = stale if stale is not None else (s3, s3, None)
    if stale is not None and (version.shape != (experts,) or (used is not None and used.shape != (experts,))):
        raise ValueError(f"versions {tuple(version.shape)} and used {None if used is None else tuple(used.shape)} "
                         f"for {experts} experts: one entry per expert needed")
    _QUANTIZE_WEIGHT.launch((k // TILE, experts * (n // TILE)),
                            (w3, q3, s3, qt3, st3, s3 if used is None else used, version, current, n // TILE,
                             w3.stride(0), w3.stride(1), q3.stride(0), q3.stride(1), qt3.stride(0), qt3.stride(1),
                             *s3.stride(), *st3.stride()),
                            dict(**tiles.format_constants(fmt), POW2=power_of_two, TRANSPOSE=transpose,
                                 STALE_ONLY=stale is not None, USED_ONLY=used is not None, num_warps=8))
    if stale is not None:  # after the kernel read them (stream order)
        version.copy_(current.expand(experts) if used is None else torch.where(used != 0, current, version))


def transpose_blocks(q: torch.Tensor, s_nk: torch.Tensor, qt: torch.Tensor, st_nk: torch.Tensor,
                     experts_used: Optional[torch.Tensor] = None) -> None:
    """An FP8 weight q (N, K) or (E, N, K) in 128x128 blocks -> qt (its transpose per expert) and the block
    scales `s_nk` -> `st_nk` (views as in `quantize_weight_`), in place: one read of q, no arithmetic.
    `experts_used` (E,) integers on the device: only experts with a nonzero entry are transposed (the others'
    part of qt and st_nk is left as it was)."""
    assert q.is_contiguous() and qt.is_contiguous(), "transpose_blocks needs row-major tensors"
    q3, qt3, s3, st3 = (t if t.dim() == 3 else t.unsqueeze(0) for t in (q, qt, s_nk, st_nk))
    experts, n, k = q3.shape
    if experts_used is not None and experts_used.shape != (experts,):
        raise ValueError(f"experts_used has shape {tuple(experts_used.shape)}; one entry per expert ({experts}) needed")
    check_offsets("transpose_blocks", q3[:1], qt3[:1])
    _TRANSPOSE_BLOCKS.launch((k // TILE, experts * (n // TILE)),
                             (q3, s3, qt3, st3, s3 if experts_used is None else experts_used, n // TILE,
                              q3.stride(0), q3.stride(1), qt3.stride(0), qt3.stride(1), *s3.stride(), *st3.stride()),
                             dict(ONLY_USED=experts_used is not None, num_warps=8))
