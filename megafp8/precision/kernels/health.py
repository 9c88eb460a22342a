"""FP8 health sums in one pass: `megafp8.precision.health.chunk_sums` (the pure-torch twin) as one Triton kernel.

Each program quantizes its tile of x as the reference quantizer does (`tiles.tile_scale`, `tiles.to_fp8`: the same
bits), dequantizes it in registers and writes six partial sums: max |x|, elements flushed to zero, nonzero elements,
elements at the format's maximum, sum x^2 and sum (x - dequantized)^2. torch then adds the programs' partials (the
energies in FP64). The reference reads and writes the tensor in FP32 about fifteen times (the casts, the quantized
copy, the dequantized copy, each comparison and square); this reads it once in its own dtype. The counts are exact;
the energies differ from the reference's by summation order only (FP32 within a row of a tile, FP64 across rows and
programs; nothing is contracted into FMAs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megafp8.precision.formats import TILE, Fp8Format
from megafp8.precision.kernels import tiles

ROWS_PER_TILE_PROGRAM = 32  # 1x128 tiles: rows of x per program (32 x 128 elements: exact FP32 counts)


@triton.jit
def _tile_partials(x, scale, inv, FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr):
    """The six sums of an FP32 tile x quantized with per-element multipliers `inv` (broadcast) and dequantized with
    `scale`; rows outside the tensor hold zeros and add nothing."""
    q = tiles.to_fp8(x, inv, FP8_MAX, FP8_DTYPE).to(tl.float32)
    error = x - q * scale
    nonzero = x != 0
    amax = tiles.amax(tiles.amax(tl.abs(x), 1), 0)
    underflow = tl.sum(tl.sum(((q == 0) & nonzero).to(tl.float32), 1), 0)
    nonzeros = tl.sum(tl.sum(nonzero.to(tl.float32), 1), 0)
    at_max = tl.sum(tl.sum((tl.abs(q) == FP8_MAX).to(tl.float32), 1), 0)
    # Squares in FP32 as the reference's; each row's 128 added in FP32, the rows in FP64 (a tile of 4,096 or 16,384
    # squares added in FP32 would overflow at an RMS ~10x below where the reference's squares do).
    signal = tl.sum(tl.sum(x * x, 1).to(tl.float64), 0)
    noise = tl.sum(tl.sum(error * error, 1).to(tl.float64), 0)
    return amax, underflow, nonzeros, at_max, signal, noise


@triton.jit
def _health_sums_kernel(x_ptr, out_ptr, M, stride_xm, FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr,
                        POW2: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program (mb, kb): x[mb*BLOCK_M : (mb+1)*BLOCK_M, kb*128 : (kb+1)*128] quantized in 1x128 tiles along the
    columns, or (BLOCKS, BLOCK_M = 128) as one 128x128 block; its six sums (`_tile_partials`) into out[program, :]
    (FP64). The row blocks go on the grid's first axis, which takes 2^31 - 1 programs (the others 65,535)."""
    mb = tl.program_id(0)
    kb = tl.program_id(1)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=(rows < M)[:, None],
                other=0.0).to(tl.float32)
    if BLOCKS:
        scale, inv = tiles.tile_scale(tiles.amax(tiles.amax(tl.abs(x), 1), 0), FP8_MAX, POW2)
        partials = _tile_partials(x, scale, inv, FP8_MAX, FP8_DTYPE)
    else:
        scale, inv = tiles.tile_scale(tiles.amax(tl.abs(x), 1), FP8_MAX, POW2)
        partials = _tile_partials(x, scale[:, None], inv[:, None], FP8_MAX, FP8_DTYPE)
    out = out_ptr + (mb.to(tl.int64) * tl.num_programs(1) + kb) * 6
    for i in tl.static_range(6):
        tl.store(out + i, partials[i].to(tl.float64))


def health_sums(x2d: torch.Tensor, fmt: Fp8Format, blocks: bool, power_of_two: bool) -> dict[str, torch.Tensor]:
    """`health.chunk_sums` of x2d (M, K), K a multiple of 128 (and M of 128 for `blocks`), in any float dtype:
    0-d device tensors, the counts int64 and the energies FP64."""
    m, k = x2d.shape
    if k % TILE or (blocks and m % TILE):
        raise ValueError(f"FP8 health of a ({m}, {k}) tensor: its width{' and rows' if blocks else ''} must be "
                         f"multiples of {TILE}")
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    block_m = TILE if blocks else ROWS_PER_TILE_PROGRAM
    grid = (triton.cdiv(m, block_m), k // TILE)
    partials = torch.empty(grid[0] * grid[1], 6, dtype=torch.float64, device=x2d.device)
    if m:
        _health_sums_kernel[grid](x2d, partials, m, x2d.stride(0), FP8_MAX=fmt.max, FP8_DTYPE=_triton_dtype(fmt),
                                  POW2=power_of_two, BLOCKS=blocks, BLOCK_M=block_m,
                                  num_warps=8 if blocks else 4,
                                  # No FMA contraction: x - q * scale rounds the product first, as the reference's
                                  # dequantized copy does (contracted, a tile maximum's error of one rounding of q *
                                  # scale vanishes, 0.1% of the noise in job FZ's test), and the squares before sums.
                                  enable_fp_fusion=False)
    # amax: FP32 values held exactly in FP64, as the reference's FP32 maximum
    amax = partials[:, 0].amax().float() if partials.shape[0] else torch.zeros((), device=x2d.device)
    totals = partials[:, 1:].sum(dim=0)
    counts = totals[:3].round().to(torch.int64)  # exact: each partial is an exact integer below 2^24
    return {"amax": amax, "underflow": counts[0], "nonzero": counts[1], "at_max": counts[2],
            "signal": totals[3], "noise": totals[4]}


def _triton_dtype(fmt: Fp8Format):
    return {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}[fmt.dtype]
