"""FP8 health of a tensor: how well it survives per-tile quantization.

For a tensor quantized as the FP8 linear quantizes it (1x128 tiles along the last dim, or
128x128 blocks for weights):
    amax       max |x|
    underflow  fraction of the nonzero elements that quantize to zero (flushed below the tile's range)
    at_max     fraction of elements quantized to the format's maximum. Online max-abs scaling maps each
               tile's largest element there, so ~1/128 is normal; much more means tiles of equal values
               or a scale that no longer fits the data
    snr_db     10 log10(sum x^2 / sum (x - dequantized)^2), the quantization signal-to-noise ratio (+inf for a
               tensor of zeros: nothing lost)
Values are returned as 0-d device tensors, so computing them does not wait for the device. They are computed over
row chunks (whole 128-row blocks for weights; a tile never straddles two chunks), so the FP32 copies they need
stay a few chunk sizes whatever the tensor's size: made whole, those of an 8B-layer model's (16384, 28672) gate/up
gradient come to ~8 GB of temporaries, at the sampled step's peak.

Each chunk's sums come from `sums` (`ChunkSums`): `chunk_sums` here, the definition in pure torch, or a backend's
one-pass kernel (`Fp8Backend.health_sums`; the Triton one is `megafp8.precision.kernels.health`), which the
sampled monitor uses: in pure torch the statistics of an MoE model's sampled step took ~1 s on an H200, about seven
training steps.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from megafp8.precision.formats import TILE, Fp8Format
from megafp8.precision.quantize import dequantize_128x128, dequantize_1x128, quantize_128x128, quantize_1x128

RowMaker = Callable[[int, int], torch.Tensor]  # (start, stop) -> those rows of a tensor too large to hold whole
# (x2d, fmt, blocks, power_of_two) -> the sums of `chunk_sums` over x2d
ChunkSums = Callable[[torch.Tensor, Fp8Format, bool, bool], dict[str, torch.Tensor]]
CHUNK_ELEMENTS = 1 << 26  # per chunk of rows: 256 MiB in FP32, a few times that in temporaries


def fp8_stats(x: torch.Tensor, fmt: Fp8Format, blocks: bool = False, power_of_two: bool = False,
              chunk_elements: Optional[int] = None, sums: Optional[ChunkSums] = None) -> dict[str, torch.Tensor]:
    """Health of `x` (..., K) quantized in 1x128 tiles along K, or of a weight (N, K) in 128x128 blocks."""
    x2d = x.detach().reshape(-1, x.shape[-1])
    return fp8_stats_of_rows(lambda start, stop: x2d[start:stop], x2d.shape[0], x2d.shape[1], fmt, blocks,
                             power_of_two, chunk_elements, sums)


def fp8_stats_of_rows(rows: RowMaker, count: int, width: int, fmt: Fp8Format,
                      blocks: bool = False, power_of_two: bool = False,
                      chunk_elements: Optional[int] = None, sums: Optional[ChunkSums] = None) -> dict[str, torch.Tensor]:
    """`fp8_stats` of a (count, width) tensor that `rows(start, stop)` makes a chunk of rows at a time (each chunk
    made when it is measured, then dropped): the statistics of a tensor too large to hold whole. Chunks hold about
    `chunk_elements` elements (default `CHUNK_ELEMENTS`); `sums` measures each (default `chunk_sums`)."""
    measure = sums or chunk_sums
    step = max(1, (chunk_elements or CHUNK_ELEMENTS) // max(width, 1))
    if blocks:  # whole 128x128 blocks per chunk
        step = -(-step // TILE) * TILE
    total = None
    for start in range(0, count, step) if count else (0,):
        part = measure(rows(start, min(start + step, count)).detach(), fmt, blocks, power_of_two)
        total = part if total is None else {
            k: torch.maximum(total[k], v) if k == "amax" else total[k] + v for k, v in part.items()}
    return {
        "amax": total["amax"],
        "underflow": total["underflow"] / total["nonzero"].clamp(min=1),
        "at_max": total["at_max"] / max(count * width, 1),
        "snr_db": _snr_db(total["signal"], total["noise"]),
    }


def _snr_db(signal: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """10 log10(signal / noise); +inf for a tensor of zeros, which quantizes exactly (0 / 0 made it -inf, read as
    the worst tensor of a run: an idle expert's weight gradient, say)."""
    snr = 10 * torch.log10(signal / noise.clamp(min=torch.finfo(torch.float64).tiny))
    return torch.where(signal == 0, torch.full_like(snr, math.inf), snr)


def chunk_sums(x2d: torch.Tensor, fmt: Fp8Format, blocks: bool, power_of_two: bool) -> dict[str, torch.Tensor]:
    """The sums the statistics are made of, over one chunk of rows (any float dtype, measured in FP32): max |x|,
    elements flushed to zero, nonzero elements, elements at the format's maximum (int64), sum x^2 and
    sum (x - dequantized)^2 (FP64)."""
    x2d = x2d.float()
    if blocks:
        q, scale = quantize_128x128(x2d, fmt, power_of_two)
        deq = dequantize_128x128(q, scale)
    else:
        q, scale = quantize_1x128(x2d, fmt, power_of_two)
        deq = dequantize_1x128(q, scale)
    q32 = q.float()
    nonzero = x2d != 0
    return {
        "amax": x2d.abs().amax() if x2d.numel() else x2d.new_zeros(()),
        "underflow": ((q32 == 0) & nonzero).sum(),
        "nonzero": nonzero.sum(),
        "at_max": (q32.abs() == fmt.max).sum(),
        "signal": x2d.square().sum(dtype=torch.float64),
        "noise": (x2d - deq).square().sum(dtype=torch.float64),
    }
