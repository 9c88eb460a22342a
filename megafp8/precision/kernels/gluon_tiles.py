"""Building blocks of the Gluon quantizing kernels (`swiglu_cols_gluon`), each op for op the
Triton kernels' (`megafp8.precision.kernels.tiles`), so that both give the same bits, and the register layouts
they share. Gluon, unlike Triton, lets a kernel choose which thread holds which element: these layouts put a
column's 128 tokens in the lanes of one warp (column maxima by shuffles, no barrier) and give each thread runs of
consecutive tokens to write transposed straight from its registers."""
from __future__ import annotations

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import DistributedLinearLayout  # a Gluon without it fails here, not later
from triton.language import PropagateNan

from megafp8.precision.formats import MIN_AMAX
from megafp8.precision.kernels.launch import FastLaunch

_MIN_AMAX = gl.constexpr(MIN_AMAX)
_NAN_PROPAGATES = gl.constexpr(PropagateNan.ALL)
TOKENS = gl.constexpr(128)  # a 1x128 tile along the tokens
# One token is never compiled in as a constant (Triton's JIT makes an integer argument equal to 1 one): with M = 1
# every padding row of a tile is a known zero, two consecutive tokens' products 0 * inv the same value, and ptxas
# 12.8 (Triton 3.6's) then packs such pairs (`F2FP...PACK_AB_MERGE_C`, both sources one register) with the upper
# half of a register nothing wrote: garbage bytes in x^T's padding, seen on an H200 (docs/benchmarks.md, thirty-first
# session). Other token counts keep Triton's specialization (divisibility by 16 lets the transposed stores use wide
# runs): `TokenCountLaunch` sends M = 1 to a twin of the kernel that takes M as a runtime value.
NOT_SPECIALIZED = ("M",)


