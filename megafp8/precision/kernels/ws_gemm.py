"""Warp-specialized blockwise FP8 GEMMs for Hopper (SM90), written in Gluon (Triton's explicit-layout language).

One kernel serves three GEMMs of the recipe:

    rows grouped   C (Mp, N)    = A (Mp, K) @ B[e] (N, K)^T per 128-row tile of expert e (`tile_expert`);
                   A in 1x128 tiles, B in 128x128 blocks (the experts' fprop and dgrad)
    K grouped      C[e] (M, N)  = A (M, K_e) @ B (N, K_e)^T over expert e's K blocks (`k_start`, `k_count`);
                   both in 1x128 tiles along K (the experts' wgrad, contracting over each expert's tokens)
    dense          C (M, N)     = A (M, K) @ B (N, K)^T, both in 1x128 tiles along K (a dense layer's wgrad,
                   contracting over the tokens) or B in 128x128 blocks

with C written in BF16/FP32 or added into an FP32 C (a weight's `main_grad`: no rounded copy, no separate add).

Why warp specialization: each 128-wide K step's tensor-core product must be scaled before it joins the FP32
accumulator (DeepSeek-V3's promotion on CUDA cores), so a consumer waits for every MMA before its FMAs. Here one
producer warp streams A and B tiles through a ring of shared-memory stages by TMA, and two consumer warpgroups,
each owning 64 rows of a 128 x BLOCK_N output tile, run independently of each other: while one scales its
product on the CUDA cores the other's MMA keeps the tensor cores busy (DeepGEMM's scheme). Programs are
persistent (one per SM) and walk the output tiles grouped along M, so the producer is already loading the next
tile while the consumers write the last one.

`interleave_ffma` compiles a variant whose cubin has each promotion's FFMA run interleaved (every other FFMA of
its first 9/16 yields to other warps and keeps no operand in the reuse cache; `ffma_interleave`, DeepGEMM's
technique), so the scheduler may issue the other consumer's wgmma inside it.

Epilogue: a consumer writes each 64 x 128 slice of its output into shared memory and hands it to the TMA engine,
which stores it (or, into `main_grad`, adds it: TMA's reduction), while the consumer goes on to its next tile's
MMAs; it waits for that buffer one tile later. Stored from registers, both consumers of a tile would stand in
their epilogue together with the tensor cores idle. The buffers cost a pipeline stage (3 instead of 4 at 256
columns). Outputs TMA cannot write as the registers would (`tma_store_fits`) keep the register epilogue.

The K-grouped wgrad into `main_grad` deals out only the tiles of experts with rows (the compact walk,
`ws_tiles.tile_coords`): each program reads the experts' row counts once, ranks the busy ones by a scan in
registers, and finds each of its tiles' expert there. Walked expert by expert, with most experts idle (a collapsed router), each
busy expert's tiles would fall on one stripe of programs, and the programs under more stripes set the time.

Scales: each K step's scales (A's rows', and B's rows' where B is in 1x128 tiles) arrive by TMA with the
operands, on the stage's barrier, and the consumers read them from shared memory straight into the accumulator's
row and column layouts (DeepGEMM's route: loaded from global memory, the 128 column scales needed a layout
conversion through shared memory, and in registers they spilled the accumulators at 256 columns). A stage is
released as soon as its last wgmma has completed, before the last slice's promotion. TMA reads the scales
rows-first and 16-byte aligned, as the quantizers write them; any other layout is copied into one
(`_tma_scales`).

What the kernel measures against cuBLAS and BF16, and the schedules tried and removed (256 x 128 tiles, consumers
taking turns, two products in flight, consumer 1's MMAs ordered after consumer 0's, the wgrads' FMUL runs
interleaved), are in `docs/performance.md` and `docs/benchmarks.md`. The `hopper` backend
(`auto` on SM90) runs the grouped GEMMs and the dense fprop and dgrad on it; dense weight gradients stay on
cuBLASLt.

Numerics are the Triton kernels' (`megafp8.precision.kernels.gemm`): an FP32 partial product per 128-wide K step,
times its scales, added to an FP32 accumulator; results differ from the reference backend only in summation order.
Hopper only: TMA, wgmma and `setmaxnreg`; `megafp8.precision.kernels.gemm` keeps the portable kernels.
"""
from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.language._core import builtin
from triton._C.libtriton import gluon_ir, ir

