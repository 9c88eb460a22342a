"""The training loop: build everything from a config, then step, log, evaluate and checkpoint.

One optimizer step = every micro-batch of this rank's share of the global batch, each
backward accumulating FP32 gradients; then the data-parallel all-reduce, global grad-norm
clipping, AdamW on the FP32 masters and the write-back into the BF16 weights. The host waits
on the device only at logging, evaluation and checkpoint steps.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megafp8.config import Config, ConfigError, ModelConfig, dump_config, validate_config, validate_for_world
from megafp8.config.loader import config_to_dict
from megafp8.data import DistributedLoader, PackedDataset, TokenStream, read_meta, validation_batches
from megafp8.data.indexed import DatasetMeta
from megafp8.model import (
    Transformer,
    apply_compile,
    apply_fp8_plan,
    apply_recompute,
    describe_rope,
    init_weights,
    resolve_vocab_size,
    training_flops_per_token,
)
from megafp8.optim import DistributedAdamW, lr_at
from megafp8.model.moe import expert_load_stats, routers
from megafp8.parallel import (
    ExpertParallel,
    GradBuckets,
    ParallelDims,
    TensorParallel,
    full_shape,
    is_expert,
    tp_shard_of,
)
from megafp8.parallel.pipeline import StageSpec, build_layout
from megafp8.precision import DynamicLossScaler, PrecisionRecipe, resolve_recipe, select_backend
from megafp8.train.fp8_health import Fp8HealthMonitor
from megafp8.train.loggers import ExperimentLogger
from megafp8.train.plan import check_fits, device_capacity, make_plan
from megafp8.train.metrics import format_step_line, peak_tflops
from megafp8.train.checkpointing import Checkpointer
from megafp8.train.nonfinite import NonFiniteGuard, window_loss
from megafp8.train.pipelined import PipelineRunner
from megafp8.train.resume import on_every_rank, verified_resume_path
from megafp8.train.run_history import (
    CONFIG_FILE,
    drop_metrics_after,
    judge,
    read_earlier_run,
    remove_earlier_run,
)
from megafp8.train.run_lock import claim_run_directories, open_run_directories
from megafp8.train.runtime import host_to_device

log = logging.getLogger("megafp8")


def build_model(cfg: Config, model_cfg: ModelConfig, recipe: PrecisionRecipe, device: torch.device,
                fp8_active: bool = True, tp: Optional[TensorParallel] = None,
                ep: Optional[ExpertParallel] = None, stages: Optional[list[StageSpec]] = None) -> Transformer:
    """The decoder (this rank's tensor-parallel shard, experts and pipeline `stages`), initialized from the seed,
    with the FP8 layer plan applied (and logged). `fp8_active=False` builds it in BF16 for a precision schedule that
    switches later."""
    parts = {}
    if stages is not None:
        parts = {"layer_ids": [i for s in stages for i in s.layers], "embedding": any(s.first for s in stages),
                 "head": any(s.last for s in stages)}
        # The plan's layer globs are checked against the whole model once (a stage holds only some layers).
        apply_fp8_plan(full_meta_model(cfg, model_cfg, recipe, tp, ep), cfg.precision, recipe, model_cfg.num_layers,
                       dry_run=True)
    model = Transformer(model_cfg, recipe, cfg.data.seq_len, tp, device=device, ep=ep,
                        fp8_dispatch=cfg.parallel.ep_dispatch_fp8, **parts)
    init_weights(model, model_cfg, cfg.training.seed, tp)
    check = stages is None
    if recipe.fp8 is not None and not fp8_active:  # the FP8 plan of the later switch must be valid now
        apply_fp8_plan(model, cfg.precision, recipe, model_cfg.num_layers, dry_run=True, check_patterns=check)
    plan = apply_fp8_plan(model, cfg.precision, recipe if fp8_active else recipe.high_precision(),
                          model_cfg.num_layers, check_patterns=check)
    if cfg.training.compile:
        log.info("torch.compile (mode %s): %d blocks", cfg.training.compile_mode,
                 apply_compile(model, cfg.training.compile_mode))
    recomputing = apply_recompute(model, cfg.training.recompute)
    if recomputing:
        log.info("activation recomputation: %d blocks keep only their input for backward", recomputing)
    if recipe.fp8 is not None:
        backend = select_backend(recipe.fp8.backend, device)
        log.info("fp8: backend %s%s | %s%s", backend.name, " (auto)" if recipe.fp8.backend == "auto" else "",
                 plan.summary(), "" if fp8_active else f" | BF16 until step {cfg.precision.fp8_start_step}")
    return model


def full_meta_model(cfg: Config, model_cfg: ModelConfig, recipe: PrecisionRecipe, tp: Optional[TensorParallel],
                    ep: Optional[ExpertParallel]) -> Transformer:
    """The whole model (every pipeline stage) on the meta device: names and shapes, no memory."""
    return Transformer(model_cfg, recipe, cfg.data.seq_len, tp, device=torch.device("meta"), ep=ep,
                       fp8_dispatch=cfg.parallel.ep_dispatch_fp8)


def resolve_precision(cfg: Config, device: torch.device) -> tuple[Config, PrecisionRecipe]:
    """The config with `precision.recipe: auto` resolved for `device` (re-validated), and its recipe."""
    name, reason = resolve_recipe(cfg.precision.recipe, device, cfg.precision.auto_cpu_recipe)
    resolved = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, recipe=name))
    validate_config(resolved)
    log.info("precision: %s (%s)", name, reason)
    return resolved, PrecisionRecipe.from_config(resolved.precision)


class Trainer:
    """Owns the model, optimizer, data and loop of one run on one rank."""

    def __init__(self, cfg: Config, dims: ParallelDims, device: torch.device) -> None:
        self.dims, self.device = dims, device
        self.num_micro_batches = validate_for_world(cfg, dims.world_size)
        self.run_dir = Path(cfg.logging.output_dir) / (cfg.run_name or "run")
        self.checkpoint_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        # Nothing is written into the run directory until the config, data and checkpoint are validated.
        self.run_lock = claim_run_directories(self.run_dir, self.checkpoint_dir, dims)
        self.tp, self.ep = dims.tensor_parallel, dims.expert_parallel
        if cfg.model.vocab_size is not None:  # a model that cannot fit fails first, before even the data is read
            self._check_fits(cfg, cfg.model)
        meta = read_meta(cfg.data.path)
        self.model_cfg = resolve_vocab_size(cfg.model, meta.vocab_size, self.tp.size)
        self.cfg, self.recipe = resolve_precision(cfg, device)
        cfg = self.cfg
        self._check_fits(cfg, self.model_cfg)
        par = cfg.parallel
        self.layout = (build_layout(self.model_cfg.num_layers, par.pp, par.pp_schedule, par.pp_virtual_stages,
                                    par.pp_layout) if dims.pp > 1 else None)
        self.model = build_model(cfg, self.model_cfg, self.recipe, device,
                                 fp8_active=cfg.precision.fp8_start_step == 0, tp=self.tp, ep=self.ep,
                                 stages=self.layout.local_stages(dims.pp_rank) if self.layout else None)
        self.routers = [router for _, router in routers(self.model)]
        self.expert_loads: Optional[torch.Tensor] = None
        self.loss_scaler = DynamicLossScaler.from_config(cfg.precision) if self.recipe.name == "fp16" else None
        self._build_optimizer()
        self.guard = NonFiniteGuard(self.optimizer, cfg.training.max_consecutive_skips, device, dims)
        self._build_data(meta)
        self.pipeline = (PipelineRunner(self.model, self.layout, dims, self.num_micro_batches,
                                        cfg.training.micro_batch_size, cfg.data.seq_len, device)
                         if self.layout else None)
        self.health = Fp8HealthMonitor(self.model, cfg.logging.fp8_health_interval, cfg.logging.fp8_underflow_warn,
                                       cfg.logging.fp8_at_max_warn)
        self.step = 0
        self.checkpointer = Checkpointer(self)
        self.metrics_path = Path(cfg.logging.metrics_file)
        if not self.metrics_path.is_absolute():
            self.metrics_path = self.run_dir / self.metrics_path
        self.tokens_per_step = cfg.training.global_batch_size * cfg.data.seq_len
        self.flops_per_token = training_flops_per_token(self.model_cfg, cfg.data.seq_len)
        self.peak_tflops = peak_tflops(device, cfg.logging.peak_tflops)
        replace, resumed_from = self._resume_or_start()
        open_run_directories(self.run_lock, self.run_dir, self.checkpoint_dir, dims)
        self.metrics = self._open_run_directory(replace, resumed_from)

    def _check_fits(self, cfg: Config, model_cfg: ModelConfig) -> None:
        ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        plan = make_plan(dataclasses.replace(cfg, model=model_cfg), self.dims.world_size)
        where = "the GPU has" if self.device.type == "cuda" else f"this host has, per rank ({ranks_on_host} here),"
        check_fits(plan, device_capacity(self.device, ranks_on_host), where)

    def _build_optimizer(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = self.cfg.optimizer
        # Under sequence parallelism every TP-replicated weight (the norms) sees only this rank's tokens.
        partial = {p: self.tp.group for p in params if tp_shard_of(p) is None} if self.tp.sp else {}
        # Routed experts are reduced over their expert-data-parallel replicas, dense weights over all replicas.
        group_of = {p: self.dims.edp_group if is_expert(p) else self.dims.dp_group for p in params}
        self.grad_buckets = GradBuckets(params, group_of, bucket_numel=int(opt.bucket_size_mb * 2**20 / 4),
                                        sharded=opt.sharded, overlap=opt.overlap_grad_reduce, also_sum_over=partial,
                                        mean_over=self.dims.dp)
        names = {p: n for n, p in self.model.named_parameters()}
        self.optimizer = DistributedAdamW(self.grad_buckets, names, opt, self.tp, self.ep, self.dims.pp_group)

    def _build_data(self, meta: DatasetMeta) -> None:
        data, training = self.cfg.data, self.cfg.training
        train_set = PackedDataset(TokenStream(meta, data.train_split), data.seq_len, data.train_split)
        self.loader = DistributedLoader(train_set, training.global_batch_size, training.micro_batch_size,
                                        self.dims.dp_rank, self.dims.dp_size,
                                        training.seed if data.seed is None else data.seed)
        self.valid_set: Optional[PackedDataset] = None
        if training.eval_interval > 0:
            self.valid_set = PackedDataset(TokenStream(meta, data.valid_split), data.seq_len, data.valid_split)

    # ----------------------------------------------------------------------------------- steps
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One training step. Returns (this rank's mean loss, global grad norm before clipping), on device. A step
        whose gradients hold an inf or nan on any rank is skipped on every rank (`megafp8/train/nonfinite.py`);
        its grad norm is then not finite. The gradients stay in their buffers until the next step."""
        if self.recipe.fp8 is not None and self.step == self.cfg.precision.fp8_start_step > 0:
            plan = apply_fp8_plan(self.model, self.cfg.precision, self.recipe, self.model_cfg.num_layers,
                                  check_patterns=self.layout is None)
            log.info("step %d: switching to FP8 | %s", self.step, plan.summary())
        self.model.train()
        self.grad_buckets.zero()
        sampled = self.health.arm(self.step)
        micro_batches = self.loader.next_step()
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self.model.balance_grad_scale = loss_scale / len(micro_batches)
        if self.pipeline is not None:
            self.grad_buckets.prepare_backward(last_micro_batch=False)  # reduce after the pipeline flush
            loss_sum = self.pipeline.train_step(micro_batches, loss_scale)
        else:
            loss_sum = torch.zeros((), device=self.device)
            for i, (tokens, targets) in enumerate(micro_batches):
                self.grad_buckets.prepare_backward(last_micro_batch=i == len(micro_batches) - 1)
                loss = self.model(host_to_device(tokens, self.device), host_to_device(targets, self.device))
                loss = loss / len(micro_batches)
                (loss * loss_scale).backward()
                loss_sum += loss.detach()
        self.grad_buckets.finish()
        self.step += 1
        if sampled:
            self.metrics.write({"kind": "fp8_health", "step": self.step, "layers": self.health.collect(self.step)})
        return loss_sum, self._update(loss_scale)

    def _update(self, loss_scale: float) -> torch.Tensor:
        """The optimizer step, skipped on the device where the global grad norm is not finite; returns the norm
        (nan for an FP16 step its loss scaler skipped)."""
        if self.loss_scaler is not None and not self._unscale_or_skip(loss_scale):
            applied = torch.zeros((), dtype=torch.bool, device=self.device)
            self.guard.record(self.step, applied, counts=self.loss_scaler.scale <= self.loss_scaler.min_scale)
            self._balance_experts(applied)
            return torch.full((), float("nan"), device=self.device)
        grad_norm = self.optimizer.clip_grad_norm()
        applied = torch.isfinite(grad_norm)
        self.optimizer.step(lr_at(self.optimizer.step_count, self.cfg.optimizer, self.cfg.training.steps), applied)
        self.guard.record(self.step, applied)
        self._balance_experts(applied)
        return grad_norm

    def _balance_experts(self, applied: torch.Tensor) -> None:
        """Sum this step's expert loads over every rank holding distinct tokens, then (where the step was `applied`)
        move each router's selection bias toward balance. Every rank ends with the same loads and biases."""
        if not self.routers:
            return
        loads = torch.stack([router.load for router in self.routers])  # (MoE layers, experts)
        for router in self.routers:
            router.load.zero_()
        if self.dims.dp_group is not None:
            dist.all_reduce(loads, group=self.dims.dp_group)
        if self.tp.sp:  # TP ranks routed different tokens
            dist.all_reduce(loads, group=self.tp.group)
        rate = self.model_cfg.moe_bias_update_rate
        if rate > 0:
            for router, load in zip(self.routers, loads):
                router.update_bias(load, rate, applied)
        self.expert_loads = loads

    def _unscale_or_skip(self, loss_scale: float) -> bool:
        """FP16: agree across every rank whether any gradient is inf/nan; unscale and return True if none is."""
        found = self.optimizer.found_nonfinite()
        if self.dims.is_distributed:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank, so all skip or none does
        skip = bool(found.item())
        self.loss_scaler.update(skip)
        if skip:
            log.warning("step %d: inf/nan gradients on some rank; step skipped (weights, optimizer and LR "
                        "schedule unchanged), loss scale %g -> %g", self.step, loss_scale, self.loss_scaler.scale)
            return False
        self.optimizer.scale_grads(1.0 / loss_scale)
        return True

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed held-out micro-batches (`training.eval_iters` of them, split across ranks)."""
        assert self.valid_set is not None
        self.model.eval()
        batches = validation_batches(self.valid_set, self.cfg.training.micro_batch_size,
                                     self.cfg.training.eval_iters, self.dims.dp_rank, self.dims.dp_size)
        if self.pipeline is not None:
            total = self.pipeline.evaluate(batches)
            dist.all_reduce(total, group=self.dims.pp_group)  # only the last stage's rank holds the loss
        else:
            total = torch.zeros(2, device=self.device)  # (sum of micro-batch losses, count)
            for tokens, targets in batches:
                total[0] += self.model(host_to_device(tokens, self.device), host_to_device(targets, self.device))
                total[1] += 1
        if self.dims.dp_group is not None:
            dist.all_reduce(total, group=self.dims.dp_group)
        return (total[0] / total[1]).item()

    def _replica_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel replicas of a loss held by the last pipeline stage (tensor-parallel ranks
        already hold the same loss; other stages hold 0)."""
        value = value.detach().float().clone()
        if self.dims.pp_group is not None:
            dist.all_reduce(value, group=self.dims.pp_group)
        if self.dims.dp_group is None:
            return value
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.dims.dp_group)
        return value / self.dims.dp_size

    # ------------------------------------------------------------------------------------ loop
    def fit(self) -> list[dict[str, Any]]:
        """Train to `training.steps`; returns the metrics records (also written to the metrics file)."""
        if self.step >= self.cfg.training.steps:
            log.info("%s finished at step %d already: nothing to train (raise training.steps to train further)",
                     self.run_dir, self.step)
        self._log_start()
        try:
            return self._loop()
        finally:
            try:
                self.wait_for_save()
            finally:
                self.metrics.close()
                if self.run_lock is not None:
                    self.run_lock.release()

    def _loop(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        records: list[dict[str, Any]] = []
        window: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loss, grad norm) of each step
        started = window_start = time.perf_counter()
        paused_s = 0.0
        first_step = self.step
        while self.step < cfg.training.steps:
            loss, grad_norm = self.train_step()
            window.append((loss, grad_norm))
            last = self.step == cfg.training.steps
            if self.step % cfg.logging.log_interval == 0 or last:
                # The loss reaches the host first: that waits for every step of the window to finish on the device,
                # so the window's time is device time, not just the host's time to launch it.
                mean_loss, skipped = window_loss(*zip(*window))
                loss_value = self._replica_mean(mean_loss).item()
                now = time.perf_counter()
                self.guard.check(self.step)
                record = self._step_record(loss_value, len(window), grad_norm, now - window_start - paused_s,
                                           now - started, first_step, int(skipped))
                records.append(record)
                window, window_start, paused_s = [], now, 0.0
            pause_start = time.perf_counter()  # evaluation and checkpoints are not training time
            if cfg.training.eval_interval > 0 and (self.step % cfg.training.eval_interval == 0 or last):
                records.append(self._eval_record())
            if cfg.checkpoint.interval > 0 and (self.step % cfg.checkpoint.interval == 0 or last):
                self.save()
            paused_s += time.perf_counter() - pause_start
        return records

    def _step_record(self, loss: float, window_steps: int, grad_norm: torch.Tensor, window_s: float,
                     elapsed_s: float, first_step: int, skipped: int) -> dict[str, Any]:
        """The metrics record of a logging window of `window_steps` steps that took `window_s` seconds (measured
        after the window's loss reached the host) with mean loss `loss` over its `window_steps - skipped` applied
        steps (nan if none was)."""
        record_extra = {"loss_scale": self.loss_scaler.scale} if self.loss_scaler is not None else {}
        if self.model_cfg.moe_num_experts > 0:
            record_extra.update(self._moe_record())
        step_s = window_s / window_steps
        tokens_per_s = self.tokens_per_step / step_s
        achieved_tflops = tokens_per_s * self.flops_per_token / self.dims.world_size / 1e12
        steps_done = self.step - first_step
        record = {
            "kind": "train",
            "step": self.step,
            "loss": loss,
            "lr": lr_at(max(0, self.optimizer.step_count - 1), self.cfg.optimizer, self.cfg.training.steps),
            "grad_norm": grad_norm.item(),
            "step_time_s": step_s,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": achieved_tflops,
            "mfu": achieved_tflops / self.peak_tflops if self.peak_tflops else None,
            "skipped_steps": skipped,
            "consumed_tokens": self.step * self.tokens_per_step,
            "elapsed_s": elapsed_s,
            "remaining_s": elapsed_s / steps_done * (self.cfg.training.steps - self.step),
            # the allocator's high-water mark on this (rank 0's) GPU since start: a host-side counter, no sync
            "peak_memory_gib": (torch.cuda.max_memory_allocated(self.device) / 2**30
                                if self.device.type == "cuda" else None),
            **record_extra,
        }
        log.info(format_step_line(record, self.cfg.training.steps))
        self.metrics.write(record)
        return record

    def _moe_record(self) -> dict[str, Any]:
        """Expert balance of the last step over every MoE layer: load spread, bias size, and assignments not
        dispatched (must be 0). Collective over the pipeline group (each stage holds some MoE layers)."""
        loads = (self.expert_loads.cpu() if self.expert_loads is not None  # a stage may hold no MoE layer
                 else torch.zeros(0, self.model_cfg.moe_num_experts))
        bias = max((r.expert_bias.abs().max().item() for r in self.routers), default=0.0)
        if self.dims.pp_group is not None:
            stages: list[Any] = [None] * self.dims.pp
            dist.all_gather_object(stages, (loads, bias), group=self.dims.pp_group)
            loads, bias = torch.cat([s[0] for s in stages]), max(s[1] for s in stages)
        routed = self.tokens_per_step * self.model_cfg.moe_top_k
        return {**expert_load_stats(loads), "moe_bias_abs_max": bias,
                "moe_dropped_tokens": int(routed * loads.shape[0] - loads.sum().item())}

    def _eval_record(self) -> dict[str, Any]:
        loss = self.evaluate()
        record = {"kind": "eval", "step": self.step, "val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}
        log.info("step %d | validation loss %.4f | perplexity %.2f", self.step, loss, record["val_ppl"])
        self.metrics.write(record)
        return record

    def _log_start(self) -> None:
        if self.dims.rank != 0:
            return
        num_params = sum(math.prod(full_shape(p, self.tp.size)) for p in self.whole_model_meta().parameters())
        m = self.model_cfg
        log.info(
            "model: %.2fM parameters (%d layers, hidden %d, %d heads / %d kv, ffn %d, vocab %d, %s) | precision %s",
            num_params / 1e6, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads or m.num_heads,
            m.ffn_hidden_size, m.vocab_size, describe_rope(m.rope_theta, m.rope_scaling), self.recipe.name,
        )
        memory = self.optimizer.memory_bytes()
        log.info(
            "memory per rank: %s (bytes/param: %s) | optimizer %s over %d data-parallel rank(s), moments %s",
            ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.1f} MiB" for k, v in memory.items()),
            " + ".join(f"{v / num_params:.2f}" for v in memory.values()),
            "sharded" if self.cfg.optimizer.sharded else "replicated", self.dims.dp_size, self.cfg.optimizer.moment_dtype,
        )
        log.info(
            "data: %d training samples of %d tokens | %d rank(s) x %d micro-batch(es) x %d samples = %d per step "
            "(%d tokens) | %d steps from step %d | run dir %s",
            len(self.loader.dataset), self.cfg.data.seq_len, self.dims.dp_size, self.num_micro_batches,
            self.cfg.training.micro_batch_size, self.cfg.training.global_batch_size, self.tokens_per_step,
            self.cfg.training.steps, self.step, self.run_dir,
        )
        if self.pipeline is not None:
            log.info("pipeline: %s over %d ranks, %d micro-batches, bubble %.1f%% of step time (from the schedule's "
                     "actions, forward = input-gradient = weight-gradient time) | %s", self.layout.schedule,
                     self.dims.pp, self.num_micro_batches, 100 * self.pipeline.bubble, self.layout.describe())

    # ----------------------------------------------------------------------------- checkpoints
    def whole_model_meta(self) -> Transformer:
        """The model's every stage on the meta device (this rank's model itself without pipelining)."""
        if self.layout is None:
            return self.model
        return full_meta_model(self.cfg, self.model_cfg, self.recipe, self.tp, self.ep)

    def save(self) -> None:
        """Checkpoint the current step (collective; see `megafp8/train/checkpointing.py`): not after
        `training.max_consecutive_skips` skipped steps in a row, never with non-finite state."""
        self.guard.check(self.step)
        self.checkpointer.save()

    def wait_for_save(self) -> None:
        """Block until a background checkpoint write is done; re-raises its error."""
        self.checkpointer.wait()

    def load(self, path: Path) -> None:
        """Resume from checkpoint `path`, already verified (`megafp8.train.resume.verified_resume_path`)."""
        self.checkpointer.load(path)
        if self.recipe.fp8 is not None and 0 < self.cfg.precision.fp8_start_step < self.step:
            apply_fp8_plan(self.model, self.cfg.precision, self.recipe, self.model_cfg.num_layers,
                           check_patterns=self.layout is None)

    def resolved_config(self) -> Config:
        """The run's config with the model's vocabulary resolved (what `config.yaml` records)."""
        return dataclasses.replace(self.cfg, model=self.model_cfg)

    def _resume_or_start(self) -> tuple[bool, Optional[Path]]:
        """Judge what an earlier launch left in the run directory (`megafp8/train/run_history.py`; a ConfigError
        refuses this launch on every rank), then resume from the verified checkpoint, if any. Returns (whether the
        earlier run is to be replaced, the checkpoint resumed from). Writes nothing."""
        verdict = None
        if self.dims.rank == 0:
            earlier = read_earlier_run(self.run_dir, self.checkpoint_dir, self.metrics_path)
            verdict = judge(earlier, config_to_dict(self.resolved_config()), self.cfg.checkpoint.resume,
                            self.cfg.checkpoint.overwrite, self.run_dir, self.checkpoint_dir)
        verdict = on_every_rank(verdict, self.dims)
        if verdict.refusal is not None:
            raise ConfigError(verdict.refusal)
        resume = "none" if verdict.replace else self.cfg.checkpoint.resume
        path = verified_resume_path(resume, self.checkpoint_dir, self.dims)
        if path is not None:
            self.load(path)
        return verdict.replace, path

    def _open_run_directory(self, replace: bool, resumed_from: Optional[Path]) -> ExperimentLogger:
        """Rank 0 (the run validated and its directories locked): remove a replaced run, drop the metric records
        after the step this launch starts from, record the config and open the experiment loggers. Says in one
        line what became of an earlier launch."""
        cfg = self.cfg
        if self.dims.rank == 0:
            relaunch = (self.run_dir / CONFIG_FILE).is_file() or self.metrics_path.is_file()
            if replace:
                remove_earlier_run(self.run_dir, self.checkpoint_dir, self.metrics_path)
                log.info("checkpoint.overwrite: replaced the earlier run in %s", self.run_dir)
            dropped = drop_metrics_after(self.metrics_path, self.step)
            dropped_note = f"; dropped {dropped} metric record(s) after step {self.step}" if dropped else ""
            if resumed_from is not None:
                log.info("resuming %s from step %d (%s)%s", self.run_dir, self.step, resumed_from, dropped_note)
            elif relaunch and not replace:
                log.info("%s holds an earlier launch of this run without a checkpoint: starting it over from step 0"
                         "%s", self.run_dir, dropped_note)
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / CONFIG_FILE).write_text(dump_config(self.resolved_config()))
        return ExperimentLogger(cfg.logging.backends, self.run_dir, self.metrics_path, cfg.run_name or "run",
                                config_to_dict(self.resolved_config()), cfg.logging.wandb_project,
                                enabled=self.dims.rank == 0)
