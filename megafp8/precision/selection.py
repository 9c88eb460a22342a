"""`precision.recipe: auto`: the recipe the hardware supports best, and why."""
from __future__ import annotations

from typing import Optional

import torch


def choose_recipe(capability: Optional[tuple[int, int]], cpu_recipe: str) -> tuple[str, str]:
    """(recipe, reason) for a CUDA compute capability, or for the CPU (capability None)."""
    if capability is None:
        return cpu_recipe, f"no GPU: precision.auto_cpu_recipe={cpu_recipe}"
    sm = f"SM{capability[0]}{capability[1]}"
    if capability < (8, 0):
        return "fp16", f"{sm} has no BF16: FP16 with dynamic loss scaling"
    if capability < (9, 0):
        return "bf16", f"{sm} has BF16 but no blockwise-scaled FP8 GEMMs"
    return "fp8", f"{sm} runs per-tile FP8 GEMMs"


def resolve_recipe(name: str, device: torch.device, cpu_recipe: str) -> tuple[str, str]:
    """The configured recipe, or for `auto` the one `choose_recipe` picks for `device`."""
    if name != "auto":
        return name, "configured"
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose_recipe(capability, cpu_recipe)
