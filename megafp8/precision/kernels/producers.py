"""Triton kernels for the producers of FP8 GEMM inputs, each quantizing its own FP32 result in the two layouts the
GEMMs read (1x128 tiles along the features for fprop/dgrad, along the tokens for wgrad). Their pure-torch twins,
and the numerics they are held to, are in `megafp8.precision.producers`.

Every quantizing program owns a 128x128 tile: 128 tokens (a whole 1x128 tile along the tokens) by 128 features.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from megafp8.precision.formats import TILE, Fp8Format
from megafp8.precision.kernels import quantize, tiles
from megafp8.precision.kernels.launch import FastLaunch
from megafp8.precision.kernels.limits import check_offsets
from megafp8.precision.producers import check_tile_maxima, rope_backward_fusable


# One configuration, not autotuned: the sum of squares' order follows the block shape and the warps, and a choice
# that could differ between runs (the autotuner times configurations) would change a run's bits on restart.
RMS_BLOCK_M, RMS_WARPS = 8, 8


@triton.jit
def _rms_inverse_kernel(h_ptr, rstd_ptr, M, eps, stride_hm, K: tl.constexpr, BLOCK_M: tl.constexpr):
    """rstd[row] = 1 / sqrt(mean(h[row]^2) + eps) for BLOCK_M rows of h (M, K), each step correctly rounded, as
    torch computes it on the CPU (the sum of squares in this kernel's order). The squares add up element-wise
    across the row's 256-wide chunks and are reduced once at the end: a reduction across the warps in every chunk
    held each load until the previous chunk's sum was done."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    squares = tl.zeros((BLOCK_M, 256), dtype=tl.float32)
    for k0 in range(0, K, 256):
        cols = k0 + tl.arange(0, 256)
        h = tl.load(h_ptr + rows[:, None] * stride_hm + cols[None, :], mask=(rows < M)[:, None] & (cols < K)[None, :],
                    other=0.0).to(tl.float32)
        squares += h * h
    sum_sq = tl.sum(squares, axis=1)
    mean = tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, K, tl.float32))
    rstd = tl.math.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.math.sqrt_rn(mean + eps))
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)


@triton.jit
def _gate_up(gu_ptr, rows, cols, M, F, stride_gm):
    """Gate and up (FP32) at rows x cols of gu = [gate | up]; rows past M read as zeros."""
    in_rows = (rows < M)[:, None]
    ptrs = gu_ptr + rows[:, None] * stride_gm + cols[None, :]
    gate = tl.load(ptrs, mask=in_rows, other=0.0).to(tl.float32)
    up = tl.load(ptrs + F, mask=in_rows, other=0.0).to(tl.float32)
    return gate, up


@triton.jit
def _silu_parts(gate):
    """(sigmoid(gate), silu(gate)) in FP32; forward and backward compute SwiGLU's output from these same values."""
    s = 1.0 / (1.0 + tl.exp(-gate))
    return s, gate * s


@triton.jit
def _swiglu_backward_slice(gu_ptr, da_ptr, rows, cols, M, F, stride_gm, stride_dm):
    """SwiGLU's output a and the gradients d_gate, d_up (FP32) at rows x cols."""
    gate, up = _gate_up(gu_ptr, rows, cols, M, F, stride_gm)
    da = tl.load(da_ptr + rows[:, None] * stride_dm + cols[None, :], mask=(rows < M)[:, None], other=0.0)
    s, silu = _silu_parts(gate)
    da_s = da.to(tl.float32) * s
    return silu * up, da_s * up * (1.0 + gate * (1.0 - s)), da_s * gate


@triton.autotune(configs=[triton.Config({"BLOCK_M": bm}, num_warps=w) for bm in (32, 64, 128) for w in (4, 8)],
                 key=["F", "FP8_MAX", "POW2"])
