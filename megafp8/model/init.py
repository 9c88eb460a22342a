"""Weight initialization: seeded, identical on every rank and device.

Values are drawn in FP32 on the CPU from one generator, in parameter order and at each
parameter's full (unsharded) shape; a tensor-parallel rank keeps its shard. The result is copied
to the parameter's device and dtype, so the same seed gives the same model at any TP, anywhere.
Stacked routed-expert weights are drawn for every expert from a generator seeded by the run seed
and the parameter's name, and each expert-parallel rank keeps its experts: an expert starts the same
whichever rank holds it.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn

from megafp8.config import ModelConfig
from megafp8.parallel import TensorParallel, full_shape, is_expert, local_piece

# Projections that write into the residual stream; scaled so the stream's variance does not grow with depth.
_RESIDUAL_OUTPUTS = ("attn.out_proj.weight", "down_proj.weight")  # MLP, shared and routed experts


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int, tp: Optional[TensorParallel] = None) -> None:
    tp = tp or TensorParallel.single()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        std = residual_std if name.endswith(_RESIDUAL_OUTPUTS) else cfg.init_std
        draw_from = generator
        if is_expert(param):
            draw_from = torch.Generator(device="cpu").manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
        values = torch.empty(full_shape(param, tp.size), dtype=torch.float32).normal_(0.0, std, generator=draw_from)
        param.copy_(local_piece(values, param, tp))
