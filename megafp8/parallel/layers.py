"""Parallel-aware GEMM-bearing layers (Megatron style) and the vocab-parallel loss.

Column-parallel linears split their output features across tensor-parallel ranks and
row-parallel linears split their input features; at tensor-parallel size 1, which is all
this release runs, both are plain GEMMs. Under an FP8 recipe their GEMMs are the per-tile FP8
linear of `megafp8.precision`, with the layer's quantized-weight cache. The model is written
against these classes so that tensor/expert parallelism and FP8 change the layers, not the model.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megafp8.precision import TILE, Fp8Backend, Fp8WeightCache, PrecisionRecipe, fp8_linear, select_backend


class ParallelLinear(nn.Module):
    """A bias-free linear whose GEMMs follow the precision recipe; weight is (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, recipe: PrecisionRecipe, device=None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=recipe.param_dtype, device=device))
        self.set_recipe(recipe)

    def set_recipe(self, recipe: PrecisionRecipe) -> None:
        """Switch this layer's numerics (e.g. keep it in BF16); FP8 needs 128-aligned dims."""
        if recipe.fp8 is not None:
            for what, size in (("in_features", self.in_features), ("out_features", self.out_features)):
                if size % TILE != 0:
                    raise ValueError(f"an FP8 linear needs {what} to be a multiple of {TILE}, got {size}")
        self.recipe = recipe
        self.fp8_cache = Fp8WeightCache() if recipe.fp8 is not None else None
        self._fp8_backend: Fp8Backend | None = None

    @property
    def runs_fp8(self) -> bool:
        return self.recipe.fp8 is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fp8 = self.recipe.fp8
        if fp8 is None:
            return F.linear(x, self.weight)
        if self._fp8_backend is None:
            self._fp8_backend = select_backend(fp8.backend, x.device)
        return fp8_linear(x, self.weight, self.fp8_cache, fp8.gemm_config, self._fp8_backend)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8={self.runs_fp8}"


class ColumnParallelLinear(ParallelLinear):
    """Output features split across tensor-parallel ranks (QKV, MLP up/gate, LM head)."""


class RowParallelLinear(ParallelLinear):
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
