"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama), applied in FP32."""
from __future__ import annotations

import torch
import torch.nn as nn


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables of shape (max_seq_len, head_dim) as FP32 non-persistent buffers."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, device=None) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = self._tables(device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim))
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32, device=device), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim)
        return angles.cos(), angles.sin()

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: (B, T, n_heads, head_dim), k: (B, T, n_kv_heads, head_dim) -> rotated, same dtypes."""
        seq_len = q.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence of {seq_len} tokens exceeds the RoPE table ({self.max_seq_len}); raise data.seq_len")
        cos = self.cos[:seq_len, None, :]  # (T, 1, head_dim)
        sin = self.sin[:seq_len, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos + rotated * sin).type_as(x)
