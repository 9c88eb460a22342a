"""The base of every GEMM-bearing layer: its precision recipe, FP8 weight cache, FP8 backend and weight-gradient queue.

The tensor-parallel linears and the grouped expert linears (`megafp8.parallel`) differ in how they shard and
multiply, not in how their numerics are switched: that lives here once. The FP8 converter
(`megafp8.model.fp8_converter`) finds GEMM layers by this type and sets each one's recipe; a zero-bubble pipeline
gives each one a `WeightGradQueue`.
"""
from __future__ import annotations

from typing import ClassVar, Optional

import torch
import torch.nn as nn

from megafp8.precision.backends import Fp8Backend, select_backend
from megafp8.precision.bf16_linear import MainGradSlot
from megafp8.precision.formats import TILE
from megafp8.precision.recipe import Fp8Recipe, PrecisionRecipe
from megafp8.precision.weight_cache import Fp8WeightCache
from megafp8.precision.wgrad import WeightGradQueue


class GemmLayer(nn.Module):
    """A layer whose GEMMs follow a precision recipe (BF16, or FP8 per tile). Subclasses create `weight`, laid out
    (..., out_features, in_features) on this rank (stacked experts lead), then call `set_recipe`."""

    weight: nn.Parameter
    keeps_fp8_transpose: ClassVar[bool] = True  # the FP8 weight cache keeps w^T for dgrad (else made per backward)
    # stacked experts, quantized when a micro-batch gives them rows (`Fp8WeightCache.per_expert`)
    quantizes_experts_lazily: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.wgrad_queue: Optional[WeightGradQueue] = None  # set to defer weight gradients (zero-bubble PP)
        self.main_grad_slot = MainGradSlot()  # in BF16, compiled: what the weight gradient is added into

    def set_recipe(self, recipe: PrecisionRecipe, fp8_backend: Optional[Fp8Backend] = None) -> None:
        """Switch this layer's numerics (e.g. keep it in BF16); FP8 needs whole 128-wide tiles. `fp8_backend`: the
        FP8 GEMM backend object to run (None: the one `recipe` names, selected for the input's device on first
        use)."""
        if recipe.fp8 is not None:
            for what, size in (("in_features", self.weight.shape[-1]), ("out_features", self.weight.shape[-2])):
                if size % TILE != 0:
                    raise ValueError(f"an FP8 {type(self).__name__} needs {what} to be a multiple of {TILE}, "
                                     f"got {size}")
        self.recipe = recipe
        self.fp8_cache = (Fp8WeightCache(self.keeps_fp8_transpose and recipe.fp8.keep_weight_transpose,
                                         per_expert=self.quantizes_experts_lazily)
                          if recipe.fp8 is not None else None)
        self._fp8_backend = fp8_backend

    @property
    def runs_fp8(self) -> bool:
        return self.recipe.fp8 is not None

    @property
    def fp8_capable(self) -> bool:
        """Both weight dims are whole FP8 tiles (MLA's kv_a, e.g. 512 + 64 wide, is not)."""
        return all(size % TILE == 0 for size in self.weight.shape[-2:])

    def why_unsupported(self, fp8: Fp8Recipe) -> Optional[str]:
        """Why this layer cannot run the FP8 recipe `fp8` (with what to set instead), or None where it can."""
        return None

    @property
    def fp8_backend(self) -> Optional[Fp8Backend]:
        """The FP8 GEMM backend this layer runs; None until its first FP8 GEMM selects one (unless one was given)."""
        return self._fp8_backend

    def fp8_backend_for(self, device: torch.device) -> Fp8Backend:
        """The FP8 GEMM backend for inputs on `device`: the recipe's, selected once."""
        if self._fp8_backend is None:
            backend = select_backend(self.recipe.fp8.backend, device)
            self.recipe.fp8.check_backend(backend)
            self._fp8_backend = backend
        return self._fp8_backend

    def prepare_for_compiled(self) -> None:
        """Run eagerly before each call of the compiled block holding this layer: quantize the weight if it changed
        since it was last quantized (traced FP8 layers then read the cache instead of quantizing in every forward),
        or, in BF16, point the layer at a fresh alias of its FP32 `main_grad` (`MainGradSlot`)."""
        if not self.runs_fp8:
            self.main_grad_slot.refresh(self.weight)
        else:
            fp8 = self.recipe.fp8
            self.fp8_cache.prepare(self.weight, self.fp8_backend_for(self.weight.device), fp8.fmt,
                                   fp8.power_of_two_scales)
