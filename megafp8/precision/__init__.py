"""Numerics: FP8 formats, per-tile quantizers, the FP8 layers, GEMM backends and the precision recipe."""
from megafp8.precision.backends import (
    Fp8Backend, QuantizedWeight, backend_names, check_backend_name, common_choice, passed_over, select_backend,
    why_unavailable,
)
from megafp8.precision.bf16_linear import MainGradSlot, linear
from megafp8.precision.formats import E4M3, E4M3_MAX, E5M2, E5M2_MAX, FORMATS, TILE, Fp8Format
from megafp8.precision.fp8_linear import InputNorm, fp8_linear, fuses_norm
from megafp8.precision.fp8_mlp import Fp8Projection, MlpObserver, fp8_swiglu_mlp
from megafp8.precision.fp8_qkv import Rotary, fp8_qkv_rope
from megafp8.precision.gemm_layer import GemmLayer
from megafp8.precision.linear_comm import LinearComm
from megafp8.precision.loss_scale import DynamicLossScaler
from megafp8.precision.recipe import Fp8Recipe, PrecisionRecipe
from megafp8.precision.selection import choose_recipe, resolve_recipe
from megafp8.precision.weight_cache import Fp8WeightCache
from megafp8.precision.wgrad import WeightGradQueue

__all__ = [
    "DynamicLossScaler", "E4M3", "E4M3_MAX", "E5M2", "E5M2_MAX", "FORMATS", "Fp8Backend", "Fp8Format",
    "Fp8Projection", "Fp8Recipe", "Fp8WeightCache", "GemmLayer", "InputNorm", "LinearComm", "MainGradSlot",
    "MlpObserver", "PrecisionRecipe", "QuantizedWeight", "Rotary",
    "TILE", "WeightGradQueue", "backend_names", "check_backend_name", "choose_recipe", "common_choice", "fp8_linear",
    "fp8_qkv_rope", "fp8_swiglu_mlp", "fuses_norm", "linear", "passed_over", "resolve_recipe", "select_backend",
    "why_unavailable",
]