from megafp8.precision.kernels.ffma_interleave import patching_ffma
from megafp8.precision.kernels.launch import Descriptor, FastLaunch
from megafp8.precision.kernels.ws_tiles import TILE, tile_coords, walk_lanes, walked_tiles

# Kernel constants are constexprs (the only globals a Gluon kernel may read).
HALF_M = gl.constexpr(64)  # rows of the output tile one consumer warpgroup owns
_CONSUMER_REGS = gl.constexpr(240)  # registers per thread of a consumer warpgroup: two accumulators, one product
_PRODUCER_REGS = gl.constexpr(24)
# A K step's scales in shared memory, as the (unswizzled) [1, rows] TMA boxes read as plain vectors.
_FLAT = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
INTERLEAVE_MARKER = "megafp8:interleave-ffma"
_MARKED_MOVE = gl.constexpr("mov.b32 $0, $1; // " + INTERLEAVE_MARKER)  # (`_settled` with INTERLEAVE)
_MAXNREG = 168  # 12 warps (3 warpgroups) x 32 threads x 168 <= the SM's 64K registers
_GL_DTYPES = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5, torch.bfloat16: gl.bfloat16,
              torch.float32: gl.float32}


@gluon.jit
def _producer(a_desc, b_desc, as_desc, bs_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, M, N, K_BLOCKS,
              tile_expert_ptr, k_start_ptr, k_count_ptr, num_groups,
              GROUPED_ROWS: gl.constexpr, GROUPED_K: gl.constexpr, COMPACT: gl.constexpr, B_BLOCKWISE: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_E: gl.constexpr):
    """One warp: TMA loads of every tile's A (two 64-row halves) and B (BLOCK_N/128 slices) per K step into the
    stage ring, with their scales for that K step (A's rows'; B's rows' where B is in 1x128 tiles), on the same
    barrier; a stage is refilled once both consumers have released it."""
    NB: gl.constexpr = BLOCK_N // TILE
    stage_bytes: gl.constexpr = (2 * a_desc.block_type.nbytes + NB * b_desc.block_type.nbytes
                                 + 2 * as_desc.block_type.nbytes
                                 + (0 if B_BLOCKWISE else NB * bs_desc.block_type.nbytes))
    walk: gl.constexpr = gl.BlockedLayout([BLOCK_E // 32], [32], [1], [0])  # this partition's one warp
    num_tiles, ranks = walked_tiles(M, N, num_groups, k_count_ptr, BLOCK_N, GROUPED_K, COMPACT, BLOCK_E, walk)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n, b_row, group, k_first, k_steps = tile_coords(
            tile, M, N, K_BLOCKS, tile_expert_ptr, k_start_ptr, k_count_ptr, ranks, GROUPED_ROWS, GROUPED_K,
            COMPACT, BLOCK_N, GROUP_M, BLOCK_E, walk)
        for kb in range(k_steps):
            s = counter % STAGES
            mbarrier.wait(empty.index(s), ((counter // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, stage_bytes)
            kblk = k_first + kb
            k = kblk * TILE
            tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(2 * s))
            tma.async_copy_global_to_shared(a_desc, [off_m + HALF_M, k], bar, a_bufs.index(2 * s + 1))
            tma.async_copy_global_to_shared(as_desc, [kblk, off_m], bar, as_bufs.index(2 * s))
            tma.async_copy_global_to_shared(as_desc, [kblk, off_m + HALF_M], bar, as_bufs.index(2 * s + 1))
            for h in gl.static_range(NB):
                tma.async_copy_global_to_shared(b_desc, [b_row + h * TILE, k], bar, b_bufs.index(NB * s + h))
                if not B_BLOCKWISE:
                    tma.async_copy_global_to_shared(bs_desc, [kblk, b_row + h * TILE], bar, bs_bufs.index(NB * s + h))
            counter += 1


@gluon.jit
def _scaled_product(a_smem, b_smem, t, a_s, bs_smem, bs_ptr, group, n_block, N, kblk, stride_bs_e, stride_bs_n,
                    stride_bs_k, B_BLOCKWISE: gl.constexpr, col_layout: gl.constexpr):
    """(t, scaled): the 64 x 128 product of one K step (`t` carries the product's registers from step to step) and
    that product times its scales: the rows' `a_s` and B's block scale (one per 128 columns) or the scales of B's
    128 rows (C's columns), which arrived with the stage in `bs_smem` and are read straight into the accumulator's
    column layout."""
    t = warpgroup_mma(a_smem, b_smem.permute((1, 0)), t, use_acc=False, is_async=True)
    if B_BLOCKWISE:  # (a slice past N's last block reads no scale: its columns are not stored)
        b_s = gl.load(bs_ptr + group * stride_bs_e + n_block * stride_bs_n + kblk * stride_bs_k,
                      mask=n_block < gl.cdiv(N, TILE), other=0.0)
        t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
        return t, t * (a_s * b_s)[:, None]
    t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
    b_s = bs_smem._reinterpret(gl.float32, [TILE], _FLAT).load(col_layout)  # after the wait: fewer live registers
    return t, t * a_s[:, None] * b_s[None, :]


@gluon.jit
def _settled(x, INTERLEAVE: gl.constexpr):
    """x, through an opaque (volatile) move: the compiler may not hoist the next wgmma above the FMAs that made x,
    which would keep two products' registers live at once and spill the accumulators. With INTERLEAVE the move
    carries `INTERLEAVE_MARKER` into the PTX, which has the cubin's FFMA runs interleaved (`ffma_interleave`)."""
    if INTERLEAVE:
        return gl.inline_asm_elementwise(_MARKED_MOVE, "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _write(c_ptr, acc, rows, cols, M, N, group, stride_ce, stride_cm, ACCUMULATE: gl.constexpr):
    """Store (or, with ACCUMULATE, add into FP32 C) a consumer's 64 x 128 piece of the output tile."""
    ptrs = c_ptr + group.to(gl.int64) * stride_ce + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if ACCUMULATE:
        acc = acc + gl.load(ptrs, mask=mask, other=0.0)
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """`cp.reduce.async.bulk.tensor ... .add`: the shared-memory tile `src` added into global memory at `coord` by
    the TMA engine (each element one IEEE add, as `c + acc` in registers). Triton 3.6's Gluon builds this op
    (`create_async_tma_reduce`) but exports no function for it; this is its `async_copy_shared_to_global` with
    the reduction kind, and `tma.store_wait` waits for it the same way."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _write_by_tma(c_desc, c_buf, acc, row, col, ADD: gl.constexpr):
    """Hand a consumer's 64 x 128 piece of the output tile to the TMA engine through shared memory, stored or (ADD)
    added into C: the consumer goes on to its next tile while the copy runs (its buffer is reused only after
    `tma.store_wait`). TMA clips rows and columns past C's edges."""
    c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    if ADD:
        _tma_reduce_add(c_desc, [row, col], c_buf)
    else:
        tma.async_copy_shared_to_global(c_desc, [row, col], c_buf)


@gluon.jit
def _epilogue(c_desc, c_bufs, c_ptr, acc0, acc1, group, off_m, off_n, M, N, stride_ce, stride_cm,
              HALF: gl.constexpr, GROUPED_K: gl.constexpr, ACCUMULATE: gl.constexpr, TMA_STORE: gl.constexpr,
              C_BUFS: gl.constexpr, NB: gl.constexpr, row_layout: gl.constexpr, col_layout: gl.constexpr):
    """A consumer's rows of the output tile leave: by TMA through its shared-memory buffers, or from registers
    (`acc1`, the second 128-column slice, where the tile is 256 wide)."""
    if TMA_STORE:  # this consumer's buffers were last handed to TMA a whole tile ago
        row = group * M + off_m + HALF * HALF_M if GROUPED_K else off_m + HALF * HALF_M  # C as (E * M, N)
        tma.store_wait(pendings=0)
        _write_by_tma(c_desc, c_bufs.index(C_BUFS * HALF), acc0, row, off_n, ACCUMULATE)
        if NB == 2:
            if C_BUFS == 1:  # one buffer a consumer (FP32 slices): the first slice must have left it
                tma.store_wait(pendings=0)
            _write_by_tma(c_desc, c_bufs.index(C_BUFS * HALF + C_BUFS - 1), acc1, row, off_n + TILE, ACCUMULATE)
    else:
        rows = off_m + HALF * HALF_M + gl.arange(0, HALF_M, layout=row_layout)
        cols = off_n + gl.arange(0, TILE, layout=col_layout)
        _write(c_ptr, acc0, rows, cols, M, N, group, stride_ce, stride_cm, ACCUMULATE)
        if NB == 2:
            _write(c_ptr, acc1, rows, cols + TILE, M, N, group, stride_ce, stride_cm, ACCUMULATE)


@gluon.jit
def _tile_product(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, t, counter, bs_ptr, group, off_n, N, k_first,
                  k_steps, stride_bs_e, stride_bs_n, stride_bs_k, HALF: gl.constexpr, B_BLOCKWISE: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, INTERLEAVE: gl.constexpr, layout: gl.constexpr):
    """(acc0, acc1, t, counter): one consumer's rows of one output tile, each 128-column slice's FP32 accumulator
    (acc1 only where the tile is 256 wide). Per K step and slice: a wgmma into a fresh FP32 product, wait, scale,
    add to that slice's accumulator. The stage is released once its last wgmma has completed and its scales are
    read, before the last slice's promotion. `counter` counts the K steps taken so far (the stage ring's position)."""
    NB: gl.constexpr = BLOCK_N // TILE
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, layout)
    acc0 = gl.zeros([HALF_M, TILE], gl.float32, layout)
    acc1 = gl.zeros([HALF_M, TILE], gl.float32, layout)
    for kb in range(k_steps):
        s = counter % STAGES
        kblk = k_first + kb
        mbarrier.wait(ready.index(s), (counter // STAGES) & 1)
        a_s = as_bufs.index(2 * s + HALF)._reinterpret(gl.float32, [HALF_M], _FLAT).load(row_layout)
        a_smem = a_bufs.index(2 * s + HALF)
        t, scaled = _scaled_product(a_smem, b_bufs.index(NB * s), t, a_s, bs_bufs.index(NB * s), bs_ptr, group,
                                    off_n // TILE, N, kblk, stride_bs_e, stride_bs_n, stride_bs_k, B_BLOCKWISE,
                                    col_layout)
        if NB == 2:
            acc0 = _settled(acc0 + scaled, INTERLEAVE)
            t, scaled = _scaled_product(a_smem, b_bufs.index(NB * s + 1), t, a_s, bs_bufs.index(NB * s + 1),
                                        bs_ptr, group, off_n // TILE + 1, N, kblk, stride_bs_e, stride_bs_n,
                                        stride_bs_k, B_BLOCKWISE, col_layout)
            mbarrier.arrive(empty.index(s), count=1)
            acc1 = acc1 + scaled
        else:
            mbarrier.arrive(empty.index(s), count=1)
            acc0 = acc0 + scaled
        counter += 1
    return acc0, acc1, t, counter


NVMMA_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32]))


@gluon.jit
def _consumer(a_bufs, b_bufs, as_bufs, bs_bufs, c_bufs, ready, empty, c_desc, c_ptr, bs_ptr, M, N, K_BLOCKS,
              tile_expert_ptr, k_start_ptr, k_count_ptr, num_groups, stride_ce, stride_cm, stride_bs_e,
              stride_bs_n, stride_bs_k, HALF: gl.constexpr, GROUPED_ROWS: gl.constexpr, GROUPED_K: gl.constexpr,
              COMPACT: gl.constexpr, B_BLOCKWISE: gl.constexpr, ACCUMULATE: gl.constexpr, TMA_STORE: gl.constexpr,
              C_BUFS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
              INTERLEAVE: gl.constexpr, BLOCK_E: gl.constexpr):
    """One warpgroup: rows [HALF * 64, HALF * 64 + 64) of every output tile (`_tile_product`), then its epilogue."""
    NB: gl.constexpr = BLOCK_N // TILE
    layout: gl.constexpr = NVMMA_LAYOUT
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, layout)
    t = gl.zeros([HALF_M, TILE], gl.float32, layout)
    walk: gl.constexpr = gl.BlockedLayout([BLOCK_E // 128], [32], [4], [0])  # this partition's four warps
    num_tiles, ranks = walked_tiles(M, N, num_groups, k_count_ptr, BLOCK_N, GROUPED_K, COMPACT, BLOCK_E, walk)
    counter = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        off_m, off_n, b_row, group, k_first, k_steps = tile_coords(
            tile, M, N, K_BLOCKS, tile_expert_ptr, k_start_ptr, k_count_ptr, ranks, GROUPED_ROWS, GROUPED_K,
            COMPACT, BLOCK_N, GROUP_M, BLOCK_E, walk)
        # Index vectors are made where they are used, not kept across the K loop: a 128-wide column vector takes 32
        # registers a thread in this layout, which the accumulators need.
        acc0, acc1, t, counter = _tile_product(a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, t, counter, bs_ptr,
                                               group, off_n, N, k_first, k_steps, stride_bs_e, stride_bs_n,
                                               stride_bs_k, HALF, B_BLOCKWISE, BLOCK_N, STAGES, INTERLEAVE, layout)
        if ACCUMULATE:
            # A tile without K steps (an expert the router gave no rows) would add zeros: main_grad is left as it
            # is, rather than read and written back (with 33-52 of 64 experts idle: 14-24% of a grouped wgrad's
            # time in the MoE step, docs/benchmarks.md jobs FS-FT).
            if k_steps > 0:
                _epilogue(c_desc, c_bufs, c_ptr, acc0, acc1, group, off_m, off_n, M, N, stride_ce, stride_cm, HALF,
                          GROUPED_K, ACCUMULATE, TMA_STORE, C_BUFS, NB, row_layout, col_layout)
        else:
            _epilogue(c_desc, c_bufs, c_ptr, acc0, acc1, group, off_m, off_n, M, N, stride_ce, stride_cm, HALF,
                      GROUPED_K, ACCUMULATE, TMA_STORE, C_BUFS, NB, row_layout, col_layout)
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def _ws_gemm_kernel(a_desc, b_desc, as_desc, bs_desc, c_desc, c_ptr, bs_ptr, tile_expert_ptr, k_start_ptr,
                    k_count_ptr, M, N, K_BLOCKS, num_groups, stride_ce, stride_cm, stride_bs_e, stride_bs_n,
                    stride_bs_k, GROUPED_ROWS: gl.constexpr, GROUPED_K: gl.constexpr, COMPACT: gl.constexpr,
                    B_BLOCKWISE: gl.constexpr, ACCUMULATE: gl.constexpr, TMA_STORE: gl.constexpr,
                    C_BUFS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                    INTERLEAVE: gl.constexpr, BLOCK_E: gl.constexpr):
    NB: gl.constexpr = BLOCK_N // TILE
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, TILE], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NB * STAGES, TILE, TILE], b_desc.layout)
    # Scales by K step, as [1, rows] boxes: A's 64 rows per half, B's 128 rows per slice (unused with B in blocks).
    as_bufs = gl.allocate_shared_memory(gl.float32, [2 * STAGES, 1, HALF_M], as_desc.layout)
    bs_bufs = gl.allocate_shared_memory(gl.float32, [NB * STAGES, 1, TILE], bs_desc.layout)
    if TMA_STORE:  # the epilogue's staging buffers: C_BUFS per consumer, one per 128-column slice or one in all
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 * C_BUFS, HALF_M, TILE], c_desc.layout)
    else:  # (unused: stores go from the consumers' registers)
        c_bufs = as_bufs
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    # (No starred arguments in Gluon: every partition's arguments are spelled out.)
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, as_bufs, bs_bufs, c_bufs, ready, empty, c_desc, c_ptr, bs_ptr, M, N, K_BLOCKS,
                     tile_expert_ptr, k_start_ptr, k_count_ptr, num_groups, stride_ce, stride_cm, stride_bs_e,
                     stride_bs_n, stride_bs_k, 0, GROUPED_ROWS, GROUPED_K, COMPACT, B_BLOCKWISE, ACCUMULATE,
                     TMA_STORE, C_BUFS, BLOCK_N, STAGES, GROUP_M, INTERLEAVE, BLOCK_E)),
        (_consumer, (a_bufs, b_bufs, as_bufs, bs_bufs, c_bufs, ready, empty, c_desc, c_ptr, bs_ptr, M, N, K_BLOCKS,
                     tile_expert_ptr, k_start_ptr, k_count_ptr, num_groups, stride_ce, stride_cm, stride_bs_e,
                     stride_bs_n, stride_bs_k, 1, GROUPED_ROWS, GROUPED_K, COMPACT, B_BLOCKWISE, ACCUMULATE,
                     TMA_STORE, C_BUFS, BLOCK_N, STAGES, GROUP_M, INTERLEAVE, BLOCK_E)),
        (_producer, (a_desc, b_desc, as_desc, bs_desc, a_bufs, b_bufs, as_bufs, bs_bufs, ready, empty, M, N,
                     K_BLOCKS, tile_expert_ptr, k_start_ptr, k_count_ptr, num_groups, GROUPED_ROWS, GROUPED_K,
                     COMPACT, B_BLOCKWISE, BLOCK_N, STAGES, GROUP_M, BLOCK_E)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


_LAUNCH = FastLaunch(_ws_gemm_kernel)  # Triton's JIT once per static signature, then the compiled kernel
_T = 128  # TILE and HALF_M on the host
_H = 64
# The shared-memory layouts of the tiles TMA moves, by (box, element type), and of the scales' boxes: pure functions
# of those, worked out once here rather than at each of a launch's five descriptors (~9 us of host time each).
_TILE_LAYOUTS = MappingProxyType({(block, dtype): gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)
                                  for block in ((_H, _T), (_T, _T)) for dtype, gl_dtype in _GL_DTYPES.items()})
