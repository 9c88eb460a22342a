"""Multi-token prediction (DeepSeek-V3): sequential modules that predict tokens further ahead.

Module k (1..D) combines, at every position i, the previous depth's hidden state (the main model's
for k = 1) with the embedding of token i + k, and runs one transformer block:

    h_k = Block(W_k [RMSNorm(h_{k-1}); RMSNorm(Emb(t_{i+k}))])
    logits_k = Head(RMSNorm_k(h_k))    predicts t_{i+k+1}

The embedding and the output head are the main model's (shared). The training loss adds
`mtp_loss_weight / D x sum_k CE_k`; positions whose target lies beyond the sample are ignored. The
combining projection W_k is small and replicated over TP (under sequence parallelism its gradient is
summed over TP like the norms').
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from megafp8.config import ModelConfig
from megafp8.model.norm import RMSNorm
from megafp8.parallel import IGNORE_INDEX, ColumnParallelLinear
from megafp8.precision import PrecisionRecipe


class LossTerms(NamedTuple):
    """The losses of a training forward: `total` = `lm` + mtp_loss_weight x `mtp`, the one backward starts from."""

    total: torch.Tensor
    lm: torch.Tensor  # the main head's mean cross-entropy: the language-modelling loss, as validation measures it
    mtp: torch.Tensor  # the MTP depths' mean cross-entropy, unweighted (0 without MTP)


class MtpModule(nn.Module):
    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, block: nn.Module, device=None) -> None:
        super().__init__()
        dtype = recipe.param_dtype
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.combine_proj = ColumnParallelLinear(2 * cfg.hidden_size, cfg.hidden_size, recipe, device=device)
        self.block = block
        self.out_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: nn.Module, batch: int,
                seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, embedded: (tokens, hidden_size). Returns (this depth's hidden states, balance loss)."""
        x = self.combine_proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(embedded)], dim=-1))
        x, aux = self.block(x, rope, batch, seq_len)
        return x, (aux if aux is not None else x.new_zeros((), dtype=torch.float32))


def shifted_inputs(targets: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth k's inputs t_{i+k} and targets t_{i+k+1}, from the sample's targets t_1..t_T (B, T).

    Positions past T - k have no input token in the sample; they repeat the last one. The block is causal and
    those positions' targets (past the sample too) are ignored, so the filler reaches no loss."""
    filler = targets[:, -1:].expand(-1, k - 1)
    inputs = torch.cat([targets[:, k - 1:], filler], dim=1)
    ahead = torch.cat([targets[:, k:], targets.new_full((targets.shape[0], k), IGNORE_INDEX)], dim=1)
    return inputs, ahead

