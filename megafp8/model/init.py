"""Weight initialization: seeded, identical on every rank and device.

Values are drawn in FP32 on the CPU from one generator, in parameter order, then copied to
the parameter's device and dtype, so the same seed gives the same model anywhere.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from megafp8.config import ModelConfig

# Projections that write into the residual stream; scaled so the stream's variance does not grow with depth.
_RESIDUAL_OUTPUTS = ("attn.out_proj.weight", "mlp.down_proj.weight")


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        std = residual_std if name.endswith(_RESIDUAL_OUTPUTS) else cfg.init_std
        values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        param.copy_(values)
