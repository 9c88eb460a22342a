"""FP8 formats and their largest finite values.

E4M3 (`float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, no infinities) holds magnitudes up to
448 with ~2^-4 relative precision; E5M2 trades a mantissa bit for range (up to 57344) and is
an option for gradients. A tile's scale maps its max-abs onto the format's maximum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn: 1.75 * 2^8
E5M2_MAX = 57344.0  # largest finite float8_e5m2: 1.75 * 2^15
TILE = 128  # edge of a quantization tile: 1x128 for activations/gradients, 128x128 for weights
# Smallest max-abs a nonzero tile is scaled for. Below it FP8_MAX / amax would overflow FP32 (448 / 1e-37 > 3.4e38)
# and turn zeros into nan; tiles whose values are all under 2^-100 lose precision instead (they are ~0 anyway).
MIN_AMAX = 2.0**-100


@dataclass(frozen=True)
class Fp8Format:
    name: str
    dtype: torch.dtype
    max: float


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, E4M3_MAX)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, E5M2_MAX)
FORMATS = {f.name: f for f in (E4M3, E5M2)}
