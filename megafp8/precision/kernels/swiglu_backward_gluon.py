"""SwiGLU's backward in one Gluon pass (SM90): from gu = [gate | up] and da, d(gu) quantized along the features (the
input-gradient GEMM's operand), d(gu)^T and a^T quantized along the tokens (the two weight-gradient GEMMs').

`producers.swiglu_backward_quantize` otherwise runs two kernels, each reading gu and da: the Triton row kernel
(d(gu) rows, at about HBM's bandwidth) and the Gluon column kernel (`swiglu_cols_gluon`, bound by the instructions
it issues). One pass moves 11 bytes per (token, feature) instead of 17 and computes SwiGLU's derivative once.

Each program owns 128 tokens x 128 features (a whole 1x128 tile along each axis), in the column kernel's layout
(`gluon_tiles.block_layouts`): each thread holds TOKENS_EACH tokens x FEATURES_EACH features, a column's 128 tokens
lie in one warp's lanes (column maxima by shuffles), the warps side by side along the features (row maxima through
shared memory). Numerics are the Triton kernels' op for op (`producers._swiglu_backward_slice`, `tiles.store_rows`,
`tiles.store_cols`), so the outputs are the same bytes.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import DistributedLinearLayout

from megafp8.precision.formats import Fp8Format
from megafp8.precision.kernels import gluon_tiles
from megafp8.precision.kernels.rows_cols_gluon import _load_rows
from megafp8.precision.kernels.swiglu_cols_gluon import exp_neg

TOKENS_EACH = 8
FEATURES_EACH = 8
WARPS = 8  # 8 tokens x 8 features a thread: 8 warps cover 128 features


@gluon.jit
def _store_rows(x, rows, cols, kb, M, q_ptr, s_ptr, stride_qm, stride_sm, stride_sk, FP8_MAX: gl.constexpr,
                POW2: gl.constexpr, ROWS: gl.constexpr, MASKED: gl.constexpr):
    """x (128 tokens `rows`, 128 features `cols`) FP32 quantized along its rows (`tiles.store_rows`): values at
    q[rows, cols], scales at s[rows, kb]; rows past M are not stored."""
    amax = gl.reduce(gl.abs(x), 1, gluon_tiles.nan_max)
    scale, inv = gluon_tiles.tile_scale(gl.convert_layout(amax, ROWS), FP8_MAX, POW2)
    inv = gl.convert_layout(inv, amax.type.layout)
    q = (x * gl.expand_dims(inv, 1)).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # saturating
    q_ptrs = q_ptr + gl.expand_dims(rows, 1) * stride_qm + gl.expand_dims(cols, 0)
    scale_rows = gl.program_id(1) * 128 + gl.arange(0, 128, layout=ROWS)
    if MASKED:
        gl.store(q_ptrs, q, mask=gl.expand_dims(rows < M, 1))
        gl.store(s_ptr + scale_rows * stride_sm + kb * stride_sk, scale, mask=scale_rows < M)
    else:
        gl.store(q_ptrs, q)
        gl.store(s_ptr + scale_rows * stride_sm + kb * stride_sk, scale)


@gluon.jit
def _swiglu_backward_kernel(gu_ptr, da_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, at_ptr, ats_ptr, M, F, stride_gm,
                            stride_dm, stride_qm, stride_sm, stride_sk, stride_qt, stride_st_k, stride_st_m,
                            stride_at, stride_ats_k, stride_ats_m, GRAD_MAX: gl.constexpr, FP8_MAX: gl.constexpr,
                            POW2: gl.constexpr, LOAD: gl.constexpr, STORE: gl.constexpr, SPREAD: gl.constexpr,
                            ROWS: gl.constexpr, VARIANT: gl.constexpr, MASKED: gl.constexpr):
    """Tile (kb, mb): a^T, d_gate and d_up (rows and columns) for 128 tokens x 128 features; rows past M read as
    zeros (the transposes' padding) and are not stored along the rows."""
    kb = gl.program_id(0)
    mb = gl.program_id(1)
    rows = mb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LOAD))
    cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LOAD))
    in_rows = gl.expand_dims(rows < M, 1)
    gate_ptrs = gu_ptr + gl.expand_dims(rows, 1) * stride_gm + gl.expand_dims(cols, 0)
    gate = _load_rows(gate_ptrs, in_rows, MASKED)
    up = _load_rows(gate_ptrs + F, in_rows, MASKED)
    s = 1.0 / (1.0 + exp_neg(gate.to(gl.float32)))
    gluon_tiles.store_cols(gate.to(gl.float32) * s * up.to(gl.float32), cols, mb, at_ptr, stride_at, ats_ptr,
                           stride_ats_k, stride_ats_m, FP8_MAX, POW2, STORE, SPREAD)
    da = _load_rows(da_ptr + gl.expand_dims(rows, 1) * stride_dm + gl.expand_dims(cols, 0), in_rows, MASKED)
    if VARIANT == 2:
        s = 1.0 / (1.0 + exp_neg(gate.to(gl.float32)))
    da_s = da.to(gl.float32) * s
    if VARIANT != 1:
        d_gate = da_s * up.to(gl.float32) * (1.0 + gate.to(gl.float32) * (1.0 - s))
        _store_both(d_gate, rows, cols, kb, mb, M, q_ptr, s_ptr, qt_ptr, st_ptr, stride_qm, stride_sm, stride_sk,
                    stride_qt, stride_st_k, stride_st_m, GRAD_MAX, POW2, STORE, SPREAD, ROWS, MASKED)
        d_up = da_s * gate.to(gl.float32)
        _store_both(d_up, rows, cols + F, kb + F // 128, mb, M, q_ptr, s_ptr, qt_ptr, st_ptr, stride_qm, stride_sm,
                    stride_sk, stride_qt, stride_st_k, stride_st_m, GRAD_MAX, POW2, STORE, SPREAD, ROWS, MASKED)
    else:
        d_up = da_s * gate.to(gl.float32)
        _store_both(d_up, rows, cols + F, kb + F // 128, mb, M, q_ptr, s_ptr, qt_ptr, st_ptr, stride_qm, stride_sm,
                    stride_sk, stride_qt, stride_st_k, stride_st_m, GRAD_MAX, POW2, STORE, SPREAD, ROWS, MASKED)
        d_gate = da_s * up.to(gl.float32) * (1.0 + gate.to(gl.float32) * (1.0 - s))
        _store_both(d_gate, rows, cols, kb, mb, M, q_ptr, s_ptr, qt_ptr, st_ptr, stride_qm, stride_sm, stride_sk,
                    stride_qt, stride_st_k, stride_st_m, GRAD_MAX, POW2, STORE, SPREAD, ROWS, MASKED)


