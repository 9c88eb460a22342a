"""The row + column quantizer (`quantize.quantize_rows_cols`: x (M, K) in 1x128 tiles along K for fprop/dgrad and
along M for wgrad, from one read of x), its gathering form (the MoE dispatch), RMSNorm's producer tiles and RoPE's
backward (the fused QKV projection's output gradient, `launch_rope_backward`) in Gluon, for SM90, where
`tiles.hopper_gluon` picks it (other GPUs run the Triton kernels, launched by `quantize.launch_rows_cols_triton`
and `producers.launch_rope_backward_triton` with this module's arguments, whose bytes it writes:
`benchmarks/rows_cols_variants.py`, `benchmarks/rope_variants.py` and GPU tests compare them). Measured on an H200
(docs/benchmarks.md, jobs AH-AJ): 15-21% less device time than the Triton kernels at every measured shape.

Why: the Triton kernel moves its bytes at 55-66% of copy speed and issues 23 SASS instructions per element, about
what a 128x128 tile's memory time allows at the issue rate these kernels reach (`docs/performance.md`). This one
needs 11.7 (12.3 before `_row_scales`; 14.8 with RMSNorm and 13.4 gathering when measured before it;
`tests/test_ws_gemm_compiles.py` bounds them):
- one program per 128x128 tile with 4 warps, each thread holding 16 tokens x 8 features;
- the tile's column maxima within a warp (3 shuffle rounds, no barrier), its row maxima across the 4 warps (one
  exchange through shared memory, laid out so that no access conflicts: `_row_scales`);
- x kept as loaded (BF16) and converted where it is used;
- the correctly rounded divisions shared out, one row and one column per thread (`spread`);
- the FP8 rows written as 8-byte runs, the transposed columns as 16-byte runs, straight from registers; the
  column tile moves into the tokens-first layout while still FP32 (a renaming of each thread's registers), so that
  each paired FP8 conversion packs two consecutive tokens as the transposed store wants them, with no byte
  shuffling after it (14.6 -> 12.3 per element, 9-18% less device time: docs/benchmarks.md, thirty-first
  session). One token runs through a twin compiled with M a runtime value (`gluon_tiles.TokenCountLaunch`).

RoPE's backward tiles are the same quantization after a rotation in FP32 that reads each element's partner (half a
head away) a second time and two table entries: 23.6 instructions per element (26.8 before `_row_scales`)
against ~32 for the Triton kernel at 4 warps; 23-24% less device time on an H200, and 10% less since.

What bounds these kernels (Nsight Compute, docs/benchmarks.md jobs FA-FC) is the L1/TEX pipeline, not DRAM and not
the instructions they issue: cutting instructions alone did not make them faster, removing shared-memory bank
conflicts did.
"""
from __future__ import annotations

import functools
from types import MappingProxyType

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import DistributedLinearLayout

from megafp8.precision.formats import Fp8Format
from megafp8.precision.kernels import gluon_tiles

WARPS = 4
TOKENS_PER_THREAD = 16
FEATURES_PER_THREAD = 8


@functools.cache  # made once: building the layouts costs ~50-130 us of host time, more than a small launch
def tile_layouts(tokens_each: int = TOKENS_PER_THREAD, num_warps: int = WARPS) -> tuple:
    """(LOAD, STORE_T, ROWS, COLS) for a 128 x 128 tile (`gluon_tiles.block_layouts`): each thread tokens_each
    tokens x 8 features (LOAD lists them features first, STORE_T tokens first: the same elements in the same
    threads), a column's 128 tokens in one warp, the warps side by side along the features (by default 4 lanes along
    the features and 8 along the tokens, 4 warps); ROWS gives each of the first 128 threads one row's maxima from
    every warp (`gluon_tiles.token_partials_layout`, read by `_row_scales`), COLS one column's value (threads past
    128 repeat them)."""
    block_n, load, store_t = gluon_tiles.block_layouts(tokens_each, FEATURES_PER_THREAD, num_warps)
    assert block_n == 128, f"{tokens_each} tokens a thread at {num_warps} warps do not tile 128 features"
    assert num_warps >= 4, "ROWS and COLS give each of the first 128 threads one value"
    warps = [[32 << i] if i < 2 else [0] for i in range(num_warps.bit_length() - 1)]
    one_each = DistributedLinearLayout(reg_bases=[], lane_bases=gluon_tiles.bases(32, 1, 1), warp_bases=warps,
                                       block_bases=[], shape=[128])
    return load, store_t, gluon_tiles.token_partials_layout(num_warps), one_each


