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


def mark_tp_partial(param: torch.nn.Parameter) -> None:
    """`param` is replicated over the tensor-parallel ranks, but each rank's gradient of it comes from its own heads
    only (a weight every head shares, as the query/key norms'): the gradients are summed over the TP group."""
    param.tp_partial = True


def is_tp_partial(param: torch.Tensor) -> bool:
    return getattr(param, "tp_partial", False)


def full_shape(local: torch.Tensor) -> tuple[int, ...]:
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


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def global_boxes(param: torch.Tensor, tp_rank: int, tp_size: int, offsets: tuple[int, ...],
                 sizes: tuple[int, ...]) -> list[tuple[tuple[int, ...], Box]]:
    """Where a box of this rank's piece of `param` (local `offsets`, `sizes`) lies in the full tensor, as
    (global offsets, (local offsets, sizes)) pairs: a box crossing fused parts of a TP shard is cut at them."""
    spec = tp_shard_of(param)
    pieces = [(list(offsets), list(sizes))]
    if spec is not None and tp_size > 1:
        d, pieces = spec.dim, []
        local_start, full_start = 0, 0
        for part in spec.parts:
            local_size = part // tp_size
            lo, hi = max(offsets[d], local_start), min(offsets[d] + sizes[d], local_start + local_size)
            if lo < hi:
                box_offsets, box_sizes = list(offsets), list(sizes)
                box_offsets[d], box_sizes[d] = lo, hi - lo
                pieces.append((box_offsets, box_sizes))
            local_start += local_size
            full_start += part
    out = []
    for box_offsets, box_sizes in pieces:
        where = list(box_offsets)
        if spec is not None and tp_size > 1:
            d, local_start, full_start = spec.dim, 0, 0
            for part in spec.parts:  # the part holding this box: shift from its local to its global rows
                local_size = part // tp_size
                if local_start <= box_offsets[d] < local_start + local_size:
                    where[d] = full_start + tp_rank * local_size + (box_offsets[d] - local_start)
                    break
                local_start += local_size
                full_start += part
        if is_expert(param):
            where[0] += param.expert_slice[0]
        out.append((tuple(where), (tuple(box_offsets), tuple(box_sizes))))
    return out


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """Elements [start, end) of a row-major tensor of `shape` as boxes, each one contiguous in memory, in order
    (a partial first row, whole rows, a partial last row, recursively)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = 1
    for size in shape[1:]:
        inner *= size
    first, last = start // inner, (end - 1) // inner

    def within(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo, hi)]

    if first == last:
        return within(first, start - first * inner, end - first * inner)
    boxes: list[Box] = []
    if start % inner:
        boxes += within(first, start % inner, inner)
        first += 1
    tail = within(last, 0, end % inner) if end % inner else []
    if end % inner:
        last -= 1
    if first <= last:
        boxes.append(((first, *([0] * (len(shape) - 1))), (last - first + 1, *shape[1:])))
    return boxes + tail


@dataclass
class Piece:
    """A box of a full tensor held by this rank: where it starts in the full tensor, and a view of its values."""

    offsets: tuple[int, ...]
    values: torch.Tensor


@dataclass
class Placed:
    """This rank's pieces of a tensor of full shape `shape` (for sharded checkpoints)."""

    shape: tuple[int, ...]
    pieces: list[Piece]


def _row_major_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def _narrow(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


def placed_param(local: torch.Tensor, param: torch.Tensor, tp: TensorParallel, start: int = 0,
                 end: Optional[int] = None) -> Placed:
    """This rank's pieces of `param`'s full tensor, with values from `local`: a view of the whole local piece
    (param-shaped), or, with `start`/`end`, a flat view of only elements [start, end) of it (a ZeRO shard)."""
    end = param.numel() if end is None else end
    pieces = []
    for box_offsets, box_sizes in flat_range_boxes(tuple(param.shape), start, end):
        if local.shape == param.shape:
            box = _narrow(local, box_offsets, box_sizes)
        else:  # flat values of [start, end): the box is contiguous within them
            first = sum(o * s for o, s in zip(box_offsets, _row_major_strides(tuple(param.shape))))
            count = 1
            for size in box_sizes:
                count *= size
            box = local[first - start : first - start + count].view(box_sizes)
        for where, (offsets, sizes) in global_boxes(param, tp.rank, tp.size, box_offsets, box_sizes):
            relative = tuple(o - b for o, b in zip(offsets, box_offsets))
            pieces.append(Piece(where, _narrow(box, relative, sizes)))
    return Placed(full_shape(param), pieces)
