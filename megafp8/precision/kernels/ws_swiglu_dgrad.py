"""The experts' down-projection dgrad with SwiGLU's backward in its epilogue (Hopper, Gluon): the warp-specialized
grouped GEMM of `megafp8.precision.kernels.ws_gemm` (its producer warp and its consumers' K loop, unchanged), whose
consumers, instead of writing da = dy @ w_down (Mp, F) in BF16 for SwiGLU's backward kernels to read back, compute
from the FP32 accumulator and the kept gu = [gate | up] (Mp, 2F) BF16

    d_gate = da * s * up * (1 + gate * (1 - s)),  d_up = da * s * gate,  a = gate * s * up,  s = sigmoid(gate)

and quantize them as `producers.swiglu_backward_quantize` does: d(gu) along the features (1x128, rows) and along
the tokens (128x1, stored transposed), a along the tokens (stored transposed, for the down projection's wgrad).
da never leaves the registers: per element SwiGLU's kernels moved 19 bytes through HBM (da written and read twice,
gu read twice, five FP8 outputs), the epilogue 9 (gu read, the outputs written; its later reads of a tile's gu,
64 KB, come from L2). The definition is
`Fp8Backend.grouped_dgrad_swiglu_backward` (the dgrad in FP32, then SwiGLU's backward); the arithmetic is the SwiGLU
kernels', op for op, so results agree with it to FP8 rounding of last-bit differences (GPU test).

The dense MLP's down projection (issue 18) runs the same kernel without the expert table (`GROUPED_ROWS` off).

Tiles are 128 rows x 128 features (one 1x128 row tile of d_gate and of d_up per row), each consumer warpgroup
owning 64 rows, as in `ws_gemm`. A 128x1 column tile spans both consumers: each reduces its 64 rows' column
maxima, hands them to the other through shared memory (double-buffered slots, an mbarrier both consumers arrive
on), and both quantize with the maximum of the two. Not yet run on a GPU (`grouped.FUSE_SWIGLU_DGRAD` is off).
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from megafp8.precision.formats import Fp8Format
from megafp8.precision.kernels import gluon_tiles, tiles, ws_gemm
from megafp8.precision.kernels.launch import FastLaunch
from megafp8.precision.kernels.swiglu_cols_gluon import exp_neg
from megafp8.precision.kernels.ws_gemm import (_CONSUMER_REGS, _PRODUCER_REGS, HALF_M, NVMMA_LAYOUT, TILE, _producer,
                                               _tile_coords, _tile_product)

_OUTPUTS = gl.constexpr(3)  # column maxima exchanged per slice: d_gate, d_up, a
# The exchange's slots as [1, 128] rows (the layout `ws_gemm` reads its scale vectors through), each read and
# written as a plain vector.
_XCH = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
_FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
# Column tiles stored tokens first: each thread 8 consecutive tokens of a column (8-byte stores of x^T's rows).
_STORE_COLS = gl.constexpr(gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1]))
# Row tiles stored features first: each thread 16 consecutive features of a row (16-byte stores of its rows).
_STORE_ROWS = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))
# One column a thread (128 threads): the tile scales' two correctly rounded divisions once per column, not once per
# column in each of the 8 threads that hold it in the MMA layout (`gluon_tiles.store_cols_scaled`'s SPREAD).
_SPREAD = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
_T = ws_gemm._T  # TILE on the host
STAGES = 4  # 4 x 33 KB of operand stages beside the column tiles' layout conversions


@gluon.jit
def _rows(row0, layout: gl.constexpr):
    return row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))


@gluon.jit
def _cols(col0, layout: gl.constexpr):
    # Made where used, not kept: a 128-column index vector takes 32 registers a thread in the MMA layout.
    return col0 + gl.arange(0, TILE, layout=gl.SliceLayout(0, layout))


@gluon.jit
def _swiglu_output(da, gu_ptr, row0, col0, M, F, stride_gm, WHICH: gl.constexpr):
    """One of SwiGLU's backward values at this consumer's 64 rows from row0 x the 128 features from col0, FP32, as
    `producers._swiglu_backward_slice` computes it (rows past M read as zeros): WHICH 0 d_gate = da * s * up *
    (1 + gate * (1 - s)), 1 d_up = da * s * gate, 2 the output a = gate * s * up (s = sigmoid(gate)). gu is read
    here for each value, six times a tile (the first from HBM, the others from L2): a value held across the next
    one's computation takes 64 more registers a thread, which the epilogue does not have (one read per pass, gate
    and up kept in BF16 and made FP32 afresh for each value, spilled 1.7 KB a thread: ptxas, on a CPU)."""
    layout: gl.constexpr = NVMMA_LAYOUT
    rows = _rows(row0, layout)
    in_rows = gl.expand_dims(rows < M, 1)
    ptrs = gu_ptr + gl.expand_dims(rows.to(gl.int64) * stride_gm, 1) + gl.expand_dims(_cols(col0, layout), 0)
    gate = gl.load(ptrs, mask=in_rows, other=0.0).to(gl.float32)
    up = gl.load(ptrs + F, mask=in_rows, other=0.0).to(gl.float32)
    s = 1.0 / (1.0 + exp_neg(gate))
    if WHICH == 2:
        return gate * s * up
    da_s = da * s
    if WHICH == 0:
        return da_s * up * (1.0 + gate * (1.0 - s))
    return da_s * gate


@gluon.jit
def _store_rows(x, row0, col0, M, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk, FP8_MAX: gl.constexpr,
                POW2: gl.constexpr):
    """x (64 rows from row0, the 128 features from col0) quantized along the features (`tiles.store_rows`), the FP8
    values moved to `_STORE_ROWS` for 16-byte stores (from the MMA layout, which holds column pairs: 2-byte ones)."""
    layout: gl.constexpr = NVMMA_LAYOUT
    scale, inv = gluon_tiles.tile_scale(gl.reduce(gl.abs(x), 1, gluon_tiles.nan_max), FP8_MAX, POW2)
    q = gl.convert_layout((x * gl.expand_dims(inv, 1)).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                          _STORE_ROWS)
    q_rows = _rows(row0, _STORE_ROWS)
    gl.store(q_ptr + gl.expand_dims(q_rows.to(gl.int64) * stride_qm, 1) + gl.expand_dims(_cols(col0, _STORE_ROWS), 0),
             q, mask=gl.expand_dims(q_rows < M, 1))
    rows = _rows(row0, layout)
    gl.store(s_ptr + rows * stride_sm + (col0 // TILE) * stride_sk, scale, mask=rows < M)


@gluon.jit
def _store_cols(x, amax, row0, col0, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, HALF: gl.constexpr,
                FP8_MAX: gl.constexpr, POW2: gl.constexpr):
    """x (this consumer's 64 tokens from row0, 128 columns from col0) quantized along the tokens with its 128-token
    tile's column maxima `amax` (both consumers' rows), stored transposed at qt[cols, rows]; the scales at st[cols,
    mb], by consumer 0 (both compute the same)."""
    scale, inv = gluon_tiles.tile_scale(amax, FP8_MAX, POW2)  # (`_SPREAD`: one column a thread)
    inv = gl.convert_layout(inv, gl.SliceLayout(0, NVMMA_LAYOUT))
    q = (x * gl.expand_dims(inv, 0)).to(qt_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    q = gl.convert_layout(q, _STORE_COLS)
    qt_rows = _cols(col0, _STORE_COLS)
    tokens = _rows(row0, _STORE_COLS)
    gl.store(qt_ptr + gl.expand_dims(qt_rows.to(gl.int64) * stride_qt, 0) + gl.expand_dims(tokens, 1), q)
    if HALF == 0:
        gl.store(st_ptr + (col0 + gl.arange(0, TILE, layout=_SPREAD)) * stride_st_k + mb * stride_st_m, scale)


@gluon.jit
def _slot(xch, i):
    """Row i of the exchange buffer as a plain vector of 128 FP32."""
    return xch.index(i)._reinterpret(gl.float32, [TILE], _FLAT)


@gluon.jit
def _column_max(da, gu_ptr, row0, col0, M, F, stride_gm, WHICH: gl.constexpr):
    """max |value| over this consumer's 64 rows, per column (NaN if a column holds one)."""
    x = _swiglu_output(da, gu_ptr, row0, col0, M, F, stride_gm, WHICH)
    return gl.reduce(gl.abs(x), 0, gluon_tiles.nan_max)


