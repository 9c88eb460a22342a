"""Building one rank's parts of a run from its config: model, gradient buckets, optimizer, data, pipeline runner,
FP8 health monitor and MoE balancing, after one check that the run fits in memory.

Nothing here trains; the loop (`megafp8/train/trainer.py`) steps over what `build_parts` returns.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megafp8.config import Config, ModelConfig, describe_blocks, ignored_settings, validate_config
from megafp8.config.validate import recomputes_in_compiled_graph
from megafp8.data import DistributedLoader, PackedDataset, TokenStream, validation_micro_batches
from megafp8.data.dataset import SequenceShare
from megafp8.data.blend import TrainingMixture, ValidationMixture, read_metas
from megafp8.data.indexed import DatasetMeta
from megafp8.model import (
    Block,
    Fp8Converter,
    Transformer,
    apply_compile,
    apply_recompute,
    describe_rope,
    init_weights,
    resolve_vocab_size,
    unused_vocab_warning,
)
from megafp8.optim import DistributedAdamW
from megafp8.parallel import (
    ContextParallel,
    ExpertParallel,
    GradBuckets,
    ParallelDims,
    TensorParallel,
    full_shape,
    is_expert,
    is_tp_partial,
    tp_shard_of,
)
from megafp8.parallel.pipeline import PipelineLayout, StageSpec
from megafp8.precision import (
    DynamicLossScaler, PrecisionRecipe, common_choice, passed_over, resolve_recipe, select_backend,
)
from megafp8.precision.cpu_gemm import widen_reduced_precision_gemms
from megafp8.train.expert_balance import ExpertBalance
from megafp8.train.fp8_health import Fp8HealthMonitor
from megafp8.train.loggers import ExperimentLogger
from megafp8.train.pipelined import PipelineRunner
from megafp8.train.plan import check_fits, device_capacity, make_plan, pipeline_layout

log = logging.getLogger("megafp8")


@dataclass(frozen=True)
class Parts:
    """What one rank trains with (`build_parts`)."""

    cfg: Config  # with `precision.recipe: auto` resolved
    model_cfg: ModelConfig  # with the vocabulary resolved
    recipe: PrecisionRecipe
    layout: Optional[PipelineLayout]  # None without pipeline parallelism
    model: Transformer  # this rank's shard of its pipeline stages
    fp8: Fp8Converter  # the FP8 layer plan: applied at build, switched on at precision.fp8_start_step, on resume
    optimizer: DistributedAdamW  # over the model's gradient buckets (`optimizer.buckets`)
    loss_scaler: Optional[DynamicLossScaler]  # FP16 only
    loader: DistributedLoader
    valid_set: Optional[PackedDataset]  # None without evaluation
    pipeline: Optional[PipelineRunner]
    health: Fp8HealthMonitor
    expert_balance: Optional[ExpertBalance]  # MoE models only
    # The model's every stage on the meta device (this rank's model itself without pipelining), built when asked.
    whole_model_meta: Callable[[], Transformer]


def build_parts(cfg: Config, dims: ParallelDims, device: torch.device, num_micro_batches: int,
                evaluating: bool = False) -> Parts:
    """Every part of a run on this rank, built in a fixed order (every rank runs the same collectives);
    `evaluating`: the held-out set even where the run does not evaluate (`launch/pretrain.py --evaluate`)."""
    layout = pipeline_layout(cfg)  # built once: the memory check, the model and the pipeline runner read it
    cfg, model_cfg, recipe, metas = resolve(cfg, dims, device, layout)
    tp, ep = dims.tensor_parallel, dims.expert_parallel
    fp8 = Fp8Converter(cfg.precision, recipe, model_cfg.num_layers)
    model = build_model(cfg, model_cfg, recipe, device, tp=tp, ep=ep,
                        stages=layout.local_stages(dims.pp_rank) if layout else None, fp8=fp8,
                        cp=dims.context_parallel)
    loss_scaler = DynamicLossScaler.from_config(cfg.precision) if recipe.name == "fp16" else None
    optimizer = build_optimizer(model, cfg, dims)
    loader, valid_set = build_data(cfg, metas, dims, evaluating)
    training = cfg.training
    pipeline = (PipelineRunner(model, layout, dims, num_micro_batches, training.micro_batch_size, model.max_seq_len,
                               device) if layout else None)  # a context-parallel rank's share of each sequence
    logs = cfg.logging
    health = Fp8HealthMonitor(model, logs.fp8_health_interval, logs.fp8_underflow_warn, logs.fp8_at_max_warn)
    expert_balance = ExpertBalance.attach(model, optimizer, model_cfg.moe, dims) if model_cfg.moe.enabled else None

    def whole_model_meta() -> Transformer:
        return full_meta_model(cfg, model_cfg, recipe, tp, ep) if layout else model
    return Parts(cfg, model_cfg, recipe, layout, model, fp8, optimizer, loss_scaler, loader, valid_set, pipeline,
                 health, expert_balance, whole_model_meta)


def resolve(cfg: Config, dims: ParallelDims, device: torch.device, layout: Optional[PipelineLayout]
            ) -> tuple[Config, ModelConfig, PrecisionRecipe, list[DatasetMeta]]:
    """The config with `precision.recipe: auto` resolved for `device` (re-validated, and logged), the model config
    with the data's vocabulary, the recipe and the metadata of each directory of the data (one tokenizer). Fails fast where the run cannot fit in memory:
    one check, as early as it can run (before even the data is read where the vocabulary is configured)."""
    name, reason = resolve_recipe(cfg.precision.recipe, device, cfg.precision.auto_cpu_recipe)
    configured, cfg = cfg, dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, recipe=name))
    if dims.rank == 0:
        warn_settings_auto_makes_inert(configured, cfg)
    if cfg.model.vocab_size is not None:
        check_memory(cfg, cfg.model, dims.world_size, device, layout)
    metas = read_metas(cfg.data.directories)
    meta = metas[0]  # one tokenizer for them all (`read_metas`)
    model_cfg = resolve_vocab_size(cfg.model, meta.vocab_size, dims.tensor_parallel.size)
    unused = unused_vocab_warning(cfg.model, meta.vocab_size, meta.tokenizer, dims.tensor_parallel.size)
    if unused is not None and dims.rank == 0:
        log.warning(unused)
    validate_config(cfg)  # under the resolved recipe
    log.info("precision: %s (%s)", name, reason)
    if cfg.model.vocab_size is None:
        check_memory(cfg, model_cfg, dims.world_size, device, layout)
    return cfg, model_cfg, agree_on_fp8_backend(PrecisionRecipe.from_config(cfg.precision), device, dims), metas


def warn_settings_auto_makes_inert(configured: Config, resolved: Config) -> None:
    """Under `precision.recipe: auto`, warn of each setting the recipe it chose does not read. The launcher judges the
    config before the device is known and passes over `auto` (it may resolve to any recipe): without this, e.g.
    `precision.fp8_layers` on a GPU where `auto` chose BF16 would be dropped without a word."""
    if configured.precision.recipe != "auto":
        return
    judged = set(ignored_settings(configured))  # warned of by the launcher already
    for line in ignored_settings(resolved):
        if line not in judged:
            log.warning("%s, which precision.recipe=auto chose here", line)


def agree_on_fp8_backend(recipe: PrecisionRecipe, device: torch.device, dims: ParallelDims) -> PrecisionRecipe:
    """The recipe with `precision.fp8_backend: auto` resolved to one backend that every rank runs. Each rank's
    `auto` asks its own machine (DeepGEMM's check runs in each process), and a rank where a check failed would
    otherwise run the next backend down alone: a slower rank that every collective waits for, said nowhere. Every
    rank runs the choice of lowest priority, and rank 0 warns, naming the ranks that chose less and why."""
    if recipe.fp8 is None or recipe.fp8.backend != "auto":
        return recipe
    mine = select_backend("auto", device)
    agreed = mine.name
    if dims.is_distributed:
        choices: list[Any] = [None] * dims.world_size
        dist.all_gather_object(choices, (mine.name, passed_over(mine, device)))
        agreed = common_choice([name for name, _ in choices])
        if len({name for name, _ in choices}) > 1 and dims.rank == 0:
            short = [f"rank {rank} runs {name}: " + "; ".join(f"{other}: {why}" for other, why in reasons)
                     for rank, (name, reasons) in enumerate(choices) if name == agreed]
            log.warning("fp8: auto chose other backends on other ranks; every rank runs %s, the best all of them "
                        "can: %s", agreed, " | ".join(short))
    return dataclasses.replace(recipe, fp8=dataclasses.replace(recipe.fp8, backend=agreed))


def check_memory(cfg: Config, model_cfg: ModelConfig, world_size: int, device: torch.device,
                 layout: Optional[PipelineLayout]) -> None:
    """Fail fast (ConfigError) when the planned state of a rank exceeds its device's memory."""
    ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    plan = make_plan(dataclasses.replace(cfg, model=model_cfg), world_size, layout)
    where = "the GPU has" if device.type == "cuda" else f"this host has, per rank ({ranks_on_host} here),"
    check_fits(plan, device_capacity(device, ranks_on_host), where)


def build_model(cfg: Config, model_cfg: ModelConfig, recipe: PrecisionRecipe, device: torch.device,
                tp: Optional[TensorParallel] = None, ep: Optional[ExpertParallel] = None,
                stages: Optional[list[StageSpec]] = None, fp8: Optional[Fp8Converter] = None,
                cp: Optional[ContextParallel] = None) -> Transformer:
    """The decoder (this rank's tensor-parallel shard, experts and pipeline `stages`), initialized from the seed,
    with the FP8 layer plan of `fp8` (default: the config's) checked, applied for step 0 and logged: under
    `precision.fp8_start_step` every layer starts in BF16."""
    if device.type == "cpu":  # BF16 GEMMs in FP32 where this CPU has no BF16 instructions (~30x faster there)
        widen_reduced_precision_gemms()
    fp8 = fp8 or Fp8Converter(cfg.precision, recipe, model_cfg.num_layers)
    # The plan is checked once, against the whole model on the meta device (a stage holds only some layers), before
    # this rank builds its part.
    plan = fp8.check(full_meta_model(cfg, model_cfg, recipe, tp, ep))
    model = Transformer(model_cfg, recipe, cfg.data.seq_len, tp, device=device, ep=ep,
                        fp8_dispatch=cfg.parallel.ep_dispatch_fp8, stages=stages, cp=cp)
    init_weights(model, model_cfg, cfg.training.seed, tp)
    fp8.convert(model)
    if cfg.training.compile:
        log.info("torch.compile (mode %s): %d blocks", cfg.training.compile_mode,
                 apply_compile(model, cfg.training.compile_mode, comm_overlap=cfg.training.compile_comm_overlap,
                               recompute_in_graph=recomputes_in_compiled_graph(cfg)))
    recomputing = apply_recompute(model, cfg.training.recompute, cfg.training.recompute_layers)
    if recomputing:
        blocks = sum(isinstance(m, Block) for m in model.modules())
        log.info("activation recomputation: %d of this rank's %d blocks keep only their input for backward",
                 recomputing, blocks)
    if recipe.fp8 is not None:
        backend = select_backend(recipe.fp8.backend, device)
        chosen_by_auto = cfg.precision.fp8_backend == "auto"  # the recipe's own is resolved (`resolve`)
        log.info("fp8: backend %s%s | %s%s", backend.name, " (auto)" if chosen_by_auto else "",
                 plan.summary(), "" if fp8.runs_fp8_at(0) else f" | BF16 until step {fp8.start_step}")
        if chosen_by_auto and device.type == "cuda":  # on a CPU, only the reference runs
            for name, reason in passed_over(backend, device):
                log.info("fp8: auto did not pick the %s backend: %s", name, reason)
    return model


def full_meta_model(cfg: Config, model_cfg: ModelConfig, recipe: PrecisionRecipe, tp: Optional[TensorParallel],
                    ep: Optional[ExpertParallel]) -> Transformer:
    """The whole model (every pipeline stage) on the meta device: names and shapes, no memory."""
    return Transformer(model_cfg, recipe, cfg.data.seq_len, tp, device=torch.device("meta"), ep=ep,
                       fp8_dispatch=cfg.parallel.ep_dispatch_fp8)


def build_optimizer(model: Transformer, cfg: Config, dims: ParallelDims) -> DistributedAdamW:
    """FP32-master AdamW over gradient buckets of the model's trainable parameters (`optimizer.buckets`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt, tp = cfg.optimizer, dims.tensor_parallel
    # Under sequence parallelism every TP-replicated weight (the norms) sees only this rank's tokens; a weight all
    # heads share (the query/key norms) sees only this rank's heads, with or without it.
    partial = ({p: tp.group for p in params if tp_shard_of(p) is None and (tp.sp or is_tp_partial(p))}
               if tp.enabled else {})
    # Routed experts are reduced over their expert-data-parallel replicas, dense weights over all replicas.
    group_of = {p: dims.edp_group if is_expert(p) else dims.dp_group for p in params}
    buckets = GradBuckets(params, group_of, bucket_numel=int(opt.bucket_size_mb * 2**20 / 4), sharded=opt.sharded,
                          overlap=opt.overlap_grad_reduce, also_sum_over=partial, mean_over=dims.dp)
    names = {p: n for n, p in model.named_parameters()}
    return DistributedAdamW(buckets, names, opt, tp, dims.expert_parallel, dims.pp_group)


def build_data(cfg: Config, metas: list[DatasetMeta], dims: ParallelDims,
               evaluating: bool = False) -> tuple[DistributedLoader, Optional[PackedDataset]]:
    """This rank's training loader and, when the run evaluates (or only `evaluating`), the held-out set: of one
    directory, or of the mixture of several (`data.paths`, `megafp8.data.blend`)."""
    data, training = cfg.data, cfg.training

    def split(name: str) -> list[PackedDataset]:
        return [PackedDataset(TokenStream(meta, name), data.seq_len, name) for meta in metas]

    train_sets = split(data.train_split)
    train_set = train_sets[0] if len(metas) == 1 else TrainingMixture(train_sets, data.weights)
    valid_set = None
    if training.eval_interval > 0 or evaluating:
        valid_sets = split(data.valid_split)
        valid_set = valid_sets[0] if len(metas) == 1 else ValidationMixture(valid_sets, data.weights)
    if dims.rank == 0:
        _warn_of_repeated_samples(cfg, train_set, valid_set)
    cp = dims.context_parallel
    if cp.enabled:  # a context-parallel group reads one replica's samples, each rank its tokens of them
        positions = cp.positions(data.seq_len)
        train_set = SequenceShare(train_set, positions)
        valid_set = SequenceShare(valid_set, positions) if valid_set is not None else None
    loader = DistributedLoader(train_set, training.global_batch_size, training.micro_batch_size, dims.replica_rank,
                               dims.replicas, training.seed if data.seed is None else data.seed)
    return loader, valid_set


def _warn_of_repeated_samples(cfg: Config, train_set: PackedDataset, valid_set: Optional[PackedDataset]) -> None:
    """The loader walks its sample order round and round, and validation wraps around its split: a batch larger
    than its split reads some samples twice (allowed: a smoke test on a small corpus), said once at start-up."""
    data, training = cfg.data, cfg.training
    if training.global_batch_size > len(train_set):
        log.warning("training.global_batch_size=%d is more than the %d samples of split '%s': every step holds some "
                    "samples more than once (add data, or lower training.global_batch_size or data.seq_len)",
                    training.global_batch_size, len(train_set), data.train_split)
    if valid_set is None:
        return
    num_valid = validation_micro_batches(training.eval_iters, training.micro_batch_size,
                                         len(valid_set)) * training.micro_batch_size
    if num_valid > len(valid_set):
        log.warning("validation reads training.eval_iters x training.micro_batch_size = %d samples, more than the %d "
                    "of split '%s': it reads some more than once (add held-out data, or lower training.eval_iters)",
                    num_valid, len(valid_set), data.valid_split)


def epochs_read(consumed: int, steps_left: int, global_batch_size: int, num_samples: int) -> str:
    """How far through the training split the run's last step reads, in epochs (past 1, samples repeat: the next
    epoch's order follows the last), from the loader's position `consumed` with `steps_left` steps to run."""
    end = (consumed + steps_left * global_batch_size) / num_samples
    if end <= 1:
        return f"{end:.3g} epoch(s) of the data by the last step"
    first = max(0, -(-(num_samples - consumed) // global_batch_size))  # steps from here until the data runs out
    return (f"{end:.3g} epochs of the data by the last step: samples repeat from {first} step(s) on (the next "
            "epoch's order)")


def describe_mixture(mixture: TrainingMixture) -> str:
    """Each directory of a mixture with its share of the samples, its samples and how often an epoch of the
    mixture reads them."""
    return " | ".join(f"{d.stream.meta.root}: {share:.1%} of the samples, {len(d)} samples, read {reads:.2f}x an "
                      "epoch" for d, share, reads in zip(mixture.datasets, mixture.shares, mixture.reads_per_epoch()))


def build_logger(cfg: Config, config: dict[str, Any], run_dir: Path, metrics_path: Path,
                 dims: ParallelDims) -> ExperimentLogger:
    """The experiment loggers of `logging.backends` on rank 0 (a no-op elsewhere), recording the resolved `config`."""
    logs = cfg.logging
    return ExperimentLogger(logs.backends, run_dir, metrics_path, cfg.run_name or "run", config, logs.wandb_project,
                            enabled=dims.rank == 0)


def log_run_start(cfg: Config, model_cfg: ModelConfig, recipe: PrecisionRecipe, whole_model: Transformer,
                  optimizer: DistributedAdamW, loader: DistributedLoader, pipeline: Optional[PipelineRunner],
                  dims: ParallelDims, num_micro_batches: int, step: int, run_dir: Path) -> None:
    """Rank 0: the model (`whole_model`: every stage, on the meta device), memory per rank, data and pipeline of
    the run, one line each."""
    if dims.rank != 0:
        return
    num_params = sum(math.prod(full_shape(p)) for p in whole_model.parameters())
    m, training = model_cfg, cfg.training
    blocks = recipe.fp8 is not None and recipe.fp8.wgrad_input_blocks  # an opt-in off DeepSeek-V3's recipe: said
    log.info("model: %.2fM parameters (%s, vocab %d, %s) | precision %s%s", num_params / 1e6, describe_blocks(m),
             m.vocab_size, describe_rope(m.rope_theta, m.rope_scaling), recipe.name,
             " (the wgrads' x in 128x128 blocks: precision.fp8_wgrad_input_blocks)" if blocks else "")
    memory = optimizer.memory_bytes()
    log.info(
        "memory per rank: %s (bytes/param: %s) | optimizer %s over %d data-parallel rank(s), moments %s",
        ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.1f} MiB" for k, v in memory.items()),
        " + ".join(f"{v / optimizer.num_params():.2f}" for v in memory.values()),  # this rank's bytes by its params
        "sharded" if cfg.optimizer.sharded else "replicated", dims.dp_size, cfg.optimizer.moment_dtype,
    )
    log.info(
        "data: %d training samples of %d tokens | %d %s x %d micro-batch(es) x %d samples = %d per step "
        "(%d tokens) | %d steps from step %d, %s | run dir %s",
        len(loader.dataset), cfg.data.seq_len, dims.replicas,
        f"context-parallel group(s) of {dims.cp} rank(s)" if dims.cp > 1 else "rank(s)", num_micro_batches,
        training.micro_batch_size,
        training.global_batch_size, training.global_batch_size * cfg.data.seq_len, training.steps, step,
        epochs_read(loader.consumed_samples, training.steps - step, training.global_batch_size, len(loader.dataset)),
        run_dir,
    )
    dataset = loader.dataset.dataset if isinstance(loader.dataset, SequenceShare) else loader.dataset
    if isinstance(dataset, TrainingMixture):
        log.info("data mixture: %s", describe_mixture(dataset))
    if pipeline is not None:
        log.info("pipeline: %s over %d ranks, %d micro-batches, bubble %.1f%% of step time (from the schedule's "
                 "actions, forward = input-gradient = weight-gradient time) | %s", pipeline.layout.schedule,
                 dims.pp, num_micro_batches, 100 * pipeline.bubble, pipeline.layout.describe())