@triton.jit
def _swiglu_quantize_kernel(gu_ptr, q_ptr, s_ptr, amax_ptr, M, F, stride_gm, stride_qm, stride_sm, stride_sk,
                            stride_ak, FP8_MAX: tl.constexpr, POW2: tl.constexpr, ROW_AMAX: tl.constexpr,
                            BLOCK_M: tl.constexpr):
    """silu(gate) * up for BLOCK_M tokens x 128 features, quantized along the features (whole row tiles); with
    ROW_AMAX each tile's max |a| also stored at amax[rows, kb], tokens first (the backward's a^T blocks take their
    max from it)."""
    kb = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * 128 + tl.arange(0, 128)
    gate, up = _gate_up(gu_ptr, rows, cols, M, F, stride_gm)
    a = _silu_parts(gate)[1] * up
    tiles.store_rows(a, rows, cols, M, kb, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk, FP8_MAX, POW2)
    if ROW_AMAX:  # the same reduction store_rows makes its scales from (one after common subexpressions)
        tl.store(amax_ptr + kb * stride_ak + rows, tiles.amax(tl.abs(a), 1), mask=rows < M)


# SwiGLU's backward in two kernels, each computing only what it stores: its rows kernel streams like the forward
# (whole row tiles of d(gu)); its column kernel holds 128 tokens x BLOCK_N features of the three results, enough for
# their column tiles. Each reads gu and da (17 bytes moved per (token, feature) where one kernel would need 11), but
# a single kernel holding a whole 128x128 tile of all three results runs short of registers and had to walk the tile
# twice, which was slower (`docs/benchmarks.md`).
@triton.autotune(configs=[triton.Config({"BLOCK_M": bm}, num_warps=w) for bm in (16, 32, 64) for w in (4, 8)],
                 key=["F", "GRAD_MAX", "POW2"])
