"""SwiGLU backward's column outputs in Gluon: d(gu)^T and SwiGLU's output a^T, quantized along the tokens. On SM90
`producers.swiglu_backward_quantize` runs this kernel instead of the Triton column kernel
(`producers._swiglu_backward_cols_kernel`, kept for other GPUs and as the reference it is checked against): the same
bytes (`tests/test_fp8_gpu.py`, `benchmarks/swiglu_cols_variants.py`) in 0.343 against 0.449 ms at the ~1B shape
(`docs/benchmarks.md`, eleventh session).

Why it is faster: the column kernel is bound by the instructions it issues, not by memory (Nsight Compute), and
Gluon lets us choose the layout that needs fewest. Each thread holds 8 consecutive tokens x 4 consecutive features,
16 lanes of a warp cover the 128 tokens and 2 lanes its 8 features, and the warps sit side by side along the
features (`block_layouts`). A column's max is taken within the thread and over 4 shuffle rounds, with no barrier;
each thread writes its 8 tokens of a column as 8 consecutive FP8 bytes of the transposed output, straight from its
registers. Three more savings, each worth 10-25 instructions per element (58 remain, against 143 in the Triton
kernel; `tests/test_ws_gemm_compiles.py` bounds it):
- nan-propagating maxima are one `max.NaN` instruction;
- no clamp before the FP8 conversion, which saturates by itself (`cvt.rn.satfinite`);
- the two correctly rounded divisions per column are shared out over the warp's lanes (`spread_layout`), one
  column each, instead of every lane dividing for all its warp's columns.

Numerics are the Triton kernels' (`megafp8.precision.kernels.tiles`, `producers`), op for op, so the two give the
same bits.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language import PropagateNan

from megafp8.precision.formats import MIN_AMAX, Fp8Format

_TOKENS = gl.constexpr(128)
_MIN_AMAX = gl.constexpr(MIN_AMAX)
_NAN_PROPAGATES = gl.constexpr(PropagateNan.ALL)
TOKENS_PER_THREAD = 8  # 16 lanes along the tokens: 4 shuffle rounds per column max, 8-byte column runs
FEATURES_PER_THREAD = 4  # x 2 lanes: a warp's 8 features are a 16-byte row segment


@gluon.jit
def _nan_max(a, b):
    """Elementwise max, nan if either is nan (tiles.max_propagating_nan): one `max.NaN` instruction."""
    return gl.maximum(a, b, propagate_nan=_NAN_PROPAGATES)


@gluon.jit
def _tile_scale(amax, FP8_MAX: gl.constexpr, POW2: gl.constexpr):
    """(dequantization scale, quantization multiplier) per column, as `tiles.tile_scale`."""
    zero = amax == 0
    amax = gl.where(zero, amax, _nan_max(amax, _MIN_AMAX))
    scale = gl.div_rn(amax, gl.full(amax.shape, FP8_MAX, gl.float32, amax.type.layout))
    if POW2:
        bits = scale.to(gl.int32, bitcast=True)
        up = (bits & 0x7F800000) + gl.where((bits & 0x7FFFFF) != 0, 0x800000, 0)
        finite_pos = (scale > 0) & (scale < float("inf"))
        scale = gl.where(finite_pos, up.to(gl.float32, bitcast=True), scale)
        inv = gl.div_rn(gl.full(scale.shape, 1.0, gl.float32, scale.type.layout), scale)
    else:
        inv = gl.div_rn(gl.full(amax.shape, FP8_MAX, gl.float32, amax.type.layout), amax)
    return gl.where(zero, 1.0, scale), gl.where(zero, 1.0, inv)


@gluon.jit
def _store_cols(x, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX: gl.constexpr,
                POW2: gl.constexpr, STORE: gl.constexpr, SPREAD: gl.constexpr):
    """x (128 tokens, columns) FP32 quantized along the tokens (`tiles.store_cols`): values at qt[cols, rows],
    scales at st[cols, mb]. The FP8 tile moves to `STORE` (the same threads, tokens first in each thread's
    registers: no data leaves a thread) so that each thread writes its tokens of a column as one store."""
    amax = gl.reduce(gl.abs(x), 0, _nan_max)  # the 16 token lanes of a column all hold its maximum
    # SPREAD: each lane takes one of its warp's columns for the two correctly rounded divisions (~10 instructions
    # each) instead of every lane dividing for all the columns it holds; the multipliers return to the lanes that
    # hold each column through a few hundred bytes of shared memory (a barrier per result, measured faster).
    if SPREAD is None:
        scale, inv = _tile_scale(amax, FP8_MAX, POW2)
        scale_cols = cols
    else:
        scale, inv = _tile_scale(gl.convert_layout(amax, SPREAD), FP8_MAX, POW2)
        inv = gl.convert_layout(inv, amax.type.layout)
        scale_cols = gl.convert_layout(cols, SPREAD)
    # No clamp: the conversion saturates (`cvt.rn.satfinite`: finite values past FP8_MAX and infinities give
    # +-FP8_MAX, nan stays nan), which is what tiles.to_fp8's clamp-then-convert gives, in 2 fewer instructions.
    q = x * gl.expand_dims(inv, 0)
    q = gl.convert_layout(q.to(qt_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), STORE)
    rows = mb * _TOKENS + gl.arange(0, _TOKENS, layout=gl.SliceLayout(1, STORE))
    store_cols = gl.convert_layout(cols, gl.SliceLayout(0, STORE))
    gl.store(qt_ptr + gl.expand_dims(store_cols, 0) * stride_qt + gl.expand_dims(rows, 1), q)
    gl.store(st_ptr + scale_cols * stride_st_k + mb * stride_st_m, scale)


@gluon.jit
def _swiglu_backward_cols_kernel(gu_ptr, da_ptr, qt_ptr, st_ptr, at_ptr, ats_ptr, M, F, stride_gm, stride_dm,
                                 stride_qt, stride_st_k, stride_st_m, stride_at, stride_ats_k, stride_ats_m,
                                 GRAD_MAX: gl.constexpr, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                                 BLOCK_N: gl.constexpr, LOAD: gl.constexpr, STORE: gl.constexpr,
                                 SPREAD: gl.constexpr):
    """d(gu)^T and a^T for 128 tokens x BLOCK_N features; rows past M read as zeros (the transposes' padding), as
    in the Triton column kernel. LOAD and STORE (`block_layouts`) put the same elements in the same threads, each
    thread's features first (row-segment reads) or its tokens first (column-run writes)."""
    load: gl.constexpr = LOAD
    store: gl.constexpr = STORE
    block_n: gl.constexpr = BLOCK_N
    mb = gl.program_id(1)
    rows = mb * _TOKENS + gl.arange(0, _TOKENS, layout=gl.SliceLayout(1, load))
    cols = gl.program_id(0) * block_n + gl.arange(0, block_n, layout=gl.SliceLayout(0, load))
    in_rows = gl.expand_dims(rows < M, 1)
    gate_ptrs = gu_ptr + gl.expand_dims(rows, 1) * stride_gm + gl.expand_dims(cols, 0)
    gate = gl.load(gate_ptrs, mask=in_rows, other=0.0).to(gl.float32)
    up = gl.load(gate_ptrs + F, mask=in_rows, other=0.0).to(gl.float32)
    s = 1.0 / (1.0 + gl.exp(-gate))
    _store_cols(gate * s * up, cols, mb, at_ptr, stride_at, ats_ptr, stride_ats_k, stride_ats_m, FP8_MAX, POW2,
                store, SPREAD)
    da = gl.load(da_ptr + gl.expand_dims(rows, 1) * stride_dm + gl.expand_dims(cols, 0), mask=in_rows, other=0.0)
    da_s = da.to(gl.float32) * s
    _store_cols(da_s * up * (1.0 + gate * (1.0 - s)), cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k,
                stride_st_m, GRAD_MAX, POW2, store, SPREAD)
    _store_cols(da_s * gate, cols + F, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, GRAD_MAX, POW2,
                store, SPREAD)


def spread_layout(features_per_warp: int, num_warps: int) -> gl.DistributedLinearLayout:
    """The layout of a block's per-column values in which lane l of warp w holds column
    features_per_warp * w + l % features_per_warp: the lanes of a warp share out its columns instead of each
    holding all of them (lanes past features_per_warp repeat the first ones)."""
    lanes = _bases(features_per_warp, 1, 1)
    return gl.DistributedLinearLayout(reg_bases=[], lane_bases=lanes + [[0]] * (5 - len(lanes)),
                                      warp_bases=_bases(num_warps, features_per_warp, 1), block_bases=[],
                                      shape=[features_per_warp * num_warps])


def _bases(count: int, step: int, rank: int, dim: int = 0) -> list:
    """log2(count) linear-layout bases stepping by step, 2 step, 4 step ... along `dim` of a rank-`rank` shape."""
    return [[step << i if d == dim else 0 for d in range(rank)] for i in range(count.bit_length() - 1)]


def block_layouts(tokens_each: int, features_each: int, num_warps: int) -> tuple:
    """(BLOCK_N, LOAD, STORE) for 128 tokens x BLOCK_N features: each thread holds tokens_each x features_each, a
    warp's lanes cover the 128 tokens (128 / tokens_each lanes) and as many feature groups as remain, the warps sit
    side by side along the features. LOAD lists a thread's registers features first, STORE tokens first: the same
    elements in the same threads (converting between them moves no data)."""
    token_lanes = 128 // tokens_each
    assert token_lanes <= 32 and 32 % token_lanes == 0, f"{tokens_each} tokens a thread cannot cover 128 in a warp"
    feature_lanes = 32 // token_lanes
    block_n = features_each * feature_lanes * num_warps
    features, tokens = _bases(features_each, 1, 2, 1), _bases(tokens_each, 1, 2, 0)
    lanes = _bases(feature_lanes, features_each, 2, 1) + _bases(token_lanes, tokens_each, 2, 0)
    warps = _bases(num_warps, features_each * feature_lanes, 2, 1)

    def layout(registers: list) -> gl.DistributedLinearLayout:
        return gl.DistributedLinearLayout(reg_bases=registers, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                          shape=[128, block_n])
    return block_n, layout(features + tokens), layout(tokens + features)


def swiglu_backward_cols(gu: torch.Tensor, da: torch.Tensor, qt: torch.Tensor, st: torch.Tensor, at: torch.Tensor,
                         ats: torch.Tensor, fmt: Fp8Format, grad_fmt: Fp8Format, power_of_two: bool,
                         num_warps: int = 4, tokens_each: int = TOKENS_PER_THREAD,
                         features_each: int = FEATURES_PER_THREAD, spread: bool = True) -> None:
    """Fill qt/st (d(gu)^T (2F, M_pad) in `grad_fmt`) and at/ats (a^T (F, M_pad) in `fmt`) from gu (M, 2F) and
    da (M, F), as the Triton column kernel does (outputs from `tiles.rows_cols_outputs`)."""
    m, f = da.shape
    block_n, load, store = block_layouts(tokens_each, features_each, num_warps)
    assert f % block_n == 0, f"F={f} must be a multiple of {block_n}"
    grid = (f // block_n, -(-m // 128))
    _swiglu_backward_cols_kernel[grid](
        gu, da, qt, st, at, ats, m, f, gu.stride(0), da.stride(0), qt.stride(0), st.stride(0), st.stride(1),
        at.stride(0), ats.stride(0), ats.stride(1), GRAD_MAX=grad_fmt.max, FP8_MAX=fmt.max, POW2=power_of_two,
        BLOCK_N=block_n, LOAD=load, STORE=store,
        SPREAD=spread_layout(block_n // num_warps, num_warps) if spread else None, num_warps=num_warps)
