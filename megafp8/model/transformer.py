"""The dense decoder: embedding -> pre-norm blocks (attention, SwiGLU) -> final norm -> untied LM head."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn as nn

from megafp8.config import ConfigError, ModelConfig
from megafp8.model.attention import Attention, head_dim_of
from megafp8.model.mlp import SwiGLU
from megafp8.model.norm import RMSNorm
from megafp8.model.rope import RotaryEmbedding
from megafp8.parallel import ColumnParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy
from megafp8.precision import PrecisionRecipe


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, device=None) -> None:
        super().__init__()
        dtype = recipe.param_dtype
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.attn = Attention(cfg, recipe, device)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size, recipe, device)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model. `cfg.vocab_size` must be resolved (not None) before building."""

    def __init__(self, cfg: ModelConfig, recipe: PrecisionRecipe, max_seq_len: int, device=None) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("resolve model.vocab_size (e.g. from the tokenizer) before building the model")
        self.cfg = cfg
        dtype = recipe.param_dtype
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.rope = RotaryEmbedding(head_dim_of(cfg), max_seq_len, cfg.rope_theta, device)
        self.layers = nn.ModuleList(Block(cfg, recipe, device) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        # The LM head is a precision island: never FP8, whatever the recipe.
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, recipe.high_precision(), device=device)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens: (B, T) int64. Returns the mean loss if `targets` (B, T) is given, else logits (B, T, V)."""
        x = self.embed(tokens)  # (B, T, hidden)
        for layer in self.layers:
            x = layer(x, self.rope)
        logits = self.lm_head(self.final_norm(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets)


def resolve_vocab_size(cfg: ModelConfig, tokenizer_vocab: int) -> ModelConfig:
    """The model config with `vocab_size` set: the tokenizer's, padded, unless configured (and large enough)."""
    if cfg.vocab_size is None:
        multiple = cfg.pad_vocab_to_multiple_of
        return dataclasses.replace(cfg, vocab_size=math.ceil(tokenizer_vocab / multiple) * multiple)
    if cfg.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the data's tokenizer vocabulary ({tokenizer_vocab}): "
            f"set model.vocab_size >= {tokenizer_vocab} or null"
        )
    return cfg
