"""FP32 gradient accumulation in one contiguous buffer, and its data-parallel reduction.

Each parameter gets an FP32 view into the buffer, exposed as `param.main_grad` (the
Megatron convention, which the FP8 linear uses to add its FP32 weight gradient directly). For
every other parameter a post-accumulate hook adds its BF16 gradient into that view after each
backward and frees the BF16 gradient, so micro-batches accumulate in FP32 and no BF16
gradient outlives its backward.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn


class GradBuffer:
    """Flat FP32 gradients of `params`, in the order given."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("GradBuffer needs at least one trainable parameter")
        device = self.params[0].device
        numel = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(numel, dtype=torch.float32, device=device)
        self.main_grads: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            view = self.flat[offset : offset + p.numel()].view_as(p)
            self.main_grads.append(view)
            p.main_grad = view
            offset += p.numel()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(g)) for p, g in zip(self.params, self.main_grads)]

    @staticmethod
    def _make_hook(main_grad: torch.Tensor):
        def accumulate(param: torch.Tensor) -> None:
            if param.grad is None:  # the layer already added its FP32 gradient to main_grad (FP8 linears)
                return
            main_grad.add_(param.grad)
            param.grad = None

        return accumulate

    def zero(self) -> None:
        self.flat.zero_()

    def all_reduce_mean(self, group: Optional[dist.ProcessGroup]) -> None:
        """Average the accumulated gradients over `group` (no-op for a single process)."""
        if group is None:
            return
        size = dist.get_world_size(group)
        if size == 1:
            return
        dist.all_reduce(self.flat, op=dist.ReduceOp.SUM, group=group)
        self.flat.div_(size)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for p in self.params:
            del p.main_grad
