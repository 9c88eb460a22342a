"""Weight initialization: seeded, identical on every rank and device.

Each parameter is drawn in FP32 on the CPU at its full (unsharded) shape, from a generator
seeded by the run seed and the parameter's name; a tensor-parallel rank keeps its shard, an
expert-parallel rank its experts. The result is copied to the parameter's device and dtype. So
the same seed gives the same model at any TP, EP or pipeline split, anywhere: a pipeline stage
holding `layers.7` draws exactly what a single-rank model draws for it.
"""
from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn

from megafp8.config import ModelConfig
from megafp8.parallel import TensorParallel, full_shape, local_piece

# Projections that write into the residual stream; scaled so the stream's variance does not grow with depth.
_RESIDUAL_OUTPUTS = ("attn.out_proj.weight", "down_proj.weight")  # MLP, shared and routed experts


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int, tp: Optional[TensorParallel] = None) -> None:
    tp = tp or TensorParallel.single()
    residual_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if name.endswith("_bias"):  # the attention's QKV bias starts at zero (Qwen2's does)
            param.zero_()
            continue
        std = residual_std if name.endswith(_RESIDUAL_OUTPUTS) else cfg.init_std
        # The CPU generator keeps 32 bits of its seed: hash the run seed and the name together into them.
        draw_from = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        values = torch.empty(full_shape(param), dtype=torch.float32).normal_(0.0, std, generator=draw_from)
        param.copy_(local_piece(values, param, tp))