@gluon.jit
def _row_scales(x, FP8_MAX: gl.constexpr, POW2: gl.constexpr, PARTIALS: gl.constexpr):
    """(scale, multiplier) of each of x's 128 rows (in x's row layout), the max over its 128 features taken in two
    steps: each warp's max over its features of each row (within threads and shuffles), then, through shared memory
    laid out tokens first, the max over the warps' partials, read by one thread a row (`PARTIALS`, which divides
    for its row). The multipliers return through shared memory the same way. Each shared access is conflict-free:
    a thread writes or reads consecutive words, a warp's threads consecutive runs. (Triton's own cross-warp
    reduction and layout conversions here wrote rows 16 bytes apart: 6-way bank conflicts, half the kernel's L1
    wavefronts; Nsight Compute, docs/benchmarks.md job FB.)"""
    num_warps: gl.constexpr = PARTIALS.shape[1]
    per_warp = gl.reduce(gl.reshape(gl.abs(x), [128, num_warps, 128 // num_warps]), 2, gluon_tiles.nan_max)
    scale, inverses = gluon_tiles.token_scales(per_warp, FP8_MAX, POW2, PARTIALS)
    return scale, inverses.load(gl.SliceLayout(1, x.type.layout))


@gluon.jit
def _scales(amax_sliced, SPREAD: gl.constexpr, FP8_MAX: gl.constexpr, POW2: gl.constexpr):
    """(scale, multiplier in amax's own layout). With a SPREAD layout each thread divides for one row or column
    (two exchanges through shared memory); with None every thread divides for all the rows or columns it holds."""
    if SPREAD is None:
        scale, inv = gluon_tiles.tile_scale(amax_sliced, FP8_MAX, POW2)
    else:
        scale, inv = gluon_tiles.tile_scale(gl.convert_layout(amax_sliced, SPREAD), FP8_MAX, POW2)
        inv = gl.convert_layout(inv, amax_sliced.type.layout)
    return scale, inv


@gluon.jit
def _rows_cols_tile(x_ptr, rstd_ptr, w_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_xm, stride_qm,
                    stride_sm, stride_sk, stride_qt, stride_st_k, stride_st_m, FP8_MAX: gl.constexpr,
                    POW2: gl.constexpr, NORM: gl.constexpr, GATHER: gl.constexpr, LOAD: gl.constexpr,
                    STORE_T: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr, MASKED: gl.constexpr,
                    COL_BLOCKS: gl.constexpr, ROWS_FIRST: gl.constexpr):
    """Tile (kb, mb) of x (M, K): quantized along its rows (q, s) and along its columns (qt = x^T, st; rows past M
    as zeros; with COL_BLOCKS, x^T as one 128x128 block). With NORM, of RMSNorm(x): (x * rstd[row]) * w[col] in
    FP32, as the Triton kernel computes it. With GATHER, row i is x[idx[i]] (a zero row where idx[i] < 0): the MoE
    dispatch's gather into the expert layout. ROWS_FIRST: the grid's first axis walks the token blocks (`launch`)."""
    mb = gl.program_id(0 if ROWS_FIRST else 1)
    kb = gl.program_id(1 if ROWS_FIRST else 0)
    rows = mb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LOAD))
    cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LOAD))
    in_rows = rows < M
    if GATHER:
        src = gl.load(idx_ptr + rows, mask=in_rows, other=-1)
        x = gl.load(x_ptr + gl.expand_dims(src.to(gl.int64), 1) * stride_xm + gl.expand_dims(cols, 0),
                    mask=gl.expand_dims(src >= 0, 1), other=0.0).to(gl.float32)
    else:
        x = _load_rows(x_ptr + gl.expand_dims(rows, 1) * stride_xm + gl.expand_dims(cols, 0),
                       gl.expand_dims(in_rows, 1), MASKED).to(gl.float32)
    if NORM:
        rstd = _load_rows(rstd_ptr + rows, in_rows, MASKED)
        x = (x * gl.expand_dims(rstd, 1)) * gl.expand_dims(gl.load(w_ptr + cols).to(gl.float32), 0)
    _quantize_tile(x, rows, cols, kb, mb, M, q_ptr, s_ptr, qt_ptr, st_ptr, stride_qm, stride_sm, stride_sk, stride_qt,
                   stride_st_k, stride_st_m, FP8_MAX, POW2, STORE_T, ROWS, COLS, MASKED, COL_BLOCKS)