@gluon.jit
def _store_both(x, rows, cols, kb, mb, M, q_ptr, s_ptr, qt_ptr, st_ptr, stride_qm, stride_sm, stride_sk, stride_qt,
                stride_st_k, stride_st_m, FP8_MAX: gl.constexpr, POW2: gl.constexpr, STORE: gl.constexpr,
                SPREAD: gl.constexpr, ROWS: gl.constexpr, MASKED: gl.constexpr):
    """x quantized along its rows (q, s) and its columns (qt, st)."""
    _store_rows(x, rows, cols, kb, M, q_ptr, s_ptr, stride_qm, stride_sm, stride_sk, FP8_MAX, POW2, ROWS, MASKED)
    gluon_tiles.store_cols(x, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX, POW2, STORE,
                           SPREAD)


@functools.cache
def layouts(tokens_each: int = TOKENS_EACH, features_each: int = FEATURES_EACH, num_warps: int = WARPS) -> tuple:
    """(LOAD, STORE, SPREAD, ROWS) for the 128 x 128 tile: `gluon_tiles.block_layouts`' two, the columns' division
    layout (`gluon_tiles.spread_layout`) and one row a thread for the rows' divisions (threads past 128 repeat)."""
    block_n, load, store = gluon_tiles.block_layouts(tokens_each, features_each, num_warps)
    assert block_n == 128, f"{tokens_each} x {features_each} a thread at {num_warps} warps do not tile 128 features"
    warps = [[32 << i] if i < 2 else [0] for i in range(num_warps.bit_length() - 1)]
    rows = DistributedLinearLayout(reg_bases=[], lane_bases=gluon_tiles.bases(32, 1, 1), warp_bases=warps,
                                   block_bases=[], shape=[128])
    return load, store, gluon_tiles.spread_layout(block_n // num_warps, num_warps), rows


_LAUNCH = gluon_tiles.TokenCountLaunch(_swiglu_backward_kernel)


def swiglu_backward(gu: torch.Tensor, da: torch.Tensor, out: tuple, at: torch.Tensor, ats: torch.Tensor,
                    fmt: Fp8Format, grad_fmt: Fp8Format, power_of_two: bool, tokens_each: int = TOKENS_EACH,
                    features_each: int = FEATURES_EACH, num_warps: int = WARPS) -> None:
    """Fill out = (q, s, qt, st) (d(gu) both ways in `grad_fmt`, from `tiles.rows_cols_outputs`) and at/ats (a^T in
    `fmt`) from gu (M, 2F) and da (M, F), as the Triton row and column kernels do."""
    m, f = da.shape
    q, s, qt, st = out
    assert f % 128 == 0, f"F={f} must be a multiple of 128"
    load, store, spread, rows = layouts(tokens_each, features_each, num_warps)
    _LAUNCH.launch((f // 128, -(-m // 128)),
                   (gu, da, q, s, qt, st, at, ats, m, f, gu.stride(0), da.stride(0), q.stride(0), s.stride(0),
                    s.stride(1), qt.stride(0), st.stride(0), st.stride(1), at.stride(0), ats.stride(0),
                    ats.stride(1)),
                   dict(GRAD_MAX=grad_fmt.max, FP8_MAX=fmt.max, POW2=power_of_two, LOAD=load, STORE=store,
                        SPREAD=spread, ROWS=rows, VARIANT=0, MASKED=m % 128 != 0, num_warps=num_warps))