@gluon.jit
def _exchange(xch, xbar, uses, da, gu_ptr, row0, col0, M, F, stride_gm, HALF: gl.constexpr):
    """Each consumer's column maxima of its 64 rows, for d_gate, d_up and a, written into this consumer's half of a
    slot of `xch`; returns once both consumers have arrived on the slot's barrier (then `_tile_column_max` reads the
    tile's maxima). Two slots alternate (`uses`: the exchanges so far): a slot is written again only two exchanges
    later, after the other consumer arrived at the one between, so after it last read this one. The maxima stay in
    shared memory until used: in registers a 128-column vector takes 32 a thread."""
    slot = uses % 2
    mine = (slot * 2 + HALF) * _OUTPUTS
    _slot(xch, mine).store(_column_max(da, gu_ptr, row0, col0, M, F, stride_gm, 0))
    _slot(xch, mine + 1).store(_column_max(da, gu_ptr, row0, col0, M, F, stride_gm, 1))
    _slot(xch, mine + 2).store(_column_max(da, gu_ptr, row0, col0, M, F, stride_gm, 2))
    gl.thread_barrier()  # this warpgroup's stores before its (one-thread) arrival
    mbarrier.arrive(xbar.index(slot), count=1)
    mbarrier.wait(xbar.index(slot), (uses // 2) & 1)


@gluon.jit
def _tile_column_max(xch, uses, WHICH: gl.constexpr):
    """The 128-token tile's column maxima of output WHICH, one column a thread (`_SPREAD`): the max of both
    consumers' halves of the slot."""
    first = (uses % 2) * 2 * _OUTPUTS + WHICH
    return gluon_tiles.nan_max(_slot(xch, first).load(_SPREAD), _slot(xch, first + _OUTPUTS).load(_SPREAD))


@gluon.jit
def _swiglu_epilogue(da, xch, xbar, uses, off_m, off_n, M, F, gu_ptr, stride_gm, q_ptr, stride_qm, s_ptr, stride_sm,
                     stride_sk, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, at_ptr, stride_at, ats_ptr,
                     stride_ats_k, stride_ats_m, HALF: gl.constexpr, GRAD_MAX: gl.constexpr, FP8_MAX: gl.constexpr,
                     POW2: gl.constexpr):
    """A consumer's 64 rows x 128 features of da (FP32) through SwiGLU's backward into the five quantized outputs.
    Two passes over gu: the maxima (the columns' exchanged with the other consumer), then, gu read again (from L2)
    rather than kept live across the exchange, each output quantized and stored in turn."""
    row0 = off_m + HALF * HALF_M
    mb = off_m // TILE
    _exchange(xch, xbar, uses, da, gu_ptr, row0, off_n, M, F, stride_gm, HALF)
    d_gate = _swiglu_output(da, gu_ptr, row0, off_n, M, F, stride_gm, 0)
    _store_rows(d_gate, row0, off_n, M, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk, GRAD_MAX, POW2)
    _store_cols(d_gate, _tile_column_max(xch, uses, 0), row0, off_n, mb, qt_ptr, stride_qt, st_ptr, stride_st_k,
                stride_st_m, HALF, GRAD_MAX, POW2)
    d_up = _swiglu_output(da, gu_ptr, row0, off_n, M, F, stride_gm, 1)
    _store_rows(d_up, row0, off_n + F, M, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk, GRAD_MAX, POW2)
    _store_cols(d_up, _tile_column_max(xch, uses, 1), row0, off_n + F, mb, qt_ptr, stride_qt, st_ptr, stride_st_k,
                stride_st_m, HALF, GRAD_MAX, POW2)
    a = _swiglu_output(da, gu_ptr, row0, off_n, M, F, stride_gm, 2)
    _store_cols(a, _tile_column_max(xch, uses, 2), row0, off_n, mb, at_ptr, stride_at, ats_ptr, stride_ats_k,
                stride_ats_m, HALF, FP8_MAX, POW2)


@gluon.jit
def _swiglu_consumer(a_bufs, b_bufs, as_bufs, bs_bufs, xch, xbar, ready, empty, bs_ptr, tile_expert_ptr, M, F,
                     K_BLOCKS, num_tiles, stride_bs_e, stride_bs_n, stride_bs_k, gu_ptr, stride_gm, q_ptr, stride_qm,
                     s_ptr, stride_sm, stride_sk, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, at_ptr,
                     stride_at, ats_ptr, stride_ats_k, stride_ats_m, HALF: gl.constexpr, GROUPED_ROWS: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_M: gl.constexpr, GRAD_MAX: gl.constexpr, FP8_MAX: gl.constexpr,
                     POW2: gl.constexpr):
    """One warpgroup: rows [HALF * 64, HALF * 64 + 64) of every 128 x 128 tile of da, then SwiGLU's backward."""
    layout: gl.constexpr = NVMMA_LAYOUT
    counter = 0
    uses = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n, b_row, group, k_first, k_steps = _tile_coords(
            tile, M, F, K_BLOCKS, tile_expert_ptr, tile_expert_ptr, tile_expert_ptr, GROUPED_ROWS, False, TILE,
            GROUP_M)
        # The product's registers are made per tile (not carried across tiles as `ws_gemm` does): dead in the
        # epilogue, which needs them.
        t = gl.zeros([HALF_M, TILE], gl.float32, layout)
        da, unused, t, counter = _tile_product(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, t, counter, bs_ptr,
                                               group, off_n, F, k_first, k_steps, stride_bs_e, stride_bs_n,
                                               stride_bs_k, HALF, True, TILE, STAGES, False, layout)
        _swiglu_epilogue(da, xch, xbar, uses, off_m, off_n, M, F, gu_ptr, stride_gm, q_ptr, stride_qm, s_ptr,
                         stride_sm, stride_sk, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, at_ptr, stride_at,
                         ats_ptr, stride_ats_k, stride_ats_m, HALF, GRAD_MAX, FP8_MAX, POW2)
        uses += 1


@gluon.jit
def _ws_dgrad_swiglu_kernel(a_desc, b_desc, as_desc, bs_desc, bs_ptr, tile_expert_ptr, M, F, K_BLOCKS, stride_bs_e,
                            stride_bs_n, stride_bs_k, gu_ptr, stride_gm, q_ptr, stride_qm, s_ptr, stride_sm,
                            stride_sk, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, at_ptr, stride_at,
                            ats_ptr, stride_ats_k, stride_ats_m, GROUPED_ROWS: gl.constexpr, STAGES: gl.constexpr,
                            GROUP_M: gl.constexpr, GRAD_MAX: gl.constexpr, FP8_MAX: gl.constexpr,
                            POW2: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, TILE], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, TILE, TILE], b_desc.layout)
    as_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, HALF_M], as_desc.layout)
    bs_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, TILE], bs_desc.layout)  # (unused: B in blocks)
    xch = gl.allocate_shared_memory(gl.float32, [2 * 2 * _OUTPUTS, 1, TILE], _XCH)  # slot x consumer x output
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    xbar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    for i in gl.static_range(2):
        mbarrier.init(xbar.index(i), count=2)  # both consumers have written their column maxima
    num_tiles = gl.cdiv(M, TILE) * gl.cdiv(F, TILE)
    gl.warp_specialize([
        (_swiglu_consumer, (a_bufs, b_bufs, as_bufs, bs_bufs, xch, xbar, ready, empty, bs_ptr, tile_expert_ptr, M, F,
                            K_BLOCKS, num_tiles, stride_bs_e, stride_bs_n, stride_bs_k, gu_ptr, stride_gm, q_ptr,
                            stride_qm, s_ptr, stride_sm, stride_sk, qt_ptr, stride_qt, st_ptr, stride_st_k,
                            stride_st_m, at_ptr, stride_at, ats_ptr, stride_ats_k, stride_ats_m, 0, GROUPED_ROWS,
                            STAGES, GROUP_M, GRAD_MAX, FP8_MAX, POW2)),
        (_swiglu_consumer, (a_bufs, b_bufs, as_bufs, bs_bufs, xch, xbar, ready, empty, bs_ptr, tile_expert_ptr, M, F,
                            K_BLOCKS, num_tiles, stride_bs_e, stride_bs_n, stride_bs_k, gu_ptr, stride_gm, q_ptr,
                            stride_qm, s_ptr, stride_sm, stride_sk, qt_ptr, stride_qt, st_ptr, stride_st_k,
                            stride_st_m, at_ptr, stride_at, ats_ptr, stride_ats_k, stride_ats_m, 1, GROUPED_ROWS,
                            STAGES, GROUP_M, GRAD_MAX, FP8_MAX, POW2)),
        (_producer, (a_desc, b_desc, as_desc, bs_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, M, F,
                     K_BLOCKS, num_tiles, tile_expert_ptr, tile_expert_ptr, tile_expert_ptr, GROUPED_ROWS, False,
                     True, TILE, STAGES, GROUP_M)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


_LAUNCH = FastLaunch(_ws_dgrad_swiglu_kernel)  # Triton's JIT once per static signature, then the compiled kernel


def dgrad_swiglu_backward(dy: torch.Tensor, dy_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                          tile_expert: Optional[torch.Tensor], gu: torch.Tensor, fmt: Fp8Format,
                          grad_fmt: Fp8Format, power_of_two: bool, out: Optional[tuple] = None) -> tuple:
    """(dgu_fp8 (M, 2F), scales (M, 2F/128), dgut_fp8 (2F, M_pad), scales_t (2F, M_pad/128), at_fp8 (F, M_pad),
    at_scales (F, M_pad/128)), scales column-major (`tiles.swiglu_backward_outputs`), from dy (M, N) FP8 in
    1x128 tiles with its scales (M, N/128), gu (M, 2F) and the down weight's transpose b in 128x128 blocks: for the
    experts (`tile_expert`, the 128-row tiles' experts; M a multiple of 128) stacked (E * F, N) with scales
    (E, F/128, N/128), for a dense MLP (`tile_expert` None) (F, N) with scales (F/128, N/128). Into `out` where
    given (from `tiles.swiglu_backward_outputs`)."""
    m, n = dy.shape
    f = gu.shape[1] // 2
    q, s, qt, st, at, ats = out = out or tiles.swiglu_backward_outputs(m, f, fmt, grad_fmt, gu.device)
    grouped = tile_expert is not None
    assert n % _T == 0 and f % _T == 0 and gu.shape[0] == m and gu.stride(1) == 1 and (m % _T == 0 or not grouped)
    assert b.shape == ((b_scale.shape[0] if grouped else 1) * f, n) and dy.stride(1) == 1 and b.stride(1) == 1
    num_tiles = -(-m // _T) * (f // _T)
    if num_tiles == 0:
        return out
    dy_scale = ws_gemm._tma_scales(dy_scale)
    as_desc = ws_gemm._scale_descriptor(dy_scale, ws_gemm._H)
    bs_strides = b_scale.stride() if grouped else (0, *b_scale.stride())
    args = (ws_gemm._descriptor(dy, (ws_gemm._H, ws_gemm._T)), ws_gemm._descriptor(b, (ws_gemm._T, ws_gemm._T)),
            as_desc, ws_gemm._scale_descriptor(dy_scale, ws_gemm._T), b_scale,
            tile_expert if grouped else dy_scale, m, f, n // _T, *bs_strides, gu, gu.stride(0), q, q.stride(0), s,
            s.stride(0), s.stride(1), qt, qt.stride(0), st, st.stride(0), st.stride(1), at, at.stride(0), ats,
            ats.stride(0), ats.stride(1))
    options = dict(GROUPED_ROWS=grouped, STAGES=STAGES, GROUP_M=8, GRAD_MAX=grad_fmt.max, FP8_MAX=fmt.max,
                   POW2=power_of_two, num_warps=4, maxnreg=ws_gemm._MAXNREG)
    _LAUNCH.launch((min(ws_gemm._sm_count(dy.device), num_tiles),), args, options)
    return out