@triton.jit
def _swiglu_backward_rows_kernel(gu_ptr, da_ptr, q_ptr, s_ptr, M, F, stride_gm, stride_dm, stride_qm, stride_sm,
                                 stride_sk, GRAD_MAX: tl.constexpr, POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """d(gu) for BLOCK_M tokens x 128 features of gate and of up, quantized along the features."""
    kb = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * 128 + tl.arange(0, 128)
    _, d_gate, d_up = _swiglu_backward_slice(gu_ptr, da_ptr, rows, cols, M, F, stride_gm, stride_dm)
    tiles.store_rows(d_gate, rows, cols, M, kb, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk, GRAD_MAX, POW2)
    tiles.store_rows(d_up, rows, cols + F, M, kb + F // 128, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk,
                     GRAD_MAX, POW2)


@triton.autotune(configs=[triton.Config({"BLOCK_N": bn}, num_warps=w) for bn in (16, 32, 64) for w in (4, 8)],
                 key=["F", "GRAD_MAX", "FP8_MAX", "POW2"])
@triton.jit
def _swiglu_backward_cols_kernel(gu_ptr, da_ptr, qt_ptr, st_ptr, at_ptr, ats_ptr, M, F, stride_gm, stride_dm,
                                 stride_qt, stride_st_k, stride_st_m, stride_at, stride_ats_k, stride_ats_m,
                                 GRAD_MAX: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                                 BLOCK_N: tl.constexpr):
    """d(gu) and a = silu(gate) * up for 128 tokens x BLOCK_N features, quantized along the tokens and stored
    transposed (rows past M read as zeros: the transposes' padding)."""
    mb = tl.program_id(1)
    rows = mb * 128 + tl.arange(0, 128)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    a, d_gate, d_up = _swiglu_backward_slice(gu_ptr, da_ptr, rows, cols, M, F, stride_gm, stride_dm)
    tiles.store_cols(a, rows, cols, mb, at_ptr, stride_at, ats_ptr, stride_ats_k, stride_ats_m, FP8_MAX, POW2)
    tiles.store_cols(d_gate, rows, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, GRAD_MAX, POW2)
    tiles.store_cols(d_up, rows, cols + F, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, GRAD_MAX, POW2)


_RMS_INVERSE = FastLaunch(_rms_inverse_kernel)  # Triton's JIT once per static signature, then the compiled kernel


def rmsnorm_quantize(h: torch.Tensor, weight: torch.Tensor, eps: float, fmt: Fp8Format,
                     power_of_two: bool, cols_in_blocks: bool = False) -> tuple[torch.Tensor, ...]:
    """RMSNorm of h (M, K) -> (x_fp8, scales, xt_fp8, scales_t, rstd (M,) FP32): the rows' inverse RMS first (one
    read of h), then every 128x128 tile normalized and quantized both ways (a second read, the only write); x^T
    in 128x128 blocks with `cols_in_blocks` (`quantize.quantize_rows_cols`)."""
    assert h.stride(1) == 1 and weight.is_contiguous(), "rmsnorm_quantize needs a row-major input"
    m, k = h.shape
    rstd = torch.empty(m, dtype=torch.float32, device=h.device)
    out = tiles.rows_cols_outputs(m, k, fmt, h.device, cols_in_blocks)
    check_offsets("rmsnorm_quantize", h, *out)
    if m:
        _RMS_INVERSE.launch((triton.cdiv(m, RMS_BLOCK_M),), (h, rstd, m, eps, h.stride(0)),
                            dict(K=k, BLOCK_M=RMS_BLOCK_M, num_warps=RMS_WARPS))
        quantize.launch_rows_cols(h, rstd, weight, out, fmt, power_of_two, cols_in_blocks=cols_in_blocks)
    return (*out, rstd)


def swiglu_quantize(gu: torch.Tensor, fmt: Fp8Format, power_of_two: bool,
                    row_amax: bool = False) -> tuple[torch.Tensor, ...]:
    """gu (M, 2F) = [gate | up] -> silu(gate) * up quantized along F: (a_fp8 (M, F), scales (M, F/128)), and with
    `row_amax` each tile's max |a| (M, F/128) FP32, column-major (`producers.swiglu_quantize`)."""
    assert gu.stride(1) == 1, "swiglu_quantize needs a row-major input"
    m, f = gu.shape[0], gu.shape[1] // 2
    q = torch.empty(m, f, dtype=fmt.dtype, device=gu.device)
    s = tiles.mn_major_scales(m, f // TILE, gu.device)
    amax = tiles.mn_major_scales(m, f // TILE, gu.device) if row_amax else s  # tokens first, as the scales
    check_offsets("swiglu_quantize", gu, q)
    if m:
        _swiglu_quantize_kernel[lambda meta: (f // TILE, triton.cdiv(m, meta["BLOCK_M"]))](
            gu, q, s, amax, m, f, gu.stride(0), q.stride(0), s.stride(0), s.stride(1), amax.stride(1),
            POW2=power_of_two, ROW_AMAX=row_amax, **tiles.format_constants(fmt))
    return (q, s, amax) if row_amax else (q, s)


def swiglu_backward_quantize(gu: torch.Tensor, da: torch.Tensor, fmt: Fp8Format, grad_fmt: Fp8Format,
                             power_of_two: bool, a_amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """gu (M, 2F), da (M, F) -> (dgu_fp8 (M, 2F), scales, dgut_fp8 (2F, M_pad), scales_t) in `grad_fmt`, and
    (at_fp8 (F, M_pad), scales): silu(gate) * up's transpose in `fmt`, in 128x128 blocks given the forward's tile
    maxima `a_amax` (M, F/128) (`producers.swiglu_backward_quantize`; the Gluon column kernel only). Two kernels:
    the rows, then the columns (on SM90 the Gluon column kernel, the same bytes in fewer instructions); on SM90,
    where TMA can read gu and da (every training step's BF16 inputs), both in one launch
    (`swiglu_cols_gluon.swiglu_backward_rows_cols`, switched by `ROWS_COLS_ONE_LAUNCH`, on: the same bytes and
    programs, gu and da read from HBM about once; 15% faster than the two at the MoE experts' shape, job IZ).
    One kernel holding whole tiles of all three results was slower, in Triton (`docs/benchmarks.md`, twenty-third
    session: 1.035 against 0.730 ms at the MoE experts' shape) and in Gluon (job EK: 1.605 against 1.169 ms at the
    8B-layer shape; 255 registers a thread, one program an SM; job FH: 2.136 against 1.016 ms)."""
    assert gu.stride(1) == 1 and da.stride(1) == 1, "swiglu_backward_quantize needs row-major inputs"
    m, f = da.shape
    blocks = a_amax is not None
    q, s, qt, st = out = tiles.rows_cols_outputs(m, 2 * f, grad_fmt, gu.device)
    at, ats = tiles.rows_cols_outputs(m, f, fmt, gu.device, cols_in_blocks=blocks)[2:]
    check_offsets("swiglu_backward_quantize", gu, da, *out, at)
    gluon = tiles.hopper_gluon(gu.device, "swiglu_cols_gluon")  # the same bytes in fewer instructions
    if blocks:
        check_tile_maxima(a_amax, (m, f))
        if gluon is None:
            raise ValueError("SwiGLU's a^T in 128x128 blocks (precision.fp8_wgrad_input_blocks) is quantized by the "
                             "Gluon column kernel, on SM90: use the hopper backend there, or the reference one")
    if m and gluon and gluon.ROWS_COLS_ONE_LAUNCH and gluon.tma_fits(gu, da):  # both kernels' work, one launch
        gluon.swiglu_backward_rows_cols(gu, da, q, s, qt, st, at, ats, fmt, grad_fmt, power_of_two, a_amax=a_amax)
    elif m:
        swiglu_backward_rows(gu, da, q, s, grad_fmt, power_of_two)
        if gluon:
            gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, fmt, grad_fmt, power_of_two, a_amax=a_amax)
        else:
            swiglu_backward_cols(gu, da, qt, st, at, ats, fmt, grad_fmt, power_of_two)
    return (*out, at, ats)


def swiglu_backward_rows(gu: torch.Tensor, da: torch.Tensor, q: torch.Tensor, s: torch.Tensor, grad_fmt: Fp8Format,
                         power_of_two: bool) -> None:
    """The row kernel alone: d(gu) along the features into q/s (`grad_fmt`), from gu and da."""
    m, f = da.shape
    _swiglu_backward_rows_kernel[lambda meta: (f // TILE, triton.cdiv(m, meta["BLOCK_M"]))](
        gu, da, q, s, m, f, gu.stride(0), da.stride(0), q.stride(0), s.stride(0), s.stride(1), GRAD_MAX=grad_fmt.max,
        POW2=power_of_two)


def swiglu_backward_cols(gu: torch.Tensor, da: torch.Tensor, qt: torch.Tensor, st: torch.Tensor, at: torch.Tensor,
                         ats: torch.Tensor, fmt: Fp8Format, grad_fmt: Fp8Format, power_of_two: bool) -> None:
    """The column kernel alone: d(gu)^T into qt/st (`grad_fmt`) and a^T into at/ats (`fmt`), from gu and da (the
    Triton kernel; `swiglu_cols_gluon.swiglu_backward_cols` writes the same bytes on SM90)."""
    m, f = da.shape
    _swiglu_backward_cols_kernel[lambda meta: (f // meta["BLOCK_N"], triton.cdiv(m, TILE))](
        gu, da, qt, st, at, ats, m, f, gu.stride(0), da.stride(0), qt.stride(0), st.stride(0), st.stride(1),
        at.stride(0), ats.stride(0), ats.stride(1), GRAD_MAX=grad_fmt.max, POW2=power_of_two,
        **tiles.format_constants(fmt))


@triton.jit
def _rope_pairs(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, rows, kb, M, NQ, NK, seq_len, stride_dq, stride_dk,
                stride_dv, stride_cos, stride_sin, HEAD_DIM: tl.constexpr):
    """Tile column kb of [RoPE^T(dq) | RoPE^T(dk) | dv] in FP32 at `rows`, as its 64 rotation pairs: (x_lo, x_hi,
    col_lo, col_hi), x_lo (rows, 64) at columns col_lo (each head's first half), x_hi at col_hi = col_lo + head_dim
    / 2 (its second half). Each thread holds both elements of a pair, so RoPE's backward
        [x_lo | x_hi] = [d_lo cos_lo + d_hi sin_hi | d_hi cos_hi - d_lo sin_lo]
    needs one read of d; dv's tiles are split the same way, unrotated. The tile lies in one of the three (their
    widths are whole tiles; head_dim divides 128). Rows past M read as zeros."""
    pair = tl.arange(0, 64)
    half: tl.constexpr = HEAD_DIM // 2
    in_head = pair % half  # position in the head's first half
    col_lo = kb * 128 + (pair // half) * HEAD_DIM + in_head  # runs of head_dim / 2 contiguous columns
    col_hi = col_lo + half
    in_rows = (rows < M)[:, None]
    if kb * 128 < NQ + NK:
        if kb * 128 < NQ:
            row_ptrs = dq_ptr + rows[:, None].to(tl.int64) * stride_dq
        else:
            row_ptrs = dk_ptr + rows[:, None].to(tl.int64) * stride_dk - NQ
        d_lo = tl.load(row_ptrs + col_lo[None, :], mask=in_rows, other=0.0).to(tl.float32)
        d_hi = tl.load(row_ptrs + col_hi[None, :], mask=in_rows, other=0.0).to(tl.float32)
        pos = (rows % seq_len)[:, None]
        cos_ptrs = cos_ptr + pos * stride_cos + in_head[None, :]
        sin_ptrs = sin_ptr + pos * stride_sin + in_head[None, :]
        # Rows past M (the last tile's padding) read no table either: past a table of fewer than seq_len rows their
        # positions would point outside it, and a nan there times a zero d would be a nan column scale.
        x_lo = d_lo * tl.load(cos_ptrs, mask=in_rows, other=0.0) + d_hi * tl.load(sin_ptrs + half, mask=in_rows,
                                                                                   other=0.0)
        x_hi = d_hi * tl.load(cos_ptrs + half, mask=in_rows, other=0.0) - d_lo * tl.load(sin_ptrs, mask=in_rows,
                                                                                          other=0.0)
    else:
        row_ptrs = dv_ptr + rows[:, None].to(tl.int64) * stride_dv - NQ - NK
        x_lo = tl.load(row_ptrs + col_lo[None, :], mask=in_rows, other=0.0).to(tl.float32)
        x_hi = tl.load(row_ptrs + col_hi[None, :], mask=in_rows, other=0.0).to(tl.float32)
    return x_lo, x_hi, col_lo, col_hi


# One pass over a 128x128 tile held as its 64 rotation pairs: each element read once, each thread holding an
# element with its partner. Compiled for SM90 (CPU, `tests/test_ws_gemm_compiles.py`): 4 warps 255 registers and
# ~32 SASS instructions per element, 8 warps 145 and ~50, 16 warps 116 and ~80; none spills (the Triton row +
# column quantizer alone: ~23 at 4 warps). Earlier versions measured on the ~1B shape (docs/benchmarks.md): a whole
# tile with the partner and tables loaded per element (255 registers at 8 warps, spilling; job BP, 1.12 ms), then
# two passes over slices (job BR, 0.39 ms, each element's partner and two table entries read in each pass).
@triton.autotune(configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16)],
                 key=["N", "HEAD_DIM", "FP8_MAX", "POW2"])
@triton.jit
def _rope_backward_quantize_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, N, NQ,
                                   NK, seq_len, stride_dq, stride_dk, stride_dv, stride_cos, stride_sin, stride_qm,
                                   stride_sm, stride_sk, stride_qt, stride_st_k, stride_st_m,
                                   HEAD_DIM: tl.constexpr, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """One 128x128 tile of [RoPE^T(dq) | RoPE^T(dk) | dv], quantized from FP32 along its rows (each row's scale over
    both halves of its pairs) and along its columns (each half's columns on their own). Rows past M are zeros in the
    transposed tiles' padding."""
    kb = tl.program_id(0)
    mb = tl.program_id(1)
    rows = mb * 128 + tl.arange(0, 128)
    x_lo, x_hi, col_lo, col_hi = _rope_pairs(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, rows, kb, M, NQ, NK, seq_len,
                                             stride_dq, stride_dk, stride_dv, stride_cos, stride_sin, HEAD_DIM)
    # Rows (`tiles.store_rows` over the two halves): one scale per token.
    row_amax = tl.maximum(tiles.amax(tl.abs(x_lo), 1), tiles.amax(tl.abs(x_hi), 1),
                          propagate_nan=tl.PropagateNan.ALL)
    row_scale, row_inv = tiles.tile_scale(row_amax, FP8_MAX, POW2)
    in_rows = rows < M
    q_rows = q_ptr + rows[:, None] * stride_qm
    tl.store(q_rows + col_lo[None, :], tiles.to_fp8(x_lo, row_inv[:, None], FP8_MAX, q_ptr.dtype.element_ty),
             mask=in_rows[:, None])
    tl.store(q_rows + col_hi[None, :], tiles.to_fp8(x_hi, row_inv[:, None], FP8_MAX, q_ptr.dtype.element_ty),
             mask=in_rows[:, None])
    tl.store(s_ptr + rows * stride_sm + kb * stride_sk, row_scale, mask=in_rows)
    # Columns (`tiles.store_cols`, each half): one scale per feature over the tile's 128 tokens, x^T stored.
    tiles.store_cols(x_lo, rows, col_lo, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX, POW2)
    tiles.store_cols(x_hi, rows, col_hi, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX, POW2)


def rope_backward_quantize(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           seq_len: int, head_dim: int, fmt: Fp8Format, power_of_two: bool) -> tuple[torch.Tensor, ...]:
    """`producers.rope_backward_quantize` in one kernel: dq, dk (M, heads x head_dim) the gradients of the rotated
    queries and keys, dv (M, Nv), cos/sin the (positions, head_dim) FP32 tables -> (dy_fp8 (M, N), scales,
    dyt_fp8 (N, M_pad), scales_t), N = Nq + Nk + Nv. Needs `rope_backward_fusable` widths and row-major inputs."""
    m, widths = dq.shape[0], (dq.shape[1], dk.shape[1], dv.shape[1])
    assert rope_backward_fusable(widths, head_dim), f"rope_backward_quantize cannot take widths {widths}, {head_dim}"
    assert all(t.stride(1) == 1 for t in (dq, dk, dv, cos, sin)), "rope_backward_quantize needs row-major inputs"
    assert cos.dtype == sin.dtype == torch.float32 and dk.shape[0] == dv.shape[0] == m
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.shape[0] >= min(m, seq_len), \
        f"RoPE tables {tuple(cos.shape)} for heads of {head_dim} and sequences of {seq_len}"
    assert dq.dtype == dk.dtype == dv.dtype, "rope_backward_quantize needs dq, dk and dv of one dtype"
    n = sum(widths)
    out = tiles.rows_cols_outputs(m, n, fmt, dq.device)
    check_offsets("rope_backward_quantize", dq, dk, dv, *out)
    if not m:
        return out
    gluon = tiles.hopper_gluon(dq.device, "rows_cols_gluon")  # the same bytes in fewer instructions
    (gluon.launch_rope_backward if gluon else launch_rope_backward_triton)(dq, dk, dv, cos, sin, seq_len, head_dim,
                                                                          out, fmt, power_of_two)
    return out


def launch_rope_backward_triton(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, seq_len: int, head_dim: int, out: tuple, fmt: Fp8Format,
                                power_of_two: bool) -> None:
    """Fill `out` (from `tiles.rows_cols_outputs`) as `rope_backward_quantize` does, by the Triton kernel: what
    GPUs other than SM90 run, and the twin `rows_cols_gluon.launch_rope_backward` (same arguments) is checked
    against. Arguments as `rope_backward_quantize` checked them."""
    m, nq, nk = dq.shape[0], dq.shape[1], dk.shape[1]
    n = nq + nk + dv.shape[1]
    _rope_backward_quantize_kernel[(n // TILE, triton.cdiv(m, TILE))](
        dq, dk, dv, cos, sin, *out, m, n, nq, nk, seq_len, dq.stride(0), dk.stride(0), dv.stride(0), cos.stride(0),
        sin.stride(0), *tiles.rows_cols_strides(*out), HEAD_DIM=head_dim, POW2=power_of_two,
        **tiles.format_constants(fmt))