@gluon.jit
def _load_rows(ptrs, in_rows, MASKED: gl.constexpr):
    """ptrs' values; with MASKED (a partial last token block), zeros where not `in_rows` (nothing is read there).
    Unmasked loads save the predicates and the zeroing of their registers (RMSNorm's quantizer tiles: 14.8 -> 13.8
    SASS instructions per element)."""
    if MASKED:
        return gl.load(ptrs, mask=in_rows, other=0.0)
    return gl.load(ptrs)


@gluon.jit
def _quantize_tile(x, rows, cols, kb, mb, M, q_ptr, s_ptr, qt_ptr, st_ptr, stride_qm, stride_sm, stride_sk, stride_qt,
                   stride_st_k, stride_st_m, FP8_MAX: gl.constexpr, POW2: gl.constexpr, STORE_T: gl.constexpr,
                   ROWS: gl.constexpr, COLS: gl.constexpr, MASKED: gl.constexpr, COL_BLOCKS: gl.constexpr):
    """Tile (kb, mb), x (128 tokens `rows`, 128 features `cols`) in FP32, quantized along its rows (q, s) and along
    its columns (qt = x^T, st; rows past M, which x holds as zeros, fill qt's padding). Rows are stored below M
    only where MASKED (M not a multiple of 128; else every row is in range and the stores need no predicate).
    COL_BLOCKS: x^T as one 128x128 block, its one scale at st[kb, mb] (`quantize.quantize_rows_cols`)."""
    # Rows (`tiles.store_rows`): one scale per token over the tile's 128 features.
    if ROWS is None:  # each thread divides for all the rows it holds
        row_scale, row_inv = _scales(gl.reduce(gl.abs(x), 1, gluon_tiles.nan_max), None, FP8_MAX, POW2)
    else:
        row_scale, row_inv = _row_scales(x, FP8_MAX, POW2, ROWS)
    q = (x * gl.expand_dims(row_inv, 1)).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # saturating
    q_ptrs = q_ptr + gl.expand_dims(rows, 1) * stride_qm + gl.expand_dims(cols, 0)
    scale_rows = mb * 128 + gl.arange(0, 128, layout=row_scale.type.layout)
    s_ptrs = s_ptr + scale_rows * stride_sm + kb * stride_sk
    if MASKED:
        gl.store(q_ptrs, q, mask=gl.expand_dims(rows < M, 1))
        gl.store(s_ptrs, row_scale, mask=scale_rows < M)
    else:
        gl.store(q_ptrs, q)
        gl.store(s_ptrs, row_scale)
    # Columns (`tiles.store_cols`): one scale per feature over the tile's 128 tokens, x^T written from registers.
    col_amax = gl.reduce(gl.abs(x), 0, gluon_tiles.nan_max)
    if COL_BLOCKS:  # the block's max in every column: each computes the same scale, one stores it
        col_amax = gluon_tiles.nan_max(col_amax, gl.reduce(col_amax, 0, gluon_tiles.nan_max))
    col_scale, col_inv = _scales(col_amax, COLS, FP8_MAX, POW2)
    # Into the layout that lists each thread's tokens first while still FP32 (the same threads: a renaming of
    # registers), so that each conversion packs two consecutive tokens, as the transposed store wants them.
    qt = gl.convert_layout(x * gl.expand_dims(col_inv, 0), STORE_T)
    qt = qt.to(qt_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    t_rows = mb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, STORE_T))
    t_cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, STORE_T))
    gl.store(qt_ptr + gl.expand_dims(t_cols, 0) * stride_qt + gl.expand_dims(t_rows, 1), qt)
    scale_cols = kb * 128 + gl.arange(0, 128, layout=col_scale.type.layout)
    if COL_BLOCKS:
        gl.store(st_ptr + (scale_cols // 128) * stride_st_k + mb * stride_st_m, col_scale, mask=scale_cols % 128 == 0)
    else:
        gl.store(st_ptr + scale_cols * stride_st_k + mb * stride_st_m, col_scale)


# Two entry points around the same tile, so that a profile tells the RMSNorm producer's launches from the standalone
# quantizer's by the kernel's name (`benchmarks/kernel_breakdown.py` sorts them into those categories).
@gluon.jit
def _quantize_rows_cols_gluon_kernel(x_ptr, rstd_ptr, w_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_xm,
                                     stride_qm, stride_sm, stride_sk, stride_qt, stride_st_k, stride_st_m,
                                     FP8_MAX: gl.constexpr, POW2: gl.constexpr, NORM: gl.constexpr,
                                     GATHER: gl.constexpr, LOAD: gl.constexpr, STORE_T: gl.constexpr,
                                     ROWS: gl.constexpr, COLS: gl.constexpr, MASKED: gl.constexpr,
                                     COL_BLOCKS: gl.constexpr, ROWS_FIRST: gl.constexpr):
    _rows_cols_tile(x_ptr, rstd_ptr, w_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_xm, stride_qm, stride_sm,
                    stride_sk, stride_qt, stride_st_k, stride_st_m, FP8_MAX, POW2, NORM, GATHER, LOAD, STORE_T, ROWS,
                    COLS, MASKED, COL_BLOCKS, ROWS_FIRST)


@gluon.jit
def _rmsnorm_quantize_gluon_kernel(x_ptr, rstd_ptr, w_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_xm,
                                   stride_qm, stride_sm, stride_sk, stride_qt, stride_st_k, stride_st_m,
                                   FP8_MAX: gl.constexpr, POW2: gl.constexpr, NORM: gl.constexpr,
                                   GATHER: gl.constexpr, LOAD: gl.constexpr, STORE_T: gl.constexpr,
                                   ROWS: gl.constexpr, COLS: gl.constexpr, MASKED: gl.constexpr,
                                   COL_BLOCKS: gl.constexpr, ROWS_FIRST: gl.constexpr):
    _rows_cols_tile(x_ptr, rstd_ptr, w_ptr, idx_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M, stride_xm, stride_qm, stride_sm,
                    stride_sk, stride_qt, stride_st_k, stride_st_m, FP8_MAX, POW2, NORM, GATHER, LOAD, STORE_T, ROWS,
                    COLS, MASKED, COL_BLOCKS, ROWS_FIRST)


@gluon.jit
def _rope_backward_tile(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, rows, cols, kb, M, NQ, NK, seq_len, stride_dq,
                        stride_dk, stride_dv, stride_cos, stride_sin, HEAD_DIM: gl.constexpr,
                        MASKED: gl.constexpr):
    """Tile kb of [RoPE^T(dq) | RoPE^T(dk) | dv] at `rows` in FP32 (zeros past M): per head of d (`producers.
    rope_backward`), feature f of the first half d[f] cos[f] + d[f + h] sin[f + h], of the second half
    d[f] cos[f] - d[f - h] sin[f - h], h = HEAD_DIM / 2, at the row's position. Each element's partner (f XOR h)
    lies in the same tile (heads divide 128); it is read a second time, from L1 or L2, rather than fetched from
    another warp. A tile lies in one of the three (their widths are whole tiles)."""
    HALF: gl.constexpr = HEAD_DIM // 2
    # Rows past M (the last tile's padding, when M is not a multiple of 128: MASKED) read as zeros and read no
    # table either: a table exactly as long as its tokens ends there. Unmasked loads save the zeroing of their
    # registers and the predicates.
    in_rows = gl.expand_dims(rows < M, 1)
    first = kb * 128
    if first < NQ + NK:
        if first < NQ:
            row_ptrs = dq_ptr + gl.expand_dims(rows.to(gl.int64) * stride_dq, 1)
            local = cols
        else:
            row_ptrs = dk_ptr + gl.expand_dims(rows.to(gl.int64) * stride_dk, 1)
            local = cols - NQ
        # The partner f XOR h written as f + h - 2 h * (second half): the compiler then sees the runs of consecutive
        # features each thread holds in it, and reads them as 16-byte vectors (through an XOR it reads elements).
        second_half = (local // HALF) % 2
        to_partner = HALF - 2 * HALF * second_half
        partner = local + to_partner
        in_head = local % HEAD_DIM
        d = _load_rows(row_ptrs + gl.expand_dims(local, 0), in_rows, MASKED).to(gl.float32)
        d_partner = _load_rows(row_ptrs + gl.expand_dims(partner, 0), in_rows, MASKED).to(gl.float32)
        positions = gl.expand_dims(rows % seq_len, 1)
        c = _load_rows(cos_ptr + positions * stride_cos + gl.expand_dims(in_head, 0), in_rows, MASKED)
        s = _load_rows(sin_ptr + positions * stride_sin + gl.expand_dims(in_head + to_partner, 0), in_rows, MASKED)
        sign = (1 - 2 * second_half).to(gl.float32)  # exact: d[f] cos - d' sin is d[f] cos + d' (-sin)
        x = d * c + d_partner * (s * gl.expand_dims(sign, 0))
    else:
        x = _load_rows(dv_ptr + gl.expand_dims(rows.to(gl.int64) * stride_dv, 1) + gl.expand_dims(cols - NQ - NK, 0),
                       in_rows, MASKED).to(gl.float32)
    return x


@gluon.jit
def _rope_backward_quantize_gluon_kernel(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, M,
                                         NQ, NK, seq_len, stride_dq, stride_dk, stride_dv, stride_cos, stride_sin,
                                         stride_qm, stride_sm, stride_sk, stride_qt, stride_st_k, stride_st_m,
                                         HEAD_DIM: gl.constexpr, MASKED: gl.constexpr, FP8_MAX: gl.constexpr,
                                         POW2: gl.constexpr, LOAD: gl.constexpr, STORE_T: gl.constexpr,
                                         ROWS: gl.constexpr, COLS: gl.constexpr):
    """One 128x128 tile of [RoPE^T(dq) | RoPE^T(dk) | dv], quantized from FP32 both ways (`producers.
    _rope_backward_quantize_kernel`'s outputs)."""
    kb = gl.program_id(0)
    mb = gl.program_id(1)
    rows = mb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, LOAD))
    cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, LOAD))
    x = _rope_backward_tile(dq_ptr, dk_ptr, dv_ptr, cos_ptr, sin_ptr, rows, cols, kb, M, NQ, NK, seq_len, stride_dq,
                            stride_dk, stride_dv, stride_cos, stride_sin, HEAD_DIM, MASKED)
    # Its row stores keep their predicates on whole token blocks (as before `f3b4467`; without them, not timed).
    _quantize_tile(x, rows, cols, kb, mb, M, q_ptr, s_ptr, qt_ptr, st_ptr, stride_qm, stride_sm, stride_sk, stride_qt,
                   stride_st_k, stride_st_m, FP8_MAX, POW2, STORE_T, ROWS, COLS, True, False)


