"""The dense decoder: embedding -> pre-norm blocks (attention, SwiGLU) -> final norm -> untied LM head."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn as nn

from megafp8.config import ConfigError, ModelConfig
from megafp8.model.attention import Attention, head_dim_of
from megafp8.model.mla import MultiHeadLatentAttention
from megafp8.model.mlp import SwiGLU
from megafp8.model.moe import MoE, is_moe_layer
from megafp8.model.mtp import MtpModule, shifted_inputs
from megafp8.model.norm import RMSNorm
from megafp8.model.rope import RotaryEmbedding
from megafp8.parallel import (
    ColumnParallelLinear,
    ExpertParallel,
    TensorParallel,
    VocabParallelEmbedding,
    gather_from_tp_last,
    vocab_parallel_cross_entropy,
)
from megafp8.precision import PrecisionRecipe


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)); the MLP is a SwiGLU or, in MoE layers, a mixture of experts."""

    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, tp: TensorParallel, moe_layer: bool,
                 ep: ExpertParallel, fp8_dispatch: bool, device=None) -> None:
        super().__init__()
        dtype = recipe.param_dtype
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.attn = (MultiHeadLatentAttention(cfg, recipe, tp, device) if cfg.attention == "mla"
                     else Attention(cfg, recipe, tp, device))
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.mlp = (MoE(cfg, recipe, tp, ep, fp8_dispatch, device) if moe_layer
                    else SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size, recipe, tp, device))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, batch: int,
                seq_len: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns the new residual stream and the MoE balance loss (None for a dense MLP)."""
        x = x + self.attn(self.attn_norm(x), rope, batch, seq_len)
        if isinstance(self.mlp, MoE):
            y, aux = self.mlp(self.mlp_norm(x), batch, seq_len)
            return x + y, aux
        return x + self.mlp(self.mlp_norm(x)), None


class Transformer(nn.Module):
    """Decoder-only language model. `cfg.vocab_size` must be resolved (not None) before building.

    The residual stream is token-major, (B*T, hidden); under sequence parallelism each rank holds
    a contiguous 1/tp of those tokens between the tensor-parallel regions."""

    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, max_seq_len: int,
                 tp: Optional[TensorParallel] = None, device=None, ep: Optional[ExpertParallel] = None,
                 fp8_dispatch: bool = False) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("resolve model.vocab_size (e.g. from the tokenizer) before building the model")
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel.single()
        dtype = recipe.param_dtype
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp, device)
        rope_dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else head_dim_of(cfg)
        self.rope = RotaryEmbedding(rope_dim, max_seq_len, cfg.rope_theta, device)
        ep = ep or ExpertParallel.single()
        self.layers = nn.ModuleList(Block(cfg, recipe, tp, is_moe_layer(cfg, i), ep, fp8_dispatch, device)
                                    for i in range(cfg.num_layers))
        # MTP blocks are built like the last main block (MoE if that one is).
        self.mtp = nn.ModuleList(
            MtpModule(cfg, recipe, Block(cfg, recipe, tp, is_moe_layer(cfg, cfg.num_layers - 1), ep, fp8_dispatch,
                                         device), device)
            for _ in range(cfg.mtp_depth))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        # The LM head is a precision island: never FP8, whatever the recipe.
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, recipe.high_precision(), tp, device=device)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens: (B, T) int64. Returns the mean loss if `targets` (B, T) is given (plus the weighted MoE balance
        losses, when enabled), else logits (B, T, V)."""
        batch, seq_len = tokens.shape
        x = self.embed(tokens)  # (B*T, hidden), or this rank's 1/tp of the tokens under SP
        balance_losses = []
        for layer in self.layers:
            x, aux = layer(x, self.rope, batch, seq_len)
            if aux is not None:
                balance_losses.append(aux)
        logits = self.lm_head(self.final_norm(x))  # (B*T, vocab / tp)
        if targets is None:
            return gather_from_tp_last(logits, self.tp).view(batch, seq_len, -1)
        loss = vocab_parallel_cross_entropy(logits, targets, self.tp)
        if self.mtp:
            loss = loss + self.cfg.mtp_loss_weight * self._mtp_loss(x, tokens, targets, balance_losses)
        return loss + sum(balance_losses) if balance_losses else loss

    def _mtp_loss(self, hidden: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor,
                  balance_losses: list[torch.Tensor]) -> torch.Tensor:
        """Mean cross-entropy of the MTP depths (each predicting one more token ahead); appends their balance
        losses to `balance_losses`."""
        batch, seq_len = tokens.shape
        total = torch.zeros((), device=hidden.device)
        for k, module in enumerate(self.mtp, start=1):
            inputs, ahead = shifted_inputs(targets, k)
            hidden, aux = module(hidden, self.embed(inputs), self.rope, batch, seq_len)
            balance_losses.append(aux)
            total = total + vocab_parallel_cross_entropy(self.lm_head(module.out_norm(hidden)), ahead, self.tp)
        return total / len(self.mtp)


def resolve_vocab_size(cfg: ModelConfig, tokenizer_vocab: int, tp_size: int = 1) -> ModelConfig:
    """The model config with `vocab_size` set: the tokenizer's, padded, unless configured (and large enough).
    Under tensor parallelism the padding makes every rank's vocabulary shard a multiple of 128."""
    if cfg.vocab_size is None:
        multiple = cfg.pad_vocab_to_multiple_of
        if tp_size > 1:
            multiple = math.lcm(multiple, 128) * tp_size
        return dataclasses.replace(cfg, vocab_size=math.ceil(tokenizer_vocab / multiple) * multiple)
    if cfg.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the data's tokenizer vocabulary ({tokenizer_vocab}): "
            f"set model.vocab_size >= {tokenizer_vocab} or null"
        )
    return cfg