_SCALE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _descriptor(t: torch.Tensor, block: tuple[int, int]) -> Descriptor:
    return Descriptor(t, block, _TILE_LAYOUTS[block, t.dtype])


def _tma_scales(scale: torch.Tensor) -> torch.Tensor:
    """A (rows, K/128) FP32 scale tensor as TMA reads it: stored rows-first (`tiles.mn_major_scales`) with each K
    step's rows starting 16 bytes apart or a multiple of that. As given when it is (what our quantizers make for
    whole 128-token tiles), else copied into such a layout (scales are 1/128 of their operand: a small copy)."""
    rows_first = scale.stride(0) == 1 and scale.stride(1) >= scale.shape[0]  # not expanded, rows not overlapping
    if rows_first and scale.stride(1) % 4 == 0 and scale.data_ptr() % 16 == 0:
        return scale
    rows, steps = scale.shape
    padded = torch.empty(steps, -(-rows // 4) * 4, dtype=scale.dtype, device=scale.device)
    aligned = padded.t()[:rows]
    aligned.copy_(scale)
    return aligned


def _scale_descriptor(scale: torch.Tensor, rows: int) -> Descriptor:
    """TMA over a (rows, K/128) FP32 scale tensor (`_tma_scales` lays it out), viewed as (K/128, rows): one K
    step's scales of `rows` consecutive rows per box."""
    return Descriptor(_tma_scales(scale).t(), (1, rows), _SCALE_LAYOUT)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_SMEM_BYTES = 232448  # shared memory a block may use on SM90 (227 KB)


def _stages(block_n: int, epilogue_bytes: int = 0) -> int:
    """As many stages as fit in shared memory beside the epilogue's staging buffers (`epilogue_bytes`; 0: stores
    from registers), at most 4 with 256 columns and 6 with 128: a stage holds A's 128 x 128 and B's block_n x 128
    FP8 tiles and their scales (50,688 bytes with 256 columns, 33,792 with 128); 1 KB is left for the barriers."""
    stage = 128 * 128 + block_n * 128 + 512 + 4 * block_n
    return min(4 if block_n == 256 else 6, (_SMEM_BYTES - 1024 - epilogue_bytes) // stage)


def epilogue_buffers(c: torch.Tensor, block_n: int) -> int:
    """Staging buffers per consumer for a TMA epilogue into `c`: one per 128-column slice in BF16, one in all in
    FP32 (two 32 KB FP32 slices a consumer leave too few stages)."""
    return block_n // 128 if c.element_size() == 2 else 1


def tma_reduce_available() -> bool:
    """Whether this Triton builds TMA's reduction (`_tma_reduce_add`): Gluon's builder has had the op without a
    public function for it; where it is missing, outputs added into `main_grad` keep the register epilogue."""
    return hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce") and hasattr(ir, "DESCRIPTOR_REDUCE_KIND")


def tma_store_fits(c: torch.Tensor, grouped_k: bool, rows: int, accumulate: bool = False) -> bool:
    """Whether the output tiles can leave by TMA (stored, or with `accumulate` added into FP32 `main_grad` by TMA's
    reduction, where this Triton builds it): C BF16 or FP32, rows contiguous, 16-byte aligned rows and start; a
    per-expert stack (E, rows, N) only as one (E * rows, N) matrix whose experts start on 128-row tile boundaries
    (TMA clips at the matrix's edges, not at each expert's)."""
    if accumulate and not tma_reduce_available():
        return False
    if c.dtype not in (torch.bfloat16, torch.float32) or c.stride(-1) != 1 or c.data_ptr() % 16:
        return False
    if (c.stride(-2) * c.element_size()) % 16 or c.stride(-2) < c.shape[-1]:  # aligned rows, not overlapping
        return False
    if grouped_k:
        return c.dim() == 3 and rows % 128 == 0 and c.stride(0) == rows * c.stride(1)
    return c.dim() == 2


def ws_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, c: torch.Tensor, *,
            b_blockwise: bool, accumulate: bool = False, tile_expert: Optional[torch.Tensor] = None,
            k_start: Optional[torch.Tensor] = None, k_count: Optional[torch.Tensor] = None,
            block_n: int = 256, group_m: int = 8, tma_store: Optional[bool] = None,
            interleave_ffma: bool = False, compact_groups: bool = True) -> torch.Tensor:
    """C = A @ B^T by the warp-specialized kernel (module docstring), into `c`; returns c.

    a (M, K) and b (rows, K) FP8, K-contiguous; a_scale (M, K/128); b_scale (N/128, K/128) blocks, (E, N/128,
    K/128) with `tile_expert`, or (rows, K/128) per row of B when not `b_blockwise`. `tile_expert` (M/128,):
    expert per 128-row tile of A, b = (E * N, K) stacked. `k_start`, `k_count` (E,): each group's K blocks, c
    (E, M, N). `accumulate`: c is FP32 and the product is added into it (a group without K blocks, an expert
    without rows, leaves its c untouched: not even a zero is added, so its -0.0s and NaNs stay as they were).
    `tma_store`: the output tiles leave through shared memory by TMA (stored, or added by TMA's reduction),
    overlapping the next tile's MMAs (None: wherever `tma_store_fits`), or from the consumers' registers (loaded,
    added and stored there).
    `interleave_ffma` (256-wide tiles): the promotion's FFMA runs interleaved in the cubin, so the warp scheduler
    may switch warps inside them (`megafp8.precision.kernels.ffma_interleave`; the same bits).
    `compact_groups` (K grouped, accumulating): the programs share out only the tiles of groups with K blocks
    (`ws_tiles.tile_coords`; the same bits, each tile computed as before); without accumulation every group's tiles are
    walked, since an idle expert's output must be written (zeros)."""
    m, k = a.shape
    n = c.shape[-1]
    grouped_k = k_start is not None
    assert a.stride(1) == 1 and b.stride(1) == 1 and c.stride(-1) == 1 and k % 8 == 0
    assert block_n in (128, 256) and (not accumulate or c.dtype == torch.float32)
    assert block_n == 256 or not interleave_ffma, "the interleaved FFMAs are the 256-wide tiles' (`_settled`)"
    if tile_expert is not None:
        assert m % _T == 0 and b_blockwise, "rows grouped by expert need whole 128-row tiles and B in blocks"
    assert c.shape[-2] == m, f"C has {c.shape[-2]} rows for A's {m}"  # TMA clips at C's edge, the registers at M
    fits = tma_store_fits(c, grouped_k, m, accumulate)
    if tma_store is None:
        tma_store = fits
    assert fits or not tma_store, "this output cannot be stored by TMA (tma_store_fits)"
    num_groups = k_start.shape[0] if grouped_k else 1
    num_tiles = -(-m // _T) * -(-n // block_n) * num_groups
    if num_tiles == 0:
        return c
    bs_e, bs_n, bs_k = (b_scale.stride() if b_scale.dim() == 3 else (0, *b_scale.stride()))
    dummy = a_scale  # an unused pointer argument
    grid = (min(_sm_count(a.device), num_tiles),)
    a_scale = _tma_scales(a_scale)
    as_desc = _scale_descriptor(a_scale, _H)
    # With B in blocks its scale is one number per slice, read from global memory; the descriptor is then unused.
    bs_desc = _scale_descriptor(a_scale if b_blockwise else b_scale, _T)
    a_desc = _descriptor(a, (_H, _T))
    # C as one matrix (a per-expert stack as (E * M, N)); unused without TMA stores
    c_rows = c.shape[0] if c.dim() == 2 else c.shape[0] * m
    c_desc = _descriptor(c.as_strided((c_rows, n), (c.stride(-2), 1)), (_H, _T)) if tma_store else a_desc
    c_bufs = epilogue_buffers(c, block_n) if tma_store else 0  # per consumer, each 64 x 128 elements of C
    args = (a_desc, _descriptor(b, (_T, _T)), as_desc, bs_desc, c_desc, c, b_scale,
            tile_expert if tile_expert is not None else dummy, k_start if grouped_k else dummy,
            k_count if grouped_k else dummy, m, n, -(-k // _T), num_groups,
            c.stride(0) if grouped_k else 0, c.stride(-2), bs_e, bs_n, bs_k)
    compact = grouped_k and accumulate and compact_groups
    options = dict(GROUPED_ROWS=tile_expert is not None, GROUPED_K=grouped_k, COMPACT=compact, B_BLOCKWISE=b_blockwise,
                   ACCUMULATE=accumulate, TMA_STORE=tma_store, C_BUFS=max(c_bufs, 1), BLOCK_N=block_n,
                   STAGES=_stages(block_n, 2 * c_bufs * _H * _T * c.element_size()), GROUP_M=group_m,
                   INTERLEAVE=interleave_ffma, BLOCK_E=walk_lanes(num_groups if compact else 1), num_warps=4,
                   maxnreg=_MAXNREG)
    # (the interleaved variant is compiled, the first time, with the cubin pass installed)
    _LAUNCH.launch(grid, args, options, compiling=functools.partial(patching_ffma, INTERLEAVE_MARKER)
                   if interleave_ffma else None)
    return c
