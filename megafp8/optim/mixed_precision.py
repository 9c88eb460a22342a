"""AdamW on FP32 master weights for a model whose weights live in BF16 (or FP32).

The optimizer owns an FP32 master copy of every parameter and reads gradients from the FP32
`GradBuffer`. A step clips the global gradient norm, runs torch's fused AdamW on the masters,
and writes the masters back into the model's weights. Weight decay skips vectors (norm
weights, biases). Data-parallel ranks each hold the full state; the sharded optimizer
replaces this class.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from megafp8.config import OptimizerConfig
from megafp8.parallel import GradBuffer


def _fused_supported(device: torch.device) -> bool:
    return device.type in ("cuda", "cpu")


class MixedPrecisionAdamW:
    """FP32-master AdamW over `named_params`, whose gradients are the views of `grad_buffer`."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], grad_buffer: GradBuffer, cfg: OptimizerConfig):
        if [p for _, p in named_params] != grad_buffer.params:
            raise ValueError("named_params must be the grad buffer's parameters, in the same order")
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.grad_buffer = grad_buffer
        # FP32 parameters are their own masters; lower-precision ones get an FP32 copy.
        self.masters = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        for master, grad in zip(self.masters, grad_buffer.main_grads):
            master.grad = grad
        decay = [m for m in self.masters if m.ndim >= 2]
        no_decay = [m for m in self.masters if m.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        device = self.masters[0].device
        self.inner = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            fused=_fused_supported(device),
        )
        self.max_grad_norm = cfg.grad_clip

    def clip_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (already data-parallel-reduced) gradients, clipped in place; no host sync."""
        norm = torch.linalg.vector_norm(self.grad_buffer.flat, 2)
        if self.max_grad_norm > 0:
            coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            self.grad_buffer.flat.mul_(coef)
        return norm

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        for param, master in zip(self.params, self.masters):
            if param.data_ptr() != master.data_ptr():
                param.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        """Masters by parameter name plus the AdamW state (tensors and plain values only)."""
        return {
            "masters": {name: m for name, m in zip(self.names, self.masters)},
            "adamw": self.inner.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters = state["masters"]
        missing = [n for n in self.names if n not in masters]
        if missing or len(masters) != len(self.names):
            raise ValueError(f"optimizer state does not match the model: missing masters {missing[:5]}")
        for name, master, param in zip(self.names, self.masters, self.params):
            if masters[name].shape != master.shape:
                raise ValueError(f"master weight '{name}' has shape {tuple(masters[name].shape)}, "
                                 f"the model has {tuple(master.shape)}")
            master.copy_(masters[name])
            if param.data_ptr() != master.data_ptr():
                param.copy_(master)
        self.inner.load_state_dict(state["adamw"])
