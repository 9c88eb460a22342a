"""Auxiliary-loss-free MoE balancing across ranks, as a hook after every optimizer step.

Each router counts the tokens it sends to each expert during a step (an MTP block's router leaves out the positions
whose target lies past the sample). After the optimizer step (applied or
skipped), the counts are summed over every rank that routed distinct tokens and each router's selection bias
moves toward balance (DeepSeek-V3's bias update), only where the step was applied. Every rank then holds the
same loads and biases. The loads of the last step also feed the metrics record (`record`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from megafp8.config import MoeConfig
from megafp8.model.moe import Router, expert_load_stats, routers
from megafp8.optim import DistributedAdamW
from megafp8.parallel import ParallelDims


class ExpertBalance:
    """The routers of this rank's MoE layers (a pipeline stage may hold none), their global loads and biases."""

    def __init__(self, model_routers: list[Router], moe: MoeConfig, dims: ParallelDims) -> None:
        self.routers, self.dims = model_routers, dims
        self.rate, self.num_experts, self.top_k = moe.bias_update_rate, moe.num_experts, moe.top_k
        self.loads: Optional[torch.Tensor] = None  # (MoE layers, experts) of the last step, summed over ranks

    @classmethod
    def attach(cls, model: torch.nn.Module, optimizer: DistributedAdamW, moe: MoeConfig,
               dims: ParallelDims) -> "ExpertBalance":
        """Balance the routers of `model` (whose mixture of experts is `moe`) after every step of `optimizer`."""
        balance = cls([router for _, router in routers(model)], moe, dims)
        optimizer.register_step_post_hook(balance)
        return balance

    def __call__(self, applied: Optional[torch.Tensor]) -> None:
        """Sum this step's expert loads over every rank holding distinct tokens, then (where the step was `applied`)
        move each router's selection bias toward balance."""
        if not self.routers:
            return
        loads = torch.stack([router.load for router in self.routers])  # (MoE layers, experts)
        for router in self.routers:
            router.load.zero_()
        if self.dims.dp_group is not None:
            dist.all_reduce(loads, group=self.dims.dp_group)
        tp = self.dims.tensor_parallel
        if tp.sp:  # TP ranks routed different tokens
            dist.all_reduce(loads, group=tp.group)
        if self.rate > 0:
            for router, load in zip(self.routers, loads):
                router.update_bias(load, self.rate, applied)
        self.loads = loads

    def record(self, tokens_per_step: int, seq_len: int) -> dict[str, Any]:
        """Expert balance of the last step over every MoE layer: load spread, bias size, and assignments not
        dispatched (must be 0: each router counts top_k for each token of the step's sequences of `seq_len`, but
        their last `uncounted_tail`). Collective over the pipeline group (each stage holds some MoE layers)."""
        loads = self.loads.cpu() if self.loads is not None else torch.zeros(0, self.num_experts)
        bias = max((r.expert_bias.abs().max().item() for r in self.routers), default=0.0)
        sequences = tokens_per_step // seq_len
        routed = sum(self.top_k * (tokens_per_step - sequences * r.uncounted_tail) for r in self.routers)
        if self.dims.pp_group is not None:
            stages: list[Any] = [None] * self.dims.pp
            dist.all_gather_object(stages, (loads, bias, routed), group=self.dims.pp_group)
            loads, bias, routed = (torch.cat([s[0] for s in stages]), max(s[1] for s in stages),
                                   sum(s[2] for s in stages))
        return {**expert_load_stats(loads), "moe_bias_abs_max": bias,
                "moe_dropped_tokens": int(routed - loads.sum().item())}
