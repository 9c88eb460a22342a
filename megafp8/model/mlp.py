"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel GEMM."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megafp8.model.norm import RMSNorm
from megafp8.parallel import ColumnParallelLinear, RowParallelLinear, TensorParallel, swiglu_mlp
from megafp8.precision import MlpObserver, PrecisionRecipe


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, recipe: PrecisionRecipe, tp: TensorParallel,
                 device=None) -> None:
        super().__init__()
        # Weight rows are [gate; up], each ffn_hidden_size long; each rank holds [gate_r; up_r]. A weight that is not
        # whole 128x128 tiles stays out of FP8 (DeepSeek-V2-Lite's 10944-wide FFN: down_proj).
        local = ffn_hidden_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(hidden_size, 2 * ffn_hidden_size,
                                                 recipe.for_weight(2 * local, hidden_size), tp,
                                                 parts=(ffn_hidden_size, ffn_hidden_size), device=device)
        self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, recipe.for_weight(hidden_size, local), tp,
                                           device=device)
        # Set by the FP8 health monitor for a sampled step (eager only): sees the fused FP8 MLP's inner tensors.
        self.observer: Optional[MlpObserver] = None

    def forward(self, x: torch.Tensor, norm: Optional[RMSNorm] = None) -> torch.Tensor:
        """x (tokens, hidden) -> (tokens, hidden); `norm` is applied to x first. Under FP8 the norm, SwiGLU and
        SwiGLU's backward each quantize their own output for the next GEMM (`megafp8.parallel.swiglu_mlp`)."""
        return swiglu_mlp(x, self.gate_up_proj, self.down_proj, norm, self.observer)
