"""Numerics: FP8 formats, per-tile quantizers, the FP8 linear, GEMM backends and the precision recipe."""
from megafp8.precision.backends import BACKENDS, Fp8Backend, select_backend, why_unavailable
from megafp8.precision.formats import E4M3, E4M3_MAX, E5M2, E5M2_MAX, FORMATS, TILE, Fp8Format
from megafp8.precision.fp8_linear import Fp8GemmConfig, Fp8WeightCache, LinearComm, WeightGradQueue, fp8_linear, linear
from megafp8.precision.loss_scale import DynamicLossScaler
from megafp8.precision.recipe import Fp8Recipe, PrecisionRecipe
from megafp8.precision.selection import choose_recipe, resolve_recipe

__all__ = [
    "BACKENDS", "DynamicLossScaler", "choose_recipe", "resolve_recipe", "E4M3", "E4M3_MAX", "E5M2", "E5M2_MAX", "FORMATS", "Fp8Backend", "Fp8Format", "Fp8GemmConfig",
    "Fp8Recipe", "Fp8WeightCache", "LinearComm", "PrecisionRecipe", "TILE", "WeightGradQueue", "fp8_linear", "linear", "select_backend", "why_unavailable",
]
