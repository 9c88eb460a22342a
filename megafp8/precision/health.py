"""FP8 health of a tensor: how well it survives per-tile quantization.

For a tensor quantized as the FP8 linear quantizes it (1x128 tiles along the last dim, or
128x128 blocks for weights):
    amax       max |x|
    underflow  fraction of the nonzero elements that quantize to zero (flushed below the tile's range)
    at_max     fraction of elements quantized to the format's maximum. Online max-abs scaling maps each
               tile's largest element there, so ~1/128 is normal; much more means tiles of equal values
               or a scale that no longer fits the data
    snr_db     10 log10(sum x^2 / sum (x - dequantized)^2), the quantization signal-to-noise ratio
Values are returned as 0-d device tensors, so computing them does not wait for the device.
"""
from __future__ import annotations

import torch

from megafp8.precision.formats import Fp8Format
from megafp8.precision.quantize import dequantize_128x128, dequantize_1x128, quantize_128x128, quantize_1x128


def fp8_stats(x: torch.Tensor, fmt: Fp8Format, blocks: bool = False, power_of_two: bool = False) -> dict[str, torch.Tensor]:
    """Health of `x` (..., K) quantized in 1x128 tiles along K, or of a weight (N, K) in 128x128 blocks."""
    x2d = x.detach().reshape(-1, x.shape[-1]).float()
    if blocks:
        q, scale = quantize_128x128(x2d, fmt, power_of_two)
        deq = dequantize_128x128(q, scale)
    else:
        q, scale = quantize_1x128(x2d, fmt, power_of_two)
        deq = dequantize_1x128(q, scale)
    q32 = q.float()
    nonzero = x2d != 0
    noise = (x2d - deq).square().sum()
    signal = x2d.square().sum()
    return {
        "amax": x2d.abs().max(),
        "underflow": ((q32 == 0) & nonzero).sum() / nonzero.sum().clamp(min=1),
        "at_max": (q32.abs() == fmt.max).float().mean(),
        "snr_db": 10 * torch.log10(signal / noise.clamp(min=torch.finfo(torch.float32).tiny)),
    }