class TokenCountLaunch:
    """`FastLaunch` of a kernel that converts its column tiles tokens first and takes the token count as its
    runtime argument `M`: M specialized as Triton's JIT does, except M = 1, launched through a twin of the kernel
    compiled with M a runtime value (`NOT_SPECIALIZED`). Same interface as `FastLaunch`."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.one_token_kernel = gluon.jit(do_not_specialize=NOT_SPECIALIZED)(kernel.fn)
        self._m_position = kernel.arg_names.index("M")
        self._launches = (FastLaunch(kernel), FastLaunch(self.one_token_kernel))

    def launch(self, grid: tuple, args: tuple, constexprs: dict) -> None:
        """`FastLaunch.launch`, through the twin where M (among `args`) is 1."""
        self._launches[args[self._m_position] == 1].launch(grid, args, constexprs)


@gluon.jit
def nan_max(a, b):
    """Elementwise max, nan if either is nan (tiles.max_propagating_nan): one `max.NaN` instruction."""
    return gl.maximum(a, b, propagate_nan=_NAN_PROPAGATES)


@gluon.jit
def tile_scale(amax, FP8_MAX: gl.constexpr, POW2: gl.constexpr):
    """(dequantization scale, quantization multiplier) per tile, as `tiles.tile_scale`."""
    zero = amax == 0
    amax = gl.where(zero, amax, nan_max(amax, _MIN_AMAX))
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
def store_cols(x, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX: gl.constexpr,
               POW2: gl.constexpr, STORE: gl.constexpr, SPREAD: gl.constexpr):
    """x (128 tokens, columns) FP32 quantized along the tokens (`tiles.store_cols`): values at qt[cols, rows],
    scales at st[cols, mb]. The FP8 tile moves to `STORE` (the same threads, tokens first in each thread's
    registers: no data leaves a thread) so that each thread writes its tokens of a column as one store."""
    amax = gl.reduce(gl.abs(x), 0, nan_max)  # the 16 token lanes of a column all hold its maximum
    store_cols_scaled(x, amax, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX, POW2, STORE,
                      SPREAD, False)


@gluon.jit
def store_block_cols(x, row_amax_ptr, stride_ab, M, block, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k,
                     stride_st_m, FP8_MAX: gl.constexpr, POW2: gl.constexpr, LOAD: gl.constexpr,
                     STORE: gl.constexpr, SPREAD: gl.constexpr):
    """x (128 tokens, columns of the 128-feature block `block`) FP32, stored transposed as part of its 128x128
    block of x^T (`quantize.quantize_rows_cols(cols_in_blocks=True)`). The block's max is the max over its 128
    tokens of their 1x128 tiles' maxima, `row_amax[token, block]` (M rows, stored tokens first: `stride_ab` apart
    from block to block; the producer wrote them when it quantized x along its features), so no column of x is
    reduced here. Its scale goes to st[block, mb], stored by the block's first column alone (the other programs
    of the block compute the same scale)."""
    tokens = mb * TOKENS + gl.arange(0, TOKENS, layout=gl.SliceLayout(1, LOAD))
    tile_maxima = gl.load(row_amax_ptr + block * stride_ab + tokens, mask=tokens < M, other=0.0)
    # The block's max in every column (`_quantize_tile`'s COL_BLOCKS form): each column divides for the same scale.
    amax = nan_max(gl.full(cols.shape, 0.0, gl.float32, cols.type.layout), gl.reduce(tile_maxima, 0, nan_max))
    store_cols_scaled(x, amax, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX, POW2, STORE,
                      SPREAD, True)


@gluon.jit
def store_cols_scaled(x, amax, cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, FP8_MAX: gl.constexpr,
                      POW2: gl.constexpr, STORE: gl.constexpr, SPREAD: gl.constexpr, BLOCK: gl.constexpr):
    """`store_cols` given each column's max `amax` (x's column layout); BLOCK: one scale per 128x128 block at
    st[col // 128, mb], stored where col % 128 == 0."""
    # SPREAD: each lane takes one of its warp's columns for the two correctly rounded divisions (~10 instructions
    # each) instead of every lane dividing for all the columns it holds; the multipliers return to the lanes that
    # hold each column through a few hundred bytes of shared memory (a barrier per result: 0.358 against 0.415 ms
    # without sharing, `docs/benchmarks.md` job AE).
    scale, inv = tile_scale(gl.convert_layout(amax, SPREAD), FP8_MAX, POW2)
    inv = gl.convert_layout(inv, amax.type.layout)
    scale_cols = gl.convert_layout(cols, SPREAD)
    # No clamp: the conversion saturates (`cvt.rn.satfinite`: finite values past FP8_MAX and infinities give
    # +-FP8_MAX, nan stays nan), which is what tiles.to_fp8's clamp-then-convert gives, in 2 fewer instructions.
    q = gl.convert_layout(x * gl.expand_dims(inv, 0), STORE)
    q = q.to(qt_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    rows = mb * TOKENS + gl.arange(0, TOKENS, layout=gl.SliceLayout(1, STORE))
    qt_rows = gl.convert_layout(cols, gl.SliceLayout(0, STORE))  # x's columns are x^T's rows
    gl.store(qt_ptr + gl.expand_dims(qt_rows, 0) * stride_qt + gl.expand_dims(rows, 1), q)
    if BLOCK:
        gl.store(st_ptr + (scale_cols // TOKENS) * stride_st_k + mb * stride_st_m, scale,
                 mask=scale_cols % TOKENS == 0)
    else:
        gl.store(st_ptr + scale_cols * stride_st_k + mb * stride_st_m, scale)


@gluon.jit
def token_scales(per_warp, FP8_MAX: gl.constexpr, POW2: gl.constexpr, PARTIALS: gl.constexpr):
    """(scale, inverses) of 128 tokens' 1x128 tiles from each warp's partial maxima `per_warp` (128 tokens,
    num_warps): the partials cross the warps through shared memory laid out tokens first, one thread a token
    (`PARTIALS`, `token_partials_layout`) takes their max and divides (the scale in PARTIALS' token layout), and
    the multipliers go back to shared memory (`inverses`, 128 FP32, for any layout to read). Each access is
    conflict-free where a thread's partials are consecutive tokens (Triton's own cross-warp reduction wrote them
    16 bytes apart: 6-way bank conflicts, half the row + column quantizer's L1 wavefronts; docs/benchmarks.md job
    FB)."""
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1])
    partials = gl.allocate_shared_memory(gl.float32, per_warp.shape, plain, per_warp)
    gl.thread_barrier()
    amax = gl.reduce(partials.load(PARTIALS), 1, nan_max)  # one token a thread
    scale, inv = tile_scale(amax, FP8_MAX, POW2)
    inverses = gl.allocate_shared_memory(gl.float32, [TOKENS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]), inv)
    gl.thread_barrier()
    return scale, inverses


