"""SwiGLU backward's column outputs in Gluon: d(gu)^T and SwiGLU's output a^T, quantized along the tokens. On SM90
`producers.swiglu_backward_quantize` runs this kernel instead of the Triton column kernel
(`producers._swiglu_backward_cols_kernel`, kept for other GPUs and as the reference it is checked against): the same
bytes (`tests/test_fp8_gpu.py`, `benchmarks/swiglu_cols_variants.py`) in 0.343 against 0.449 ms at the ~1B shape
(`docs/benchmarks.md`, eleventh session), and since its blocks arrive by TMA (`_swiglu_backward_cols_tma_kernel`,
where M is a multiple of 8: every training step) in 0.232 ms (job FF; 0.589 against the Triton kernel's 1.136 at
the 8B-layer shape, ~3.6 TB/s moved).

Why it is faster: the Triton column kernel was bound by the instructions it issued, and Gluon lets us choose the
layout that needs fewest (once they were few, the L1 wavefronts of the threads' loads bound it: hence TMA). Each
thread holds 8 consecutive tokens x 4 consecutive features, 16 lanes of a warp cover the 128 tokens and 2 lanes its
8 features, and the warps sit side by side along the features (`block_layouts`). A column's max is taken within
the thread and over 4 shuffle rounds, with no barrier; each thread writes its 8 tokens of a column as 8 consecutive
FP8 bytes of the transposed output, straight from its registers. More savings (47 instructions per element remain
at 4 warps, 46 reading by TMA, against 143 in the Triton kernel;
`tests/test_ws_gemm_compiles.py` bounds it):
- nan-propagating maxima are one `max.NaN` instruction;
- no clamp before the FP8 conversion, which saturates by itself (`cvt.rn.satfinite`);
- the two correctly rounded divisions per column are shared out over the warp's lanes (`spread_layout`), one
  column each, instead of every lane dividing for all its warp's columns;
- exp(-gate) as one multiply and `ex2.approx.ftz` (`exp_neg`: 2 instructions for 6, the same values wherever
  they can change the sigmoid);
- the column tiles converted to FP8 after moving into the tokens-first layout (`gluon_tiles.store_cols`), so
  each paired conversion packs two consecutive tokens (54 -> 47 per element; the column kernel 15% faster:
  docs/benchmarks.md, thirty-first session).

`swiglu_backward_rows_cols` launches the Triton row kernel's work beside the TMA column kernel's in one grid
(`_swiglu_backward_rows_cols_kernel`): each program does one kernel's work for one 128-token block, the row and
column programs of the same 128 features numbered side by side, so that whichever reads a block's gu and da second
finds them in L2 (17 bytes moved a (token, feature) from HBM by the two kernels, ~11 by one launch, if the L2 holds).
On by default (`ROWS_COLS_ONE_LAUNCH`): on an H100 the same bytes (`tests/test_gluon_kernels_gpu.py`) in 0.668
against 0.784 ms at the MoE experts' shape, 1.167 against 1.359 at the 8B-layer's; the MoE step's FP8 tokens/s
+0.7-1.0% (jobs IZ-JA, `docs/benchmarks.md`).

Numerics are the Triton kernels' (`megafp8.precision.kernels.tiles`, `producers`), op for op, so the two give the
same bits.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import DistributedLinearLayout
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from megafp8.precision.formats import Fp8Format
from megafp8.precision.kernels import gluon_tiles
from megafp8.precision.kernels.launch import Descriptor, FastLaunch

_SLAB = 8  # tokens side by side in a view row of `_slab_view`
SLAB_TOKENS = gl.constexpr(_SLAB)
TOKENS_PER_THREAD = 8  # 16 lanes along the tokens: 4 shuffle rounds per column max, 8-byte column runs
FEATURES_PER_THREAD = 4  # x 2 lanes: a warp's 8 features are a 16-byte row segment


@gluon.jit
def _swiglu_backward_cols_kernel(gu_ptr, da_ptr, qt_ptr, st_ptr, at_ptr, ats_ptr, amax_ptr, M, F, stride_gm,
                                 stride_dm, stride_qt, stride_st_k, stride_st_m, stride_at, stride_ats_k,
                                 stride_ats_m, stride_ab, GRAD_MAX: gl.constexpr, FP8_MAX: gl.constexpr,
                                 POW2: gl.constexpr, A_BLOCKS: gl.constexpr, BLOCK_N: gl.constexpr,
                                 LOAD: gl.constexpr, STORE: gl.constexpr, SPREAD: gl.constexpr):
    """d(gu)^T and a^T for 128 tokens x BLOCK_N features; rows past M read as zeros (the transposes' padding), as
    in the Triton column kernel. LOAD and STORE (`block_layouts`) put the same elements in the same threads, each
    thread's features first (row-segment reads) or its tokens first (column-run writes). A_BLOCKS: a^T in 128x128
    blocks, each block's max from the forward's tile maxima amax (M, F/128), stored tokens first
    (`gluon_tiles.store_block_cols`)."""
    load: gl.constexpr = LOAD
    store: gl.constexpr = STORE
    block_n: gl.constexpr = BLOCK_N
    mb = gl.program_id(1)
    c = gl.program_id(0) * block_n
    rows = mb * gluon_tiles.TOKENS + gl.arange(0, gluon_tiles.TOKENS, layout=gl.SliceLayout(1, load))
    cols = c + gl.arange(0, block_n, layout=gl.SliceLayout(0, load))
    in_rows = gl.expand_dims(rows < M, 1)
    gate_ptrs = gu_ptr + gl.expand_dims(rows, 1) * stride_gm + gl.expand_dims(cols, 0)
    gate = gl.load(gate_ptrs, mask=in_rows, other=0.0).to(gl.float32)
    up = gl.load(gate_ptrs + F, mask=in_rows, other=0.0).to(gl.float32)
    s = 1.0 / (1.0 + exp_neg(gate))
    _store_a(gate, up, s, c, cols, mb, M, at_ptr, ats_ptr, amax_ptr, stride_at, stride_ats_k, stride_ats_m,
             stride_ab, FP8_MAX, POW2, A_BLOCKS, load, store, SPREAD)
    da = gl.load(da_ptr + gl.expand_dims(rows, 1) * stride_dm + gl.expand_dims(cols, 0), mask=in_rows, other=0.0)
    _store_grads(da, gate, up, s, cols, mb, F, qt_ptr, st_ptr, stride_qt, stride_st_k, stride_st_m, GRAD_MAX, POW2,
                 store, SPREAD)


@gluon.jit
def _store_a(gate, up, s, c, cols, mb, M, at_ptr, ats_ptr, amax_ptr, stride_at, stride_ats_k, stride_ats_m,
             stride_ab, FP8_MAX: gl.constexpr, POW2: gl.constexpr, A_BLOCKS: gl.constexpr, LOAD: gl.constexpr,
             STORE: gl.constexpr, SPREAD: gl.constexpr):
    """a^T = (silu(gate) * up)^T of the block whose first feature is c (s: the gate's sigmoid), in tiles or in
    128x128 blocks."""
    if A_BLOCKS:
        block = c // gluon_tiles.TOKENS  # the 128 features this program's lie in
        gluon_tiles.store_block_cols(gate * s * up, amax_ptr, stride_ab, M, block, cols, mb, at_ptr, stride_at,
                                     ats_ptr, stride_ats_k, stride_ats_m, FP8_MAX, POW2, LOAD, STORE, SPREAD)
    else:
        gluon_tiles.store_cols(gate * s * up, cols, mb, at_ptr, stride_at, ats_ptr, stride_ats_k, stride_ats_m,
                               FP8_MAX, POW2, STORE, SPREAD)


@gluon.jit
def _store_grads(da, gate, up, s, cols, mb, F, qt_ptr, st_ptr, stride_qt, stride_st_k, stride_st_m,
                 GRAD_MAX: gl.constexpr, POW2: gl.constexpr, STORE: gl.constexpr, SPREAD: gl.constexpr):
    """d(gate)^T and d(up)^T of the block from a's gradient da, quantized along the tokens."""
    da_s = da.to(gl.float32) * s
    gluon_tiles.store_cols(da_s * up * (1.0 + gate * (1.0 - s)), cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k,
                           stride_st_m, GRAD_MAX, POW2, STORE, SPREAD)
    gluon_tiles.store_cols(da_s * gate, cols + F, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, GRAD_MAX,
                           POW2, STORE, SPREAD)


@gluon.jit
def _swiglu_backward_cols_tma_kernel(gu_desc, da_desc, qt_ptr, st_ptr, at_ptr, ats_ptr, amax_ptr, M, F, stride_gm,
                                     stride_dm, stride_qt, stride_st_k, stride_st_m, stride_at, stride_ats_k,
                                     stride_ats_m, stride_ab, GRAD_MAX: gl.constexpr, FP8_MAX: gl.constexpr,
                                     POW2: gl.constexpr, A_BLOCKS: gl.constexpr, BLOCK_N: gl.constexpr,
                                     LOAD: gl.constexpr, STORE: gl.constexpr, SPREAD: gl.constexpr,
                                     SLABS: gl.constexpr):
    """`_swiglu_backward_cols_kernel`'s outputs, its blocks of gate, up and da brought into shared memory by TMA
    instead of loaded by the threads (M a multiple of 8). Why: the pointer kernel is bound by the L1 wavefronts of
    its 16-byte row reads (each 32-byte sector looked up twice, by the two warps that share it: Nsight Compute,
    docs/benchmarks.md job FB); TMA moves whole lines without the LSU, and the threads read shared memory (job FF:
    0.589 against 0.741 ms at the 8B-layer shape, L1/TEX 33% busy against 74%, the same bytes).

    How the reads avoid bank conflicts in the column layout, where the 16 token lanes of a warp read the same 16
    bytes of rows 8 apart (in one plain or swizzled tile they all fall in one bank group): the descriptors view
    each tensor as (8, M/8) rows (`_slab_view`), [r, j] being token 8 j + r, so that one 3-D box a tensor holds
    tokens r, r + 8, ..., r + 120 of the block in slab r (the view's strides are not in decreasing order; TMA
    takes them: job FF; eight 2-D boxes a tensor cost 24 copies with a barrier after each, 5% slower). The lanes'
    rows then differ by one within a slab, and the 64-byte swizzle spreads each half warp's 16-byte reads over
    all 32 banks (0.6 M conflicts in 32 M shared wavefronts, job FF).
    `SLABS` reads the slabs into the column layout, which `_in_token_order` renames to the tokens' order (the same
    registers)."""
    _cols_tma_block(gu_desc, da_desc, gl.program_id(1), gl.program_id(0) * BLOCK_N, qt_ptr, st_ptr, at_ptr, ats_ptr,
                    amax_ptr, M, F, stride_qt, stride_st_k, stride_st_m, stride_at, stride_ats_k, stride_ats_m,
                    stride_ab, GRAD_MAX, FP8_MAX, POW2, A_BLOCKS, BLOCK_N, LOAD, STORE, SPREAD, SLABS)


@gluon.jit
def _cols_tma_block(gu_desc, da_desc, mb, c, qt_ptr, st_ptr, at_ptr, ats_ptr, amax_ptr, M, F, stride_qt, stride_st_k,
                    stride_st_m, stride_at, stride_ats_k, stride_ats_m, stride_ab, GRAD_MAX: gl.constexpr,
                    FP8_MAX: gl.constexpr, POW2: gl.constexpr, A_BLOCKS: gl.constexpr, BLOCK_N: gl.constexpr,
                    LOAD: gl.constexpr, STORE: gl.constexpr, SPREAD: gl.constexpr, SLABS: gl.constexpr):
    """The TMA column kernel's work for token block mb and the BLOCK_N features from c (`_swiglu_backward_cols_tma_
    kernel`, and the column programs of `_swiglu_backward_rows_cols_kernel`)."""
    ROWS: gl.constexpr = gluon_tiles.TOKENS // SLAB_TOKENS  # view rows a slab: tokens 8 apart
    shape: gl.constexpr = [SLAB_TOKENS, ROWS, BLOCK_N]  # one box a tensor: 8 slabs of 16 view rows
    gate_s = gl.allocate_shared_memory(gu_desc.dtype, shape, gu_desc.layout)
    up_s = gl.allocate_shared_memory(gu_desc.dtype, shape, gu_desc.layout)
    da_s = gl.allocate_shared_memory(da_desc.dtype, shape, da_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    fence_async_shared()
    j = mb * ROWS
    BYTES: gl.constexpr = 2 * gluon_tiles.TOKENS * BLOCK_N  # a tensor's block, BF16
    mbarrier.expect(bars.index(0), 2 * BYTES)
    mbarrier.expect(bars.index(1), BYTES)
    tma.async_copy_global_to_shared(gu_desc, [0, j, c], bars.index(0), gate_s)
    tma.async_copy_global_to_shared(gu_desc, [0, j, F + c], bars.index(0), up_s)
    tma.async_copy_global_to_shared(da_desc, [0, j, c], bars.index(1), da_s)
    gate_s = gate_s.reshape([gluon_tiles.TOKENS, BLOCK_N])
    up_s = up_s.reshape([gluon_tiles.TOKENS, BLOCK_N])
    da_s = da_s.reshape([gluon_tiles.TOKENS, BLOCK_N])
    cols = c + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD))
    mbarrier.wait(bars.index(0), 0)
    gate = _in_token_order(gate_s.load(SLABS), LOAD).to(gl.float32)
    up = _in_token_order(up_s.load(SLABS), LOAD).to(gl.float32)
    s = 1.0 / (1.0 + exp_neg(gate))
    _store_a(gate, up, s, c, cols, mb, M, at_ptr, ats_ptr, amax_ptr, stride_at, stride_ats_k, stride_ats_m,
             stride_ab, FP8_MAX, POW2, A_BLOCKS, LOAD, STORE, SPREAD)
    mbarrier.wait(bars.index(1), 0)
    da = _in_token_order(da_s.load(SLABS), LOAD)
    _store_grads(da, gate, up, s, cols, mb, F, qt_ptr, st_ptr, stride_qt, stride_st_k, stride_st_m, GRAD_MAX, POW2,
                 STORE, SPREAD)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))


