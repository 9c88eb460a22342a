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
registers. More savings (47 instructions per element remain at 4 warps, against 143 in the Triton kernel;
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

Numerics are the Triton kernels' (`megafp8.precision.kernels.tiles`, `producers`), op for op, so the two give the
same bits.
"""
from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from megafp8.precision.formats import Fp8Format
from megafp8.precision.kernels import gluon_tiles

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
    rows = mb * gluon_tiles.TOKENS + gl.arange(0, gluon_tiles.TOKENS, layout=gl.SliceLayout(1, load))
    cols = gl.program_id(0) * block_n + gl.arange(0, block_n, layout=gl.SliceLayout(0, load))
    in_rows = gl.expand_dims(rows < M, 1)
    gate_ptrs = gu_ptr + gl.expand_dims(rows, 1) * stride_gm + gl.expand_dims(cols, 0)
    gate = gl.load(gate_ptrs, mask=in_rows, other=0.0).to(gl.float32)
    up = gl.load(gate_ptrs + F, mask=in_rows, other=0.0).to(gl.float32)
    s = 1.0 / (1.0 + exp_neg(gate))
    if A_BLOCKS:
        block = gl.program_id(0) * block_n // gluon_tiles.TOKENS  # the 128 features this program's lie in
        gluon_tiles.store_block_cols(gate * s * up, amax_ptr, stride_ab, M, block, cols, mb, at_ptr, stride_at,
                                     ats_ptr, stride_ats_k, stride_ats_m, FP8_MAX, POW2, load, store, SPREAD)
    else:
        gluon_tiles.store_cols(gate * s * up, cols, mb, at_ptr, stride_at, ats_ptr, stride_ats_k, stride_ats_m,
                               FP8_MAX, POW2, store, SPREAD)
    da = gl.load(da_ptr + gl.expand_dims(rows, 1) * stride_dm + gl.expand_dims(cols, 0), mask=in_rows, other=0.0)
    da_s = da.to(gl.float32) * s
    gluon_tiles.store_cols(da_s * up * (1.0 + gate * (1.0 - s)), cols, mb, qt_ptr, stride_qt, st_ptr, stride_st_k,
                           stride_st_m, GRAD_MAX, POW2, store, SPREAD)
    gluon_tiles.store_cols(da_s * gate, cols + F, mb, qt_ptr, stride_qt, st_ptr, stride_st_k, stride_st_m, GRAD_MAX,
                           POW2, store, SPREAD)


@gluon.jit
def exp_neg(x):
    """exp(-x) as Triton's `exp(-x)` computes it, in 2 instructions instead of 6: -x * log2(e) as one multiply (Triton
    negates as 0 - x, then multiplies: the same product), and `ex2.approx.ftz`, whose result differs from the
    non-flushing `ex2.approx` only where it is below 2^-126, where 1 + exp(-x) rounds to 1 either way."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * -1.4426950408889634], dtype=gl.float32,
                                     is_pure=True, pack=1)


# Triton's JIT once per static signature, then the compiled kernel; one token through a twin (`TokenCountLaunch`)
_LAUNCH = gluon_tiles.TokenCountLaunch(_swiglu_backward_cols_kernel)


def swiglu_backward_cols(gu: torch.Tensor, da: torch.Tensor, qt: torch.Tensor, st: torch.Tensor, at: torch.Tensor,
                         ats: torch.Tensor, fmt: Fp8Format, grad_fmt: Fp8Format, power_of_two: bool,
                         num_warps: int = 4, tokens_each: int = TOKENS_PER_THREAD,
                         features_each: int = FEATURES_PER_THREAD, a_amax: Optional[torch.Tensor] = None) -> None:
    """Fill qt/st (d(gu)^T (2F, M_pad) in `grad_fmt`) and at/ats (a^T (F, M_pad) in `fmt`) from gu (M, 2F) and
    da (M, F), as the Triton column kernel does (outputs from `tiles.rows_cols_outputs`). Given the forward's tile
    maxima `a_amax` (M, F/128) FP32 (column-major), a^T in 128x128 blocks (ats (F/128, M_pad/128)), as
    `producers.swiglu_backward_quantize` defines them."""
    m, f = da.shape
    block_n, load, store = gluon_tiles.block_layouts(tokens_each, features_each, num_warps)
    assert f % block_n == 0, f"F={f} must be a multiple of {block_n}"
    blocks = a_amax is not None
    assert not blocks or 128 % block_n == 0, f"a program's {block_n} features must lie in one 128x128 block"
    amax = a_amax if blocks else ats  # an unused pointer without blocks
    grid = (f // block_n, -(-m // 128))
    _LAUNCH.launch(grid, (gu, da, qt, st, at, ats, amax, m, f, gu.stride(0), da.stride(0), qt.stride(0), st.stride(0),
                          st.stride(1), at.stride(0), ats.stride(0), ats.stride(1), amax.stride(1)),
                   dict(GRAD_MAX=grad_fmt.max, FP8_MAX=fmt.max, POW2=power_of_two, A_BLOCKS=blocks, BLOCK_N=block_n,
                        LOAD=load, STORE=store, SPREAD=gluon_tiles.spread_layout(block_n // num_warps, num_warps),
                        num_warps=num_warps))