@functools.cache
def token_partials_layout(num_warps: int = 4) -> DistributedLinearLayout:
    """(128 tokens, num_warps) values, thread t of the first 128 holding token t's value from every warp (in its
    registers): how `token_scales` reads the warps' partial maxima."""
    registers = bases(num_warps, 1, 2, 1)
    warps = [[32 << i, 0] if i < 2 else [0, 0] for i in range(num_warps.bit_length() - 1)]
    return DistributedLinearLayout(reg_bases=registers, lane_bases=bases(32, 1, 2), warp_bases=warps,
                                   block_bases=[], shape=[128, num_warps])


@functools.cache  # made on every launch otherwise: the same few layouts, immutable
def spread_layout(features_per_warp: int, num_warps: int) -> DistributedLinearLayout:
    """The layout of a block's per-column values in which lane l of warp w holds column
    features_per_warp * w + l % features_per_warp: the lanes of a warp share out its columns instead of each
    holding all of them (lanes past features_per_warp repeat the first ones)."""
    lanes = bases(features_per_warp, 1, 1)
    return DistributedLinearLayout(reg_bases=[], lane_bases=lanes + [[0]] * (5 - len(lanes)),
                                      warp_bases=bases(num_warps, features_per_warp, 1), block_bases=[],
                                      shape=[features_per_warp * num_warps])


def bases(count: int, step: int, rank: int, dim: int = 0) -> list:
    """log2(count) linear-layout bases stepping by step, 2 step, 4 step ... along `dim` of a rank-`rank` shape."""
    return [[step << i if d == dim else 0 for d in range(rank)] for i in range(count.bit_length() - 1)]


@functools.cache
def block_layouts(tokens_each: int, features_each: int, num_warps: int) -> tuple:
    """(BLOCK_N, LOAD, STORE) for 128 tokens x BLOCK_N features: each thread holds tokens_each x features_each, a
    warp's lanes cover the 128 tokens (128 / tokens_each lanes) and as many feature groups as remain, the warps sit
    side by side along the features. LOAD lists a thread's registers features first, STORE tokens first: the same
    elements in the same threads (converting between them moves no data)."""
    token_lanes = 128 // tokens_each
    assert token_lanes <= 32 and 32 % token_lanes == 0, f"{tokens_each} tokens a thread cannot cover 128 in a warp"
    feature_lanes = 32 // token_lanes
    block_n = features_each * feature_lanes * num_warps
    features, tokens = bases(features_each, 1, 2, 1), bases(tokens_each, 1, 2, 0)
    lanes = bases(feature_lanes, features_each, 2, 1) + bases(token_lanes, tokens_each, 2, 0)
    warps = bases(num_warps, features_each * feature_lanes, 2, 1)

    def layout(registers: list) -> DistributedLinearLayout:
        return DistributedLinearLayout(reg_bases=registers, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                          shape=[128, block_n])
    return block_n, layout(features + tokens), layout(tokens + features)
