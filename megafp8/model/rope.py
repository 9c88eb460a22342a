"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama), applied in FP32, with optional
frequency scaling for long contexts (`model.rope_scaling`: YaRN as DeepSeek-V2/V3 ship it, Llama-3.1's `llama3`).

The scaled frequencies follow `transformers`' `modeling_rope_utils` step for step (same FP32 operations), so a
converted checkpoint computes what it computed there. YaRN also scales cos/sin by its attention factor, and MLA's
softmax scale by `softmax_mscale` (DeepSeek's attention does; `transformers`' DeepSeek models too).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from megafp8.config import RopeScalingConfig
from megafp8.precision.producers import rotate


def settle_cpu_vector_math() -> None:
    """Make MKL's vector-math library (what torch's CPU build runs for cos, sin, exp, erf, ... of contiguous FP32
    and FP64 tensors) pick its CPU-specific kernels on one thread, before any multi-threaded call.

    MKL fills that choice in lazily, on its first call in the process, with two unsynchronised stores to one static
    (the CPU's raw code, then its remapped index). An OpenMP thread that reads it between them runs a kernel of
    ~11-bit accuracy for its part of the tensor. In torch 2.13's CPU build (MKL BLAS, two threads) the first such call
    of a training process was the RoPE table's `cos`, so now and then the first model built in a process had rows
    32-63 of its 64-row cos table wrong by up to 1.5e-4 and the run did not repeat to the bit (a paused thread in
    gdb reproduces it every time; `tests/test_rope.py` checks that this call comes first). One call on one element
    runs on the calling thread alone and settles the choice for the whole process; it costs microseconds."""
    torch.ones(1).cos()


settle_cpu_vector_math()  # on import: before this module's tables, or anything after it, calls MKL in parallel


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(factor) + 1 (1 when not extending)."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def attention_factor(scaling: RopeScalingConfig) -> float:
    """The factor cos/sin are multiplied by (YaRN's; 1 otherwise)."""
    if scaling.type != "yarn":
        return 1.0
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def softmax_mscale(scaling: RopeScalingConfig) -> float:
    """MLA under YaRN: the softmax scale is multiplied by this squared (DeepSeek-V2/V3's `mscale_all_dim`)."""
    if scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim)


def describe_rope(theta: float, scaling: RopeScalingConfig) -> str:
    """The RoPE settings in words, for start-up and planning lines: `RoPE theta 10000, yarn x40 from 4096 tokens`."""
    text = f"RoPE theta {theta:g}"
    if scaling.type != "none":
        text += f", {scaling.type} x{scaling.factor:g} from {scaling.original_max_position_embeddings} tokens"
    return text


def _yarn(pos_freqs: torch.Tensor, dim: int, theta: float, s: RopeScalingConfig) -> torch.Tensor:
    """Dims turning more than beta_fast times over the original context keep their frequency, fewer than beta_slow
    are interpolated (divided by `factor`), a linear ramp between (bounds floored/ceiled, as `truncate`)."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(pos_freqs.device)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return 1.0 / (s.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def _llama3(inv_freq: torch.Tensor, s: RopeScalingConfig) -> torch.Tensor:
    """Long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor -
                                                                                   s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScalingConfig] = None,
                        device=None) -> torch.Tensor:
    """(head_dim / 2,) FP32 rotation frequencies, scaled as `scaling` says."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if scaling is not None and scaling.type == "yarn":
        return _yarn(pos_freqs, head_dim, theta, scaling)
    inv_freq = 1.0 / pos_freqs
    return _llama3(inv_freq, scaling) if scaling is not None and scaling.type == "llama3" else inv_freq


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables of shape (max_seq_len, head_dim) as FP32 non-persistent buffers: of positions 0, 1, ...
    of the sequence, or of the given `positions` (a context-parallel rank's tokens, in its order), whose table
    rows then stand for the rank's local tokens 0, 1, ..."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, device=None,
                 scaling: Optional[RopeScalingConfig] = None, positions: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.scaling = scaling or RopeScalingConfig()
        cos, sin = self._tables(device)
        if positions is not None:
            cos, sin = cos[positions.to(cos.device)], sin[positions.to(sin.device)]
            self.max_seq_len = len(positions)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.device(device or "cpu").type == "meta":  # shapes only: meta's arange would import torch's compiler
            shape = (self.max_seq_len, self.head_dim)
            return torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling, device)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim)
        magnitude = attention_factor(self.scaling)
        if magnitude == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * magnitude, angles.sin() * magnitude

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, T, n_heads, head_dim), k: (B, T, n_kv_heads, head_dim) -> rotated, same dtypes."""
        cos, sin = self.tables(q.shape[1])
        cos, sin = cos[:, None, :], sin[:, None, :]  # (T, 1, head_dim)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    def tables(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the first `seq_len` positions, (seq_len, head_dim) FP32 each."""
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence of {seq_len} tokens exceeds the RoPE table ({self.max_seq_len}); raise "
                             "data.seq_len")
        return self.cos[:seq_len], self.sin[:seq_len]