@gluon.jit
def _swiglu_backward_rows_cols_kernel(gu_desc, da_desc, gu_ptr, da_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, at_ptr, ats_ptr,
                                      amax_ptr, M, F, stride_gm, stride_dm, stride_qm, stride_sm, stride_sk,
                                      stride_qt, stride_st_k, stride_st_m, stride_at, stride_ats_k, stride_ats_m,
                                      stride_ab, GRAD_MAX: gl.constexpr, FP8_MAX: gl.constexpr, POW2: gl.constexpr,
                                      A_BLOCKS: gl.constexpr, BLOCK_N: gl.constexpr, LOAD: gl.constexpr,
                                      STORE: gl.constexpr, SPREAD: gl.constexpr, SLABS: gl.constexpr,
                                      ROWS: gl.constexpr, ROW_M: gl.constexpr):
    """SwiGLU backward's row and column outputs in one launch, each program doing one kernel's work: for each
    128-token block and 128 features of it (a unit), 128 / BLOCK_N column programs (`_cols_tma_block`) and
    128 / ROW_M row programs (`_rows_block`: d(gate) and d(up) of ROW_M tokens, quantized along the features, as
    the Triton row kernel stores them), numbered next to each other. Why: the two kernels each read gu and da
    from HBM (17 bytes moved a (token, feature), job FH); here a unit's programs start together and the second
    reader of its 96 KB finds them in L2, so HBM moves ~11, while each program stays as lean as its own kernel's
    (FH's single kernel holding a whole 128x128 tile ran at 1.2 TB/s: too few programs an SM to hide anything)."""
    COL_PROGRAMS: gl.constexpr = gluon_tiles.TOKENS // BLOCK_N
    UNIT: gl.constexpr = COL_PROGRAMS + gluon_tiles.TOKENS // ROW_M
    pid = gl.program_id(0)
    units = F // gluon_tiles.TOKENS  # units a token block
    mb = pid // (UNIT * units)
    g = (pid // UNIT) % units
    role = pid % UNIT
    if role < COL_PROGRAMS:
        _cols_tma_block(gu_desc, da_desc, mb, g * gluon_tiles.TOKENS + role * BLOCK_N, qt_ptr, st_ptr, at_ptr,
                        ats_ptr, amax_ptr, M, F, stride_qt, stride_st_k, stride_st_m, stride_at, stride_ats_k,
                        stride_ats_m, stride_ab, GRAD_MAX, FP8_MAX, POW2, A_BLOCKS, BLOCK_N, LOAD, STORE, SPREAD,
                        SLABS)
    else:
        first = mb * gluon_tiles.TOKENS + (role - COL_PROGRAMS) * ROW_M
        _rows_block(gu_ptr, da_ptr, q_ptr, s_ptr, first, g, M, F, stride_gm, stride_dm, stride_qm, stride_sm,
                    stride_sk, GRAD_MAX, POW2, ROWS, ROW_M)


@gluon.jit
def _rows_block(gu_ptr, da_ptr, q_ptr, s_ptr, first, g, M, F, stride_gm, stride_dm, stride_qm, stride_sm, stride_sk,
                GRAD_MAX: gl.constexpr, POW2: gl.constexpr, ROWS: gl.constexpr, ROW_M: gl.constexpr):
    """d(gate) and d(up) of tokens first .. first + ROW_M and features 128 g .. 128 g + 128, quantized along the
    features into q (M, 2F) and their scales into s[token, g] and s[token, g + F/128]: the Triton row kernel's
    bytes (`producers._swiglu_backward_rows_kernel`), op for op as the column programs compute the same values."""
    rows = first + gl.arange(0, ROW_M, layout=gl.SliceLayout(1, ROWS))
    cols = g * gluon_tiles.TOKENS + gl.arange(0, gluon_tiles.TOKENS, layout=gl.SliceLayout(0, ROWS))
    r, k = gl.expand_dims(rows, 1), gl.expand_dims(cols, 0)
    in_rows = (r < M) & (k >= 0)  # the tile's shape
    gate_ptrs = gu_ptr + r * stride_gm + k
    gate = gl.load(gate_ptrs, mask=in_rows, other=0.0).to(gl.float32)
    up = gl.load(gate_ptrs + F, mask=in_rows, other=0.0).to(gl.float32)
    da = gl.load(da_ptr + r * stride_dm + k, mask=in_rows, other=0.0)
    s = 1.0 / (1.0 + exp_neg(gate))
    da_s = da.to(gl.float32) * s
    _store_row_tiles(da_s * up * (1.0 + gate * (1.0 - s)), rows, cols, in_rows, g, q_ptr, stride_qm, s_ptr,
                     stride_sm, stride_sk, GRAD_MAX, POW2, M)
    _store_row_tiles(da_s * gate, rows, cols + F, in_rows, g + F // gluon_tiles.TOKENS, q_ptr, stride_qm, s_ptr,
                     stride_sm, stride_sk, GRAD_MAX, POW2, M)


@gluon.jit
def _store_row_tiles(x, rows, cols, in_rows, kb, q_ptr, stride_qm, s_ptr, stride_sm, stride_sk, FP8_MAX: gl.constexpr,
                     POW2: gl.constexpr, M):
    """x (rows, 128 features) FP32 quantized along the features (`tiles.store_rows`): values at q[rows, cols],
    scales at s[rows, kb], the rows below M."""
    amax = gl.reduce(gl.abs(x), 1, gluon_tiles.nan_max)
    scale, inv = gluon_tiles.tile_scale(amax, FP8_MAX, POW2)
    q = (x * gl.expand_dims(inv, 1)).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    gl.store(q_ptr + gl.expand_dims(rows, 1) * stride_qm + gl.expand_dims(cols, 0), q, mask=in_rows)
    gl.store(s_ptr + rows * stride_sm + kb * stride_sk, scale, mask=rows < M)


@gluon.jit
def _in_token_order(x, LOAD: gl.constexpr):
    """A block read from the slabs (row 16 r + j holds token 8 j + r) indexed by token: the same registers (the
    conversion is asserted trivial), renamed."""
    n: gl.constexpr = x.shape[1]
    slabs = gl.reshape(x, [SLAB_TOKENS, gluon_tiles.TOKENS // SLAB_TOKENS, n])
    by_token = gl.reshape(gl.permute(slabs, [1, 0, 2]), [gluon_tiles.TOKENS, n])
    return gl.convert_layout(by_token, LOAD, assert_trivial=True)


@gluon.jit
def exp_neg(x):
    """exp(-x) as Triton's `exp(-x)` computes it, in 2 instructions instead of 6: -x * log2(e) as one multiply (Triton
    negates as 0 - x, then multiplies: the same product), and `ex2.approx.ftz`, whose result differs from the
    non-flushing `ex2.approx` only where it is below 2^-126, where 1 + exp(-x) rounds to 1 either way."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * -1.4426950408889634], dtype=gl.float32,
                                     is_pure=True, pack=1)


# Triton's JIT once per static signature, then the compiled kernel; one token through a twin (`TokenCountLaunch`)
_LAUNCH = gluon_tiles.TokenCountLaunch(_swiglu_backward_cols_kernel)
# The TMA kernel needs M a multiple of 8 (`_slab_view`): M is never 1 there, so no twin.
_TMA_LAUNCH = FastLaunch(_swiglu_backward_cols_tma_kernel)
_ROWS_COLS_LAUNCH = FastLaunch(_swiglu_backward_rows_cols_kernel)


def _slab_position(token: int) -> int:
    """Where token t of a 128-token block lies in the slabs: slab t % 8, view row t // 8 of it."""
    return 16 * (token % _SLAB) + token // _SLAB


@functools.cache
def slab_layout(load: DistributedLinearLayout) -> DistributedLinearLayout:
    """`load` (a [128, BLOCK_N] column layout) over the slabs: each thread reads the elements it holds in `load`
    (the token bases moved to their slab rows; every basis is one token bit, so the map stays linear)."""
    def moved(bases: list) -> list:
        return [[_slab_position(t), f] for t, f in bases]
    return DistributedLinearLayout(reg_bases=moved(load.reg_bases), lane_bases=moved(load.lane_bases),
                                   warp_bases=moved(load.warp_bases), block_bases=[], shape=list(load.shape))


@functools.cache
def slab_shared_layout(block_n: int) -> gl.NVMMASharedLayout:
    """The slabs' shared layout (8 slabs, 16 rows, block_n): rows of block_n BF16, swizzled over 64 bytes (what
    spreads a half warp's reads of 16 consecutive slab rows over the 32 banks)."""
    assert 2 * block_n == 64, f"the slab swizzle is made for 64-byte rows, not {block_n} BF16"
    return gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=3)


def _slab_view(t: torch.Tensor, width: int) -> torch.Tensor:
    """t (M, >= width), rows `stride` apart, viewed as (8, M/8, width): [r, j] is row 8j + r (strides not in
    decreasing order). The same storage, ending at t's last element."""
    stride = t.stride(0)
    return t.as_strided((_SLAB, t.shape[0] // _SLAB, width), (stride, _SLAB * stride, 1))


def tma_fits(gu: torch.Tensor, da: torch.Tensor) -> bool:
    """Whether the TMA kernel can read gu and da: both BF16 (the slabs' 64-byte rows hold 32 of them; a da in FP32,
    from a dgrad written in FP32, takes the threads' loads), a whole, nonzero number of slab rows (M % 8 == 0),
    contiguous rows whose strides and starts TMA can address (16-byte multiples)."""
    bf16 = gu.dtype == da.dtype == torch.bfloat16
    aligned = all(t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in (gu, da))
    return bf16 and da.shape[0] > 0 and da.shape[0] % _SLAB == 0 and aligned


# True: `producers.swiglu_backward_quantize` runs the rows and columns in one launch wherever TMA can read gu and
# da (`swiglu_backward_rows_cols`; jobs IZ-JA: the same bytes, 15% less time at the MoE experts' shape, the MoE step
# +0.7-1.0%). False: the Triton row kernel then the column kernel, as before (kept to time one against the other).
ROWS_COLS_ONE_LAUNCH = True
ROW_M = 32  # tokens a row program: 4 warps of 2 tokens x 16 lanes of 8 features, four times


@functools.cache
def row_layout(num_warps: int) -> gl.BlockedLayout:
    """The row programs' layout: each thread 8 consecutive features (one 16-byte load of BF16), 16 lanes a token's
    128, the warps one above the other."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16], warps_per_cta=[num_warps, 1],
                            order=[1, 0])


def swiglu_backward_rows_cols(gu: torch.Tensor, da: torch.Tensor, q: torch.Tensor, s: torch.Tensor, qt: torch.Tensor,
                              st: torch.Tensor, at: torch.Tensor, ats: torch.Tensor, fmt: Fp8Format,
                              grad_fmt: Fp8Format, power_of_two: bool, a_amax: Optional[torch.Tensor] = None,
                              num_warps: int = 4) -> None:
    """`producers.swiglu_backward_rows` and `swiglu_backward_cols` in one launch (`_swiglu_backward_rows_cols_kernel`):
    q/s (d(gu) along the features), qt/st and at/ats as those two write them, from gu (M, 2F) and da (M, F) that
    the TMA column kernel can read (`tma_fits`) and F a multiple of 128."""
    m, f = da.shape
    block_n, load, store = gluon_tiles.block_layouts(TOKENS_PER_THREAD, FEATURES_PER_THREAD, num_warps)
    assert 2 * block_n == 64 and tma_fits(gu, da), "the rows and columns in one launch read gu and da by TMA"
    assert f % 128 == 0, f"F={f} must be a multiple of 128"
    blocks = a_amax is not None
    amax = a_amax if blocks else ats  # an unused pointer without blocks
    programs = f // 128 * (128 // block_n + 128 // ROW_M)  # a 128-token block's
    args = _slab_descriptors(gu, da, block_n) + (
        gu, da, q, s, qt, st, at, ats, amax, m, f, gu.stride(0), da.stride(0), q.stride(0), s.stride(0), s.stride(1),
        qt.stride(0), st.stride(0), st.stride(1), at.stride(0), ats.stride(0), ats.stride(1), amax.stride(1))
    constexprs = dict(_column_constexprs(fmt, grad_fmt, power_of_two, blocks, block_n, load, store, num_warps),
                      SLABS=slab_layout(load), ROWS=row_layout(num_warps), ROW_M=ROW_M)
    _ROWS_COLS_LAUNCH.launch((-(-m // 128) * programs,), args, constexprs)


def _slab_descriptors(gu: torch.Tensor, da: torch.Tensor, block_n: int) -> tuple[Descriptor, Descriptor]:
    """The TMA descriptors through which the kernels read gu (M, 2F) and da (M, F): each as 8 slabs (`_slab_view`)
    in boxes of 16 rows of `block_n` features, a 128-token block a box."""
    f = da.shape[1]
    shared, box = slab_shared_layout(block_n), (_SLAB, 128 // _SLAB, block_n)
    return Descriptor(_slab_view(gu, 2 * f), box, shared), Descriptor(_slab_view(da, f), box, shared)


def _column_constexprs(fmt: Fp8Format, grad_fmt: Fp8Format, power_of_two: bool, blocks: bool, block_n: int, load,
                       store, num_warps: int) -> dict:
    """The constexprs (and `num_warps`) that every form of the column kernel takes."""
    return dict(GRAD_MAX=grad_fmt.max, FP8_MAX=fmt.max, POW2=power_of_two, A_BLOCKS=blocks, BLOCK_N=block_n,
                LOAD=load, STORE=store, SPREAD=gluon_tiles.spread_layout(block_n // num_warps, num_warps),
                num_warps=num_warps)


def swiglu_backward_cols(gu: torch.Tensor, da: torch.Tensor, qt: torch.Tensor, st: torch.Tensor, at: torch.Tensor,
                         ats: torch.Tensor, fmt: Fp8Format, grad_fmt: Fp8Format, power_of_two: bool,
                         num_warps: int = 4, tokens_each: int = TOKENS_PER_THREAD,
                         features_each: int = FEATURES_PER_THREAD, a_amax: Optional[torch.Tensor] = None,
                         use_tma: Optional[bool] = None) -> None:
    """Fill qt/st (d(gu)^T (2F, M_pad) in `grad_fmt`) and at/ats (a^T (F, M_pad) in `fmt`) from gu (M, 2F) and
    da (M, F), as the Triton column kernel does (outputs from `tiles.rows_cols_outputs`). Given the forward's tile
    maxima `a_amax` (M, F/128) FP32 (column-major), a^T in 128x128 blocks (ats (F/128, M_pad/128)), as
    `producers.swiglu_backward_quantize` defines them. `use_tma`: read gu and da through TMA (the default where
    `tma_fits` and the layout has 64-byte block rows) or with the threads' loads (False)."""
    m, f = da.shape
    block_n, load, store = gluon_tiles.block_layouts(tokens_each, features_each, num_warps)
    assert f % block_n == 0, f"F={f} must be a multiple of {block_n}"
    blocks = a_amax is not None
    assert not blocks or 128 % block_n == 0, f"a program's {block_n} features must lie in one 128x128 block"
    if use_tma is None:
        use_tma = 2 * block_n == 64 and tma_fits(gu, da)
    amax = a_amax if blocks else ats  # an unused pointer without blocks
    grid = (f // block_n, -(-m // 128))
    outputs = (qt, st, at, ats, amax, m, f, gu.stride(0), da.stride(0), qt.stride(0), st.stride(0), st.stride(1),
               at.stride(0), ats.stride(0), ats.stride(1), amax.stride(1))
    constexprs = _column_constexprs(fmt, grad_fmt, power_of_two, blocks, block_n, load, store, num_warps)
    if use_tma:
        boxes = _slab_descriptors(gu, da, block_n)
        _TMA_LAUNCH.launch(grid, boxes + outputs, dict(constexprs, SLABS=slab_layout(load)))
    else:
        _LAUNCH.launch(grid, (gu, da) + outputs, constexprs)
