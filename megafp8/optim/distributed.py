"""AdamW on FP32 master weights, sharded ZeRO-style across data-parallel ranks (Megatron's distributed optimizer).

Works on the flat buckets of `megafp8.parallel.GradBuckets`. With `sharded=True` each rank owns
1/D of every bucket: its reduce-scattered FP32 gradient shard, an FP32 master copy of that shard
of the weights, and the AdamW moments (FP32, or BF16 as DeepSeek-V3 kept them); after the update
the shard is cast to the model dtype and all-gathered into the bucket, which the parameters view.
With `sharded=False` every rank all-reduces and updates whole buckets (plain data parallelism).

The update is AdamW with decoupled weight decay (torch.optim.AdamW's arithmetic) written over
flat shards, because torch's AdamW has no BF16-moment option; weight decay applies to matrices
only (each bucket stores them first, so a shard's decayed elements form one contiguous run).
Gradient clipping uses the global L2 norm: each element is owned by exactly one rank of its
group, so summing the shards' squares over the group counts every gradient once; over the
tensor-parallel group, sharded parameters are summed and replicated ones (norm weights) are
counted on TP rank 0 only (yet checked on every TP rank: an inf or nan in any rank's
copy makes every rank's norm nan); over the pipeline group, each stage's parameters are its own.

Checkpoint state is by parameter name at the full (unsharded) shape: tensor-parallel shards are
gathered on save and sliced on load, so a checkpoint loads at any TP and DP layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megafp8.config import OptimizerConfig
from megafp8.parallel import (
    ExpertParallel,
    GradBuckets,
    TensorParallel,
    full_shape,
    gather_param,
    is_expert,
    local_piece,
    tp_shard_of,
)
from megafp8.optim.fused_update import adamw_update_, bias_corrections, fused_update_reason
from megafp8.parallel.flat import all_gather_flat
from megafp8.parallel.grad_buckets import Bucket
from megafp8.parallel.sharding import Placed, placed_param

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Runs after every step with the step's `applied` flag (a 0-d bool device tensor; None: applied unconditionally).
StepHook = Callable[[Optional[torch.Tensor]], None]


@dataclass
class _Shard:
    bucket: Bucket
    start: int  # this rank's range [start, end) within the bucket
    end: int
    decay_end: int  # elements [0, decay_end) of the shard get weight decay
    master: torch.Tensor  # FP32
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    replicated: list[tuple[int, int]]  # ranges of the shard holding TP-replicated parameters
    expert: bool  # a bucket of routed-expert parameters (each EP rank holds different experts)


class DistributedAdamW:
    """FP32-master AdamW over `buckets`; `names` maps each parameter to its name (for checkpoints)."""

    def __init__(self, buckets: GradBuckets, names: dict[nn.Parameter, str], cfg: OptimizerConfig,
                 tp: TensorParallel | None = None, ep: ExpertParallel | None = None,
                 pp_group: dist.ProcessGroup | None = None) -> None:
        self.buckets, self.cfg = buckets, cfg
        self.pp_group = pp_group  # other pipeline stages hold other parameters
        self.names = names
        self.tp = tp or TensorParallel.single()
        self.ep = ep or ExpertParallel.single()
        self.step_count = 0  # updates applied; a step skipped on the device counts until `settle_step_count`
        self._step_tensor: torch.Tensor | None = None  # the step count on the device, for the fused kernel
        self._betas: torch.Tensor | None = None  # [beta1, beta2] in FP32 on the device, for the fused update
        self._skipped: torch.Tensor | None = None  # steps skipped on the device since the last settle
        self._clip_coef: torch.Tensor | None = None  # the last clipping scale, for the fused update to apply
        self._post_step_hooks: list[StepHook] = []
        moment_dtype = MOMENT_DTYPES[cfg.moment_dtype]
        self.shards: list[_Shard] = []
        for bucket in buckets.buckets:
            start, end = buckets.shard_range(bucket)
            master = bucket.params_flat[start:end].float().clone()
            replicated = []
            for p, offset in zip(bucket.params, bucket.offsets):
                lo, hi = max(offset, start), min(offset + p.numel(), end)
                if tp_shard_of(p) is None and lo < hi:
                    replicated.append((lo - start, hi - start))
            self.shards.append(_Shard(
                bucket, start, end, max(0, min(end, bucket.decay_numel) - start), master,
                torch.zeros_like(master, dtype=moment_dtype), torch.zeros_like(master, dtype=moment_dtype), replicated,
                is_expert(bucket.params[0]),
            ))

    # --------------------------------------------------------------------------------- step
    def clip_grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients (before clipping), clipped: in place, or, for the shards the
        fused update takes, by the next `step` as it reads them (the coefficient is kept until then, and dropped by
        anything else that ends the step: `skip_step`, a load); no host sync.

        On a GPU both passes over the gradients are foreach kernels: `_foreach_norm` reads each shard once (a
        `square().sum()` wrote a squared copy and read it back: 6.6 ms of an 8B-layer step), and `_foreach_mul_`
        scales by the on-device coefficient with vectorized loads (a `mul_` by a 0-d CUDA tensor takes ATen's
        strided element-wise path: 7.0 ms). The scaling is the same multiply as before, bit for bit."""
        device = self.shards[0].master.device
        grads = [self.buckets.shard_grads(shard.bucket) for shard in self.shards]
        # The pieces each shard counts: all of it, except that TP-replicated parameters count once, on TP rank 0
        # (left out here rather than subtracted, which cancelled digits).
        pieces = [[g] if self.tp.rank == 0 or not shard.replicated else
                  [g[lo:hi] for lo, hi in _complement(shard.replicated, g.numel())]
                  for shard, g in zip(self.shards, grads)]
        # Left out of the norm on other TP ranks, the replicated ranges are still checked there: their sum of squares
        # times zero adds 0, or nan where one of them is inf or nan, so every rank's norm is non-finite (and the step
        # skipped everywhere) where any rank's copy of a replicated gradient is. Counted on TP rank 0 only, a nan
        # on another TP rank alone (a flipped bit) was applied there: nan master and weights on that rank.
        checked = [[g[lo:hi] for lo, hi in shard.replicated] if self.tp.rank != 0 else []
                   for shard, g in zip(self.shards, grads)]
        counted = [piece for shard_pieces in pieces for piece in shard_pieces]
        every = _sums_of_squares(counted + [piece for shard_pieces in checked for piece in shard_pieces])
        squares, checks = iter(every[:len(counted)]), iter(every[len(counted):])
        # Partial sums per kind of bucket: each is summed over the ranks holding other pieces of that kind (one
        # stack and one sum per kind, not an add per piece).
        kinds: dict[tuple[int, bool], tuple[Bucket, list[torch.Tensor], list[torch.Tensor]]] = {}
        for shard, shard_pieces, shard_checked in zip(self.shards, pieces, checked):
            kind = kinds.setdefault((id(shard.bucket.group), shard.expert), (shard.bucket, [], []))
            kind[1].extend(next(squares) for _ in shard_pieces)
            kind[2].extend(next(checks) for _ in shard_checked)
        partials: dict[tuple[int, bool], tuple[Bucket, torch.Tensor]] = {}
        for key, (bucket, parts, kind_checks) in kinds.items():
            part = torch.stack(parts).sum() if parts else torch.zeros((), device=device)
            if kind_checks:  # + 0.0 leaves the (non-negative) sum's bits as they are
                part = part + torch.stack(kind_checks).sum() * 0.0
            partials[key] = (bucket, part)
        sum_sq = torch.zeros((), dtype=torch.float32, device=device)
        for (_, expert), (bucket, part) in partials.items():
            if self.buckets.sharded and bucket.group_size > 1:
                dist.all_reduce(part, group=bucket.group)  # data-parallel shards
            if expert and self.ep.enabled:
                dist.all_reduce(part, group=self.ep.group)  # other ranks' experts
            sum_sq += part
        if self.tp.enabled:
            dist.all_reduce(sum_sq, group=self.tp.group)
        if self.pp_group is not None:
            dist.all_reduce(sum_sq, group=self.pp_group)
        norm = sum_sq.sqrt()
        self._clip_coef = None
        if self.cfg.grad_clip > 0:
            coef = torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0)
            # A non-finite norm skips the step: leave the gradients as they are, for naming the layers at fault.
            coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
            fused = self._fused_update_shards()
            if fused:  # the next step's kernel multiplies by it as it reads each gradient: no pass of its own
                self._clip_coef = coef
            unfused = [g for shard, g in zip(self.shards, grads) if id(shard) not in fused]
            if unfused:
                torch._foreach_mul_(unfused, coef)
        return norm

    def _fused_update_shards(self) -> set[int]:
        """ids of the shards the next step updates with the fused kernel (`megafp8.optim.fused_update`): all of
        them (FP32 or BF16 moments) on a device it runs on with `optimizer.fused_update` on, else none."""
        if not self.cfg.fused_update or not self.shards:
            return set()
        if fused_update_reason(self.shards[0].master.device) is not None:
            return set()
        return {id(s) for s in self.shards}

    def nonfinite_params(self) -> list[str]:
        """Names of the parameters whose reduced gradients (this rank's shard of them) hold an inf or nan."""
        flags, names = [], []
        for shard in self.shards:
            grads = self.buckets.shard_grads(shard.bucket)
            for p, offset in zip(shard.bucket.params, shard.bucket.offsets):
                lo, hi = max(offset, shard.start), min(offset + p.numel(), shard.end)
                if lo < hi:
                    flags.append(torch.isfinite(grads[lo - shard.start : hi - shard.start]).all())
                    names.append(self.names[p])
        if not flags:
            return []
        return [name for name, finite in zip(names, torch.stack(flags).tolist()) if not finite]

    def found_nonfinite(self) -> torch.Tensor:
        """1.0 if this rank's reduced gradients hold an inf or nan, else 0.0 (a device tensor; no host sync)."""
        flags = [torch.logical_not(torch.isfinite(self.buckets.shard_grads(s.bucket)).all()) for s in self.shards]
        return torch.stack(flags).any().float()

    def scale_grads(self, factor: float) -> None:
        torch._foreach_mul_([self.buckets.shard_grads(shard.bucket) for shard in self.shards], factor)

    @torch.no_grad()
    def step(self, lr: float, apply: torch.Tensor | None = None) -> None:
        """One AdamW update at learning rate `lr`. `apply`, a 0-d bool tensor on the device: where False the update is
        skipped on the device (masters, moments and weights unchanged) without the host waiting for it; such a step
        leaves `step_count` at the next `settle_step_count`."""
        self.step_count += 1
        skip = None
        if apply is not None:
            skip = torch.logical_not(apply)
            self._skipped = skip.long() if self._skipped is None else self._skipped + skip
            skip = skip.float()
        fp32_moments = [s.exp_avg.dtype == torch.float32 for s in self.shards]
        fused = self._fused_update_shards()
        coef, self._clip_coef = self._clip_coef, None
        if fused:
            corrections = self._bias_corrections(self.shards[0].master.device)
            for shard in self.shards:
                if id(shard) in fused:
                    self._fused_update(shard, lr, corrections, coef, skip)
        self._fused_step([s for s, fp32 in zip(self.shards, fp32_moments) if fp32 and id(s) not in fused], lr, skip)
        for shard, fp32 in zip(self.shards, fp32_moments):
            if not fp32 and id(shard) not in fused:
                self._step_shard(shard, lr, apply)
        self._publish(written=fused)
        self._run_post_step_hooks(apply)

    def skip_step(self) -> None:
        """A step skipped on the host (the FP16 loss scaler found an inf or nan): nothing is updated and the step
        count stays, but the post-step hooks still run, told the update was not applied (they account for every
        step)."""
        self._clip_coef = None  # belongs to this step's gradients, which the next step will not see
        self._run_post_step_hooks(torch.zeros((), dtype=torch.bool, device=self.shards[0].master.device))

    def register_step_post_hook(self, hook: StepHook) -> None:
        """Run `hook(applied)` after every step, skipped ones included (`applied` False on the device then)."""
        self._post_step_hooks.append(hook)

    def _run_post_step_hooks(self, applied: Optional[torch.Tensor]) -> None:
        for hook in self._post_step_hooks:
            hook(applied)

    def settle_step_count(self) -> int:
        """Take the steps skipped on the device since the last call out of `step_count` (the host waits for the
        device here); returns how many there were."""
        if self._skipped is None:
            return 0
        skipped, self._skipped = int(self._skipped.item()), None
        self.step_count -= skipped
        return skipped

    def _fused_step(self, shards: list[_Shard], lr: float, skip: torch.Tensor | None) -> None:
        """FP32 moments: torch's fused AdamW kernel, one call for the decayed ranges and one for the rest (the
        same update as `_step_shard`, to within an ulp), instead of eight element-wise passes over the buffers.
        `skip` (1.0 or 0.0 on the device): the kernel's own flag for leaving everything unchanged."""
        if not shards:
            return
        step = self._device_step_count(shards[0].master.device)
        c = self.cfg
        for decay, part in ((c.weight_decay, lambda s: slice(0, s.decay_end)),
                            (0.0, lambda s: slice(s.decay_end, None))):
            chosen = [(s, part(s)) for s in shards if s.master[part(s)].numel() > 0]
            if not chosen:
                continue
            grads = [self.buckets.shard_grads(s.bucket)[cut] for s, cut in chosen]
            torch._fused_adamw_([s.master[cut] for s, cut in chosen], grads, [s.exp_avg[cut] for s, cut in chosen],
                                [s.exp_avg_sq[cut] for s, cut in chosen], [], [step] * len(chosen),
                                lr=lr, beta1=c.beta1, beta2=c.beta2, weight_decay=decay, eps=c.eps, amsgrad=False,
                                maximize=False, found_inf=skip)

    def _device_step_count(self, device: torch.device) -> torch.Tensor:
        """`step_count` as a 0-d FP32 tensor on `device` (filled, not copied: no host sync), as torch's fused AdamW
        reads it."""
        if self._step_tensor is None or self._step_tensor.device != device:
            self._step_tensor = torch.zeros((), dtype=torch.float32, device=device)
        return self._step_tensor.fill_(self.step_count)

    def _bias_corrections(self, device: torch.device) -> torch.Tensor:
        """This step's [1 - beta1**step, 1 - beta2**step] on `device`, computed there as torch's fused AdamW does."""
        if self._betas is None or self._betas.device != device:
            self._betas = torch.tensor([self.cfg.beta1, self.cfg.beta2], dtype=torch.float32, device=device)
        return bias_corrections(self._betas, self._device_step_count(device))

    def _fused_update(self, shard: _Shard, lr: float, corrections: torch.Tensor, coef: torch.Tensor | None,
                      skip: torch.Tensor | None) -> None:
        """One kernel: the clipping scale, AdamW (torch's fused kernel's arithmetic) and the updated master cast
        into the model's weights (this rank's range of the bucket), which `_publish` then leaves as they are."""
        c = self.cfg
        own = shard.bucket.params_flat[shard.start : shard.end]
        adamw_update_(shard.master, self.buckets.shard_grads(shard.bucket), shard.exp_avg, shard.exp_avg_sq, own,
                      shard.decay_end if c.weight_decay != 0 else 0, corrections, lr, c.beta1, c.beta2, c.eps,
                      c.weight_decay, coef=coef, skip=skip)

    def _step_shard(self, shard: _Shard, lr: float, apply: torch.Tensor | None) -> None:
        """BF16 moments without the fused update (off the GPU, or `optimizer.fused_update: false`): the update in
        FP32 on copies of the moments, stored back rounded (unless `apply` is False)."""
        c = self.cfg
        bias1 = 1 - c.beta1 ** self.step_count
        bias2_sqrt = math.sqrt(1 - c.beta2 ** self.step_count)
        grad = self.buckets.shard_grads(shard.bucket)
        m, v = shard.exp_avg.float(), shard.exp_avg_sq.float()
        master = shard.master if apply is None else shard.master.clone()
        if shard.decay_end > 0:
            master[: shard.decay_end].mul_(1 - lr * c.weight_decay)
        m.lerp_(grad, 1 - c.beta1)
        v.mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
        denom = (v.sqrt() / bias2_sqrt).add_(c.eps)
        master.addcdiv_(m, denom, value=-lr / bias1)
        if apply is not None:
            shard.master.copy_(torch.where(apply, master, shard.master))
            m, v = torch.where(apply, m, shard.exp_avg.float()), torch.where(apply, v, shard.exp_avg_sq.float())
        shard.exp_avg.copy_(m)
        shard.exp_avg_sq.copy_(v)

    def _publish(self, written: set[int] = frozenset()) -> None:
        """Write the updated masters into the model weights (all-gathering the shards when sharded); the shards
        in `written` (ids) already hold their weights (the fused update wrote them)."""
        for shard in self.shards:
            bucket = shard.bucket
            own = bucket.params_flat[shard.start : shard.end]
            if id(shard) not in written:
                own.copy_(shard.master)
            if self.buckets.sharded and bucket.group_size > 1:
                all_gather_flat(bucket.params_flat, own.clone(), group=bucket.group)
            # Writes into params_flat (copy, collective) do not bump the parameters' own version counters
            # (`p.data = view` keeps each parameter's counter), and FP8 weight caches key on them.
            for p in bucket.params:
                torch.autograd.graph.increment_version(p)

    # --------------------------------------------------------------------------- checkpoints
    def _full(self, shard: _Shard, tensor: torch.Tensor) -> torch.Tensor:
        """The whole bucket's values of a per-shard tensor, in FP32 (all-gathered when sharded)."""
        if not self.buckets.sharded or shard.bucket.group_size == 1:
            return tensor.float()
        full = torch.empty(shard.bucket.numel, dtype=tensor.dtype, device=tensor.device)
        all_gather_flat(full, tensor.contiguous(), group=shard.bucket.group)
        return full.float()

    def state_dict(self) -> dict[str, Any]:
        """Layout-independent state: FP32 master weights and moments by parameter name (full shapes), and the
        step, every expert included. Collective over data-, tensor- and expert-parallel ranks: every rank must
        call it."""
        state: dict[str, Any] = {"step": self.step_count, "masters": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for shard in self.shards:
            fulls = {key: self._full(shard, getattr(shard, attr)) for key, attr in
                     (("masters", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))}
            for p, offset in zip(shard.bucket.params, shard.bucket.offsets):
                for key, full in fulls.items():
                    local = full[offset : offset + p.numel()].view_as(p)
                    state[key][self.names[p]] = gather_param(local, p, self.tp, self.ep).to("cpu", copy=True)
        return state

    _STATE_KEYS = (("masters", "master"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
    MOMENTS = tuple(key for key, _ in _STATE_KEYS[1:])  # what a step-0 (fresh) state may leave out

    def placed_state(self, moments: bool = True) -> dict[str, Placed]:
        """This rank's pieces of every parameter's master weights and moments, at full shapes, as views of the
        shard buffers (`optim/<kind>/<name>`): for sharded checkpoints, which write and read them in place.
        `moments`: False leaves the moments out (a checkpoint of a fresh optimizer has none; `zero_moments`)."""
        placed: dict[str, Placed] = {}
        for shard in self.shards:
            for p, offset in zip(shard.bucket.params, shard.bucket.offsets):
                lo, hi = max(offset, shard.start), min(offset + p.numel(), shard.end)
                if lo >= hi:
                    continue
                for key, attr in self._STATE_KEYS if moments else self._STATE_KEYS[:1]:
                    flat = getattr(shard, attr)[lo - shard.start : hi - shard.start]
                    placed[f"optim/{key}/{self.names[p]}"] = placed_param(flat, p, self.tp, lo - offset, hi - offset)
        return placed

    def zero_moments(self) -> None:
        """Start both AdamW moments at zero, as a fresh optimizer's."""
        for shard in self.shards:
            shard.exp_avg.zero_()
            shard.exp_avg_sq.zero_()

    def finish_placed_load(self, step_count: int) -> None:
        """After `placed_state()`'s views were read in place (a sharded checkpoint): take the saved step count and
        write the master weights into the model weights."""
        self.step_count, self._skipped, self._clip_coef = step_count, None, None
        self._publish()

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load full tensors by name (a full checkpoint). A state of step 0 may leave out both moments (an imported
        checkpoint: a fresh optimizer), which then start at zero."""
        expected = {self.names[p]: full_shape(p) for s in self.shards for p in s.bucket.params}
        fresh = int(state["step"]) == 0 and not any(state.get(key) for key in self.MOMENTS)
        for key in ("masters",) if fresh else ("masters", *self.MOMENTS):
            saved = state.get(key, {})
            missing = [n for n in expected if n not in saved]
            if missing:
                raise ValueError(f"optimizer state lacks {key} for {len(missing)} parameter(s), e.g. '{missing[0]}'"
                                 + (" (only a checkpoint of step 0 may leave out the moments)"
                                    if key in self.MOMENTS and not saved else ""))
            for name, shape in expected.items():
                if tuple(saved[name].shape) != shape:
                    raise ValueError(f"optimizer {key} of '{name}' has shape {tuple(saved[name].shape)}, "
                                     f"the model has {shape}")
        self.step_count, self._skipped, self._clip_coef = int(state["step"]), None, None
        for shard in self.shards:
            for key, attr in self._STATE_KEYS:
                if fresh and key in self.MOMENTS:  # a fresh optimizer's moments
                    getattr(shard, attr).zero_()
                    continue
                full = torch.zeros(shard.bucket.numel, dtype=torch.float32)
                for p, offset in zip(shard.bucket.params, shard.bucket.offsets):
                    mine = local_piece(state[key][self.names[p]], p, self.tp)
                    full[offset : offset + p.numel()] = mine.reshape(-1).float()
                getattr(shard, attr).copy_(full[shard.start : shard.end])
        self._publish()

    # ---------------------------------------------------------------------------- accounting
    def num_params(self) -> int:
        """The elements of the parameters this rank holds (its TP shards, PP stages and EP experts; no padding)."""
        return sum(p.numel() for b in self.buckets.buckets for p in b.params)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for weights, gradients, master weights and optimizer states."""
        weights = sum(b.params_flat.numel() * b.params_flat.element_size() for b in self.buckets.buckets)
        grads = sum(b.grads_flat.numel() * 4 for b in self.buckets.buckets)
        if self.buckets.sharded:
            grads += sum(b.shard_grads.numel() * 4 for b in self.buckets.buckets if b.shard_grads is not b.grads_flat)
        masters = sum(s.master.numel() * 4 for s in self.shards)
        states = sum(s.exp_avg.numel() * s.exp_avg.element_size() * 2 for s in self.shards)
        return {"weights": weights, "grads": grads, "master_weights": masters, "optimizer_states": states}


def _sums_of_squares(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each FP32 piece's sum of squares, a 0-d tensor on its device. CUDA: one `_foreach_norm` launch, which reads
    each piece once and sums in a tree. CPU: `square().sum()`, whose pairwise summation stays accurate where the
    CPU norm kernels do not (1e-5 relative error at 10M elements against 3e-8, enough to fail the TP parity tests)."""
    if not pieces:
        return []
    if pieces[0].device.type == "cuda":
        return list(torch.stack(torch._foreach_norm(pieces)).square().unbind())  # three launches, not one per piece
    return [piece.square().sum() for piece in pieces]


def _complement(ranges: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The non-empty [lo, hi) pieces of [0, length) that no range of `ranges` (disjoint) covers."""
    pieces, start = [], 0
    for lo, hi in sorted(ranges):
        if lo > start:
            pieces.append((start, lo))
        start = max(start, hi)
    if start < length:
        pieces.append((start, length))
    return pieces
