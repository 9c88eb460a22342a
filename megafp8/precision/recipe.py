"""The precision recipe: a value that says in which dtypes weights live and which GEMMs run in FP8.

It is passed into every GEMM-bearing layer (no global autocast) and down to the kernels: `Fp8Recipe` is the one
type that carries the FP8 settings from the config to the backend. Master weights, optimizer states and gradient
accumulation are always FP32 (owned by the optimizer); norms, RoPE, the attention softmax and the loss compute in
FP32 whatever the recipe; the embedding and LM head never run FP8 (`high_precision()` gives their recipe).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megafp8.config import ConfigError, PrecisionConfig
from megafp8.precision.backends import Fp8Backend, check_backend_name
from megafp8.precision.formats import FORMATS, TILE, Fp8Format

_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Fp8Recipe:
    """DeepSeek-V3-style per-tile FP8: activations and gradients in 1x128 tiles, weights in 128x128 blocks."""

    format: str = "e4m3"  # activations and weights
    grad_format: str = "e4m3"  # activation gradients (e5m2 trades precision for range)
    power_of_two_scales: bool = False
    fprop: bool = True
    dgrad: bool = True
    wgrad: bool = True
    backend: str = "auto"
    # Keep each FP8 weight's transpose (what dgrad reads) for the weight's version; by default make it in each
    # backward from the kept FP8 weight (the same bits; one byte a parameter less held, one transpose per backward).
    keep_weight_transpose: bool = False
    # Opt-in, a departure from DeepSeek-V3's recipe: the weight gradient's input x quantized in 128x128 blocks
    # (features x tokens) instead of 1x128 tiles along the tokens, where a row + column quantizer makes it (RMSNorm's
    # output, an FP8 linear's own input, the MoE dispatch) and the dense MLP's SwiGLU output (its blocks' maxima from
    # the forward's tile maxima); the experts' SwiGLU output keeps its tiles. The wgrad GEMM then promotes as fprop
    # does (`docs/precision.md`).
    wgrad_input_blocks: bool = False

    def __post_init__(self) -> None:
        for what, name in (("format", self.format), ("grad_format", self.grad_format)):
            if name not in FORMATS:
                raise ConfigError(f"FP8 {what} {name!r} is not one of {', '.join(FORMATS)}")
        check_backend_name(self.backend)

    @property
    def fmt(self) -> Fp8Format:
        return FORMATS[self.format]

    @property
    def grad_fmt(self) -> Fp8Format:
        return FORMATS[self.grad_format]

    def check_backend(self, backend: Fp8Backend) -> None:
        """Refuse a backend this recipe cannot run on (a `ConfigError` saying what to change)."""
        if self.wgrad_input_blocks and not backend.wgrad_input_blocks:
            raise ConfigError(f"precision.fp8_wgrad_input_blocks: the {backend.name} backend's weight-gradient GEMMs "
                              "read x in 1x128 tiles only; use precision.fp8_backend=hopper or deepgemm (SM90 with "
                              "Triton's Gluon; `auto` picks one of them there) or reference, or set "
                              "precision.fp8_wgrad_input_blocks to false")

    @property
    def all_gemms(self) -> bool:
        """All three GEMMs (fprop, dgrad, wgrad) in FP8: what the fused FP8 paths and grouped experts need."""
        return self.fprop and self.dgrad and self.wgrad


@dataclass(frozen=True)
class PrecisionRecipe:
    """Numerics of one model: parameter/activation dtype and, for FP8 layers, the FP8 recipe."""

    name: str
    param_dtype: torch.dtype
    fp8: Optional[Fp8Recipe] = None

    @classmethod
    def from_name(cls, name: str, fp8: Optional[Fp8Recipe] = None) -> "PrecisionRecipe":
        if name not in _PARAM_DTYPES:
            raise ValueError(f"unknown precision recipe '{name}'; known: {', '.join(_PARAM_DTYPES)}")
        if name == "fp8":
            return cls(name, _PARAM_DTYPES[name], fp8 or Fp8Recipe())
        return cls(name, _PARAM_DTYPES[name])

    @classmethod
    def from_config(cls, cfg: PrecisionConfig, name: Optional[str] = None) -> "PrecisionRecipe":
        """The recipe of `cfg` (`name` overrides `cfg.recipe`, e.g. once `auto` is resolved)."""
        name = name or cfg.recipe
        fp8 = Fp8Recipe(grad_format=cfg.fp8_grad_format, power_of_two_scales=cfg.fp8_power_of_two_scales,
                        fprop=cfg.fp8_fprop, dgrad=cfg.fp8_dgrad, wgrad=cfg.fp8_wgrad, backend=cfg.fp8_backend,
                        keep_weight_transpose=cfg.fp8_keep_weight_transpose,
                        wgrad_input_blocks=cfg.fp8_wgrad_input_blocks)
        return cls.from_name(name, fp8 if name == "fp8" else None)

    def high_precision(self) -> "PrecisionRecipe":
        """The same recipe without FP8: for precision islands and layers kept in BF16."""
        return dataclasses.replace(self, fp8=None)

    def for_weight(self, *dims: int) -> "PrecisionRecipe":
        """This recipe for a GEMM weight with these (local) dims, without FP8 unless each is a multiple of the
        128-wide tile (e.g. MLA's kv_a at 512 + 64 rows, DeepSeek-V2-Lite's 10944-wide dense FFN)."""
        return self if all(d % TILE == 0 for d in dims) else self.high_precision()
