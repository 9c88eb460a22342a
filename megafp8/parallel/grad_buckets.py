"""Contiguous parameter and FP32 gradient buckets, and their data-parallel reduction.

Parameters are laid out in buckets of about `bucket_numel` elements, in reverse registration
order (roughly the order backward produces their gradients), grouped by the process group
their gradients are reduced over (a parameter-to-group map: dense parameters use the
data-parallel group; expert parameters will use the expert-data-parallel group). Each bucket
owns two flat buffers:

- `params`: the model weights (BF16 or FP32). Every parameter's `.data` becomes a view into it,
  so the sharded optimizer's all-gather writes the updated weights in place.
- `grads`: FP32 gradients. Every parameter's `main_grad` is a view into it; a post-accumulate
  hook adds the parameter's gradient and frees it (linears, FP8 and BF16, add their weight gradient
  to `main_grad` themselves), so micro-batches accumulate in FP32.

Within a bucket, matrices come before vectors, so a rank's shard holds at most one contiguous
run of weight-decayed elements. Buckets are padded to a multiple of the group size so that
reduce-scatter shards are equal.

Reduced gradients are divided by `mean_over` (the data-parallel size: the loss is a mean over
data-parallel replicas) or, by default, by the size of the bucket's group. Expert parameters are
reduced over the smaller expert-data-parallel group but still averaged over all replicas.

Some gradients are partial sums over a second group as well: under sequence parallelism each
tensor-parallel rank's norm weights see only its share of the tokens. `also_sum_over` names
those parameters and the group; `finish()` sums their (reduced) gradients over it.

On the last micro-batch of a step, a bucket's reduction (all-reduce, or reduce-scatter when the
optimizer is sharded) is launched asynchronously as soon as its last gradient is ready, which
overlaps communication with the rest of backward (NCCL); `finish()` waits for all of them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megafp8.parallel.flat import reduce_scatter_flat
from megafp8.parallel.sharding import is_expert


@dataclass
class Bucket:
    params: list[nn.Parameter]
    offsets: list[int]  # start of each parameter in the flat buffers
    decay_numel: int  # elements [0, decay_numel) belong to matrices (weight decay applies)
    params_flat: torch.Tensor
    grads_flat: torch.Tensor  # FP32
    group: Optional[dist.ProcessGroup]
    group_size: int
    group_rank: int
    shard_grads: Optional[torch.Tensor] = None  # FP32 reduce-scatter output when sharded
    also_sum: list[tuple[dist.ProcessGroup, int, int]] = field(default_factory=list)  # (group, start, end)
    pending: int = 0
    handle: Optional[dist.Work] = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        return self.grads_flat.numel()

    @property
    def shard_numel(self) -> int:
        return self.numel // self.group_size


def _group_size_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class GradBuckets:
    """Flat parameter/gradient buckets for `params`, reduced over each parameter's group."""

    def __init__(self, params: Iterable[nn.Parameter], group_of: dict[nn.Parameter, Optional[dist.ProcessGroup]],
                 bucket_numel: int, sharded: bool, overlap: bool = True,
                 also_sum_over: Optional[dict[nn.Parameter, dist.ProcessGroup]] = None,
                 mean_over: Optional[int] = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._mean_over = mean_over
        self._also_sum_over = also_sum_over or {}
        if not self.params:
            raise ValueError("GradBuckets needs at least one trainable parameter")
        self.sharded, self.overlap = sharded, overlap
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        self._sync_this_backward = False
        by_group: dict[tuple, list[nn.Parameter]] = {}
        for p in reversed(self.params):
            # A bucket holds one dtype (the router is FP32 among BF16 weights) and either experts or not.
            by_group.setdefault((id(group_of.get(p)), p.dtype, is_expert(p)), []).append(p)
        for members in by_group.values():
            group = group_of.get(members[0])
            chunk: list[nn.Parameter] = []
            for p in members:
                chunk.append(p)
                if sum(q.numel() for q in chunk) >= bucket_numel:
                    self._add_bucket(chunk, group)
                    chunk = []
            if chunk:
                self._add_bucket(chunk, group)
        # The hooks live in C++ on each parameter, where Python's cycle collector cannot see them: a hook holding
        # `self` would keep the buckets (every gradient buffer) alive after the model is gone. They hold a weak one.
        on_grad_ready = weakref.WeakMethod(self._on_grad_ready)

        def hook(param: torch.Tensor) -> None:
            method = on_grad_ready()
            if method is not None:
                method(param)

        for p in self.params:
            p.register_post_accumulate_grad_hook(hook)

    def _add_bucket(self, params: list[nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
        params = [p for p in params if p.ndim >= 2] + [p for p in params if p.ndim < 2]
        size, rank = _group_size_rank(group)
        numel = sum(p.numel() for p in params)
        padded = -(-numel // size) * size
        device, dtype = params[0].device, params[0].dtype
        params_flat = torch.zeros(padded, dtype=dtype, device=device)
        grads_flat = torch.zeros(padded, dtype=torch.float32, device=device)
        offsets, offset = [], 0
        for p in params:
            if p.dtype != dtype:
                raise ValueError("all parameters of a bucket must share a dtype")
            params_flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = params_flat[offset : offset + p.numel()].view_as(p)
            p.main_grad = grads_flat[offset : offset + p.numel()].view_as(p)
            offsets.append(offset)
            offset += p.numel()
        decay_numel = sum(p.numel() for p in params if p.ndim >= 2)
        bucket = Bucket(params, offsets, decay_numel, params_flat, grads_flat, group, size, rank)
        bucket.also_sum = [(self._also_sum_over[p], o, o + p.numel()) for p, o in zip(params, offsets)
                           if self._also_sum_over.get(p) is not None]
        if self.sharded:  # a group of one reduces nothing: its shard is the whole bucket
            bucket.shard_grads = (torch.zeros(bucket.shard_numel, dtype=torch.float32, device=device)
                                  if size > 1 else grads_flat)
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[p] = bucket

    # ----------------------------------------------------------------------------- backward
    def prepare_backward(self, last_micro_batch: bool) -> None:
        """Call before each micro-batch's backward; reductions start during the last one."""
        self._sync_this_backward = last_micro_batch and self.overlap
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is not None:  # linears have already added their weight gradient to main_grad
            param.main_grad.add_(param.grad)
            param.grad = None
        bucket = self._bucket_of[param]
        bucket.pending -= 1
        if self._sync_this_backward and bucket.pending == 0:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.handle is not None or bucket.group_size == 1:
            return
        if self.sharded:
            bucket.handle = reduce_scatter_flat(bucket.shard_grads, bucket.grads_flat, group=bucket.group,
                                                async_op=True)
        else:
            bucket.handle = dist.all_reduce(bucket.grads_flat, group=bucket.group, async_op=True)

    def finish(self) -> None:
        """Complete every bucket's reduction (launching those whose hooks never fired) and average."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
            divisor = self._mean_over or bucket.group_size
            if divisor > 1:
                self.shard_grads(bucket).div_(divisor)
            self._sum_partial(bucket)

    def _sum_partial(self, bucket: Bucket) -> None:
        """Sum the `also_sum_over` parameters' slices of this rank's reduced gradients over their groups."""
        grads = self.shard_grads(bucket)
        lo, hi = self.shard_range(bucket)
        by_group: dict[int, tuple[dist.ProcessGroup, list[torch.Tensor]]] = {}
        for group, start, end in bucket.also_sum:
            start, end = max(start, lo), min(end, hi)
            if start < end:
                by_group.setdefault(id(group), (group, []))[1].append(grads[start - lo : end - lo])
        for group, views in by_group.values():
            flat = torch.cat(views)
            dist.all_reduce(flat, group=group)
            offset = 0
            for view in views:
                view.copy_(flat[offset : offset + view.numel()])
                offset += view.numel()

    def shard_grads(self, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced FP32 gradients of `bucket` (its shard when sharded, else the whole bucket)."""
        return bucket.shard_grads if self.sharded else bucket.grads_flat

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """[start, end) of this rank's shard within the bucket."""
        if not self.sharded:
            return 0, bucket.numel
        return bucket.group_rank * bucket.shard_numel, (bucket.group_rank + 1) * bucket.shard_numel

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.grads_flat.zero_()