def kernel_for(norm: bool):
    """The entry point: RMSNorm's producer tiles (`norm`) or the quantizer of a tensor as it is (or gathered)."""
    return _rmsnorm_quantize_gluon_kernel if norm else _quantize_rows_cols_gluon_kernel


# Triton's JIT once per static signature, then the compiled kernels (`launch.FastLaunch`)
_LAUNCHES = MappingProxyType({norm: gluon_tiles.TokenCountLaunch(kernel_for(norm)) for norm in (False, True)})
_ROPE_LAUNCH = gluon_tiles.TokenCountLaunch(_rope_backward_quantize_gluon_kernel)


# Whether gathers walk the token blocks first (`launch(rows_first=...)`'s default with an index). A token's copies lie
# far apart in the expert layout; walking the features first re-reads the source from HBM once L2 is outgrown. Job GG
# (`rows_cols_variants.py`, H200): the MoE expert layout's gather 0.281 -> 0.236 ms, the dispatch's 0.137 -> 0.124 ms.
GATHER_ROWS_FIRST = True


def launch(x: torch.Tensor, rstd: torch.Tensor | None, weight: torch.Tensor | None, out: tuple, fmt: Fp8Format,
           power_of_two: bool, spread_rows: bool = True, spread_cols: bool = True,
           index: torch.Tensor | None = None, cols_in_blocks: bool = False, rows_first: bool | None = None) -> None:
    """Fill `out` (from `tiles.rows_cols_outputs`) from x (M, K), from RMSNorm(x) given its rstd (M,) and weight
    (K,), or from the rows x[index[i]] (M = len(index); a zero row where index[i] < 0).
    `spread_rows`/`spread_cols`: share the rows' or columns' divisions out over the threads. `cols_in_blocks`: x^T
    in 128x128 blocks (out from `tiles.rows_cols_outputs` with it).
    `rows_first` (None: `GATHER_ROWS_FIRST` for a gather, else False): the grid walks the token blocks first, one
    128-feature column at a time, instead of each token block's features first. The same bytes either way; it
    changes which tiles run at once. In the MoE dispatch every token is gathered into top_k rows far apart in the
    expert layout (sorted by expert), so walking a block's features first reads each token's row from HBM once
    per expert (the source, 64 MB at 16,384 x 2,048, outgrows L2 between the reads); walking the token blocks
    first keeps one 128-feature column of the source (4 MB) in L2 while all its copies are read."""
    m, k = (x.shape[0] if index is None else index.shape[0]), x.shape[1]
    q, s, qt, st = out
    load, store_t, rows, cols = tile_layouts()
    rows, cols = (rows if spread_rows else None), (cols if spread_cols else None)
    norm, gather = rstd is not None, index is not None
    # Scaled gathered rows (the MoE combine's gradient) are not RMSNorm's output: profiles count them as a quantizer.
    producer_tiles = norm and not gather
    # Unmasked loads and stores on whole token blocks: RMSNorm's tiles 12-14% faster, dy's 9-11% slower (the same
    # bits; job EN, docs/benchmarks.md), so only RMSNorm's drop the predicates.
    masked = m % 128 != 0 or not producer_tiles
    if rows_first is None:
        rows_first = gather and GATHER_ROWS_FIRST
    grid = (-(-m // 128), k // 128) if rows_first else (k // 128, -(-m // 128))
    _LAUNCHES[producer_tiles].launch(
        grid,
        (x, rstd if norm else x, weight if norm else x, index if gather else x, q, s, qt, st, m, x.stride(0),
         q.stride(0), s.stride(0), s.stride(1), qt.stride(0), st.stride(0), st.stride(1)),
        dict(FP8_MAX=fmt.max, POW2=power_of_two, NORM=norm, GATHER=gather, LOAD=load, STORE_T=store_t, ROWS=rows,
             COLS=cols, MASKED=masked, COL_BLOCKS=cols_in_blocks, ROWS_FIRST=rows_first, num_warps=WARPS))


def launch_rope_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         seq_len: int, head_dim: int, out: tuple, fmt: Fp8Format, power_of_two: bool,
                         tokens_each: int = TOKENS_PER_THREAD, num_warps: int = WARPS) -> None:
    """Fill `out` (from `tiles.rows_cols_outputs`) with [RoPE^T(dq) | RoPE^T(dk) | dv] quantized both ways: the
    bytes of `producers.rope_backward_quantize`'s Triton kernel (same arguments, checked by its caller). The row +
    column quantizer's layout (16 tokens x 8 features a thread, 4 warps) is the faster of the two measured: 8
    tokens at 8 warps needs fewer registers but more instructions (`benchmarks/rope_variants.py`)."""
    m, nq, nk = dq.shape[0], dq.shape[1], dk.shape[1]
    n = nq + nk + dv.shape[1]
    q, s, qt, st = out
    load, store_t, rows, cols = tile_layouts(tokens_each, num_warps)
    _ROPE_LAUNCH.launch(
        (n // 128, -(-m // 128)),
        (dq, dk, dv, cos, sin, q, s, qt, st, m, nq, nk, seq_len, dq.stride(0), dk.stride(0), dv.stride(0),
         cos.stride(0), sin.stride(0), q.stride(0), s.stride(0), s.stride(1), qt.stride(0), st.stride(0),
         st.stride(1)),
        dict(HEAD_DIM=head_dim, MASKED=m % 128 != 0, FP8_MAX=fmt.max, POW2=power_of_two, LOAD=load, STORE_T=store_t,
             ROWS=rows, COLS=cols, num_warps=num_warps))
