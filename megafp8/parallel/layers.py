"""Parallel-aware GEMM-bearing layers (Megatron style) and the vocab-parallel loss.

Column-parallel linears split their output features across tensor-parallel ranks and
row-parallel linears split their input features; at tensor-parallel size 1, which is all
this release runs, both are plain GEMMs through the precision recipe. The model is written
against these classes so that tensor/expert parallelism and FP8 change the layers, not the model.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megafp8.precision import PrecisionRecipe


class _Linear(nn.Module):
    """A bias-free linear whose GEMM is chosen by the precision recipe; weight is (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, recipe: PrecisionRecipe, device=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.recipe = recipe
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=recipe.param_dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.recipe.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe.name}"


class ColumnParallelLinear(_Linear):
    """Output features split across tensor-parallel ranks (QKV, MLP up/gate, LM head)."""


class RowParallelLinear(_Linear):
    """Input features split across tensor-parallel ranks; its output is reduced (attention out, MLP down)."""


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split across tensor-parallel ranks (one shard at TP=1)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, dtype=dtype, device=device))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy, computed in FP32 whatever the logits' dtype. logits: (..., V), targets: (...)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
