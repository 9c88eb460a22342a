"""How a parameter is cut across ranks: the one table that init, checkpoints and clipping read.

Stacked routed-expert weights (local experts, ...) carry an expert slice instead: which experts of
how many this expert-parallel rank holds. `gather_param` and `local_piece` handle both kinds.

A sharded parameter carries a `TpShard` (as `param.tp_shard`): the dimension it is split on
and, for fused weights, the sizes of the parts stacked along that dimension. Each part is split
evenly, so rank r holds the r-th chunk of every part (a fused QKV weight `[q; k; v]` becomes
`[q_r; k_r; v_r]`, so each rank computes whole heads). Parameters without one are replicated
across the tensor-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megafp8.parallel.dims import ExpertParallel, TensorParallel


@dataclass(frozen=True)
class TpShard:
    dim: int  # the dimension split across tensor-parallel ranks
    parts: tuple[int, ...]  # full sizes of the fused parts along `dim` (one part for a plain weight)

    def local_parts(self, tp_size: int) -> list[int]:
        return [p // tp_size for p in self.parts]


def tp_shard_of(param: torch.Tensor) -> Optional[TpShard]:
    return getattr(param, "tp_shard", None)


def mark_sharded(param: torch.nn.Parameter, spec: TpShard) -> None:
    param.tp_shard = spec


def full_shape(local: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The unsharded shape of a (possibly sharded) parameter: TP shards joined, and for stacked routed-expert
    weights every expert (not only this expert-parallel rank's)."""
    spec = tp_shard_of(local)
    shape = list(local.shape)
    if spec is not None:
        shape[spec.dim] = sum(spec.parts)
    expert_slice = getattr(local, "expert_slice", None)
    if expert_slice is not None:
        shape[0] = expert_slice[1]
    return tuple(shape)


def shard_of(full: torch.Tensor, spec: Optional[TpShard], tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's piece of the unsharded tensor `full`."""
    if spec is None or tp_size == 1:
        return full
    pieces = []
    for part in full.split(list(spec.parts), dim=spec.dim):
        pieces.append(part.chunk(tp_size, dim=spec.dim)[tp_rank])
    return torch.cat(pieces, dim=spec.dim)


def gather_full(local: torch.Tensor, spec: Optional[TpShard], tp: TensorParallel) -> torch.Tensor:
    """The unsharded tensor from every rank's `local` piece (collective over the TP group)."""
    if spec is None or not tp.enabled:
        return local
    pieces = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(pieces, local.contiguous(), group=tp.group)
    per_rank = [piece.split(spec.local_parts(tp.size), dim=spec.dim) for piece in pieces]
    return torch.cat([per_rank[r][i] for i in range(len(spec.parts)) for r in range(tp.size)], dim=spec.dim)


def mark_expert(param: torch.nn.Parameter, first_expert: int, num_experts: int) -> None:
    """Tag stacked routed-expert weights (local experts, ...): experts [first, first + len) of `num_experts`."""
    param.expert_slice = (first_expert, num_experts)


def is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "expert_slice", None) is not None


def gather_experts(local: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """Every expert's slice of a stacked expert tensor, in expert order (collective over the EP group)."""
    if not ep.enabled:
        return local
    pieces = [torch.empty_like(local) for _ in range(ep.size)]
    dist.all_gather(pieces, local.contiguous(), group=ep.group)
    return torch.cat(pieces)


def local_experts_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's experts' rows of a full stacked expert tensor (any other tensor: unchanged)."""
    if not is_expert(param):
        return full
    first, _ = param.expert_slice
    return full[first : first + param.shape[0]]


def gather_param(local: torch.Tensor, param: torch.Tensor, tp: TensorParallel, ep: ExpertParallel) -> torch.Tensor:
    """The full tensor of `param` from every rank's `local` piece of it (collective over EP or TP)."""
    if is_expert(param):
        return gather_experts(local, ep)
    return gather_full(local, tp_shard_of(param), tp)


def local_piece(full: torch.Tensor, param: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's piece of `param`'s full tensor: its TP shard, or its experts' rows."""
    return local_experts_of(shard_of(full, tp_shard_of(param), tp.rank, tp.size), param)
