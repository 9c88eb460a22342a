"""The precision recipe: a value that says in which dtypes weights live and GEMMs run.

It is passed into every GEMM-bearing layer (no global autocast). The FP8 per-tile recipe
extends this value; BF16 and FP32 are the plain cases.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class PrecisionRecipe:
    """Numerics of one model: parameter/activation dtype and the GEMM used by linears.

    Master weights, optimizer states and gradient accumulation are always FP32 (owned by the
    optimizer); norms, RoPE, softmax and the loss compute in FP32 whatever the recipe.
    """

    name: str
    param_dtype: torch.dtype

    @classmethod
    def from_name(cls, name: str) -> "PrecisionRecipe":
        if name not in _PARAM_DTYPES:
            raise ValueError(f"unknown precision recipe '{name}'; known: {', '.join(_PARAM_DTYPES)}")
        return cls(name=name, param_dtype=_PARAM_DTYPES[name])

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` with `weight` laid out (out_features, in_features), as `nn.Linear`."""
        return F.linear(x, weight)
