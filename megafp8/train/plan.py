"""Dry-run planning: parameters, per-GPU memory and throughput of a config, without allocating the model.

The model is built on the meta device (shapes only), as one tensor-parallel rank's shard, once per pipeline rank,
with the FP8 layer plan applied. Memory per rank follows the optimizer's layout: model weights in the recipe's dtype,
the FP32 gradient buffer (plus this rank's reduced shard when sharded), FP32 master weights and AdamW moments divided
over data-parallel ranks when sharded, and the FP8 layers' quantized weight copies.

Activations are counted tensor by tensor from the rank's model (`megafp8.train.activations`): what each block keeps
for backward in its recipe (BF16 blocks keep SwiGLU's FFN-wide intermediates, FP8 linears keep x^T in FP8, MoE
layers their routed rows in the experts' layout, attention q/k/v, output and logsumexp), under `training.compile`
without the intermediates Inductor recomputes; times the micro-batches in flight at once. On the rank holding the
head: the final norm, LM head input and the logits of every loss (`logits and loss`; the loss keeps them, not an
FP32 copy). Counted once on top (`transient peak`): the largest transient, the logits' gradient or a block's
gradient temporaries where those are larger. Under `precision.fp8_start_step` the
activations are those of the larger phase (BF16 before the switch). The prediction is meant to hold within 10% of
the allocator's steady peak (`benchmarks/train_step.py` prints both).

With `training.recompute: full` a block keeps only its input for every micro-batch in flight, plus one block's full
working set while it is recomputed; `training.recompute_layers` limits that to each rank's first blocks, the others
counted as without recomputation.

Under pipeline parallelism every pipeline rank is planned (its stages' weights; activations of its layers for the
micro-batches in flight at once, at most the step's micro-batches: pp - rank under 1F1B, pp under ZB-V,
pp x (1 + (pp-1)/(pp x v)) under the interleaved schedules, pp + 1 under DualPipeV; the head's on the rank holding
the last stage) and the busiest one is reported.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from megafp8.config import Config, ConfigError, describe_blocks
from megafp8.data import read_meta
from megafp8.config.validate import data_parallel_size, validate_for_world
from megafp8.model import (Fp8Converter, Transformer, describe_rope, recomputed_blocks, resolve_vocab_size,
                           training_flops_per_token)
from megafp8.parallel import ContextParallel, ExpertParallel, TensorParallel, full_shape, is_expert
from megafp8.parallel.pipeline import PipelineLayout, StageSpec, build_layout
from megafp8.precision import PrecisionRecipe
from megafp8.train.activations import MicroBatch, rank_activations

GIB = 2**30


@dataclass
class Plan:
    params: dict[str, int]  # by part: embedding, attention, mlp (dense, shared experts, routers), experts, norms,
    #                           lm_head, mtp
    bytes_per_rank: dict[str, float]  # weights, grads, master_weights, optimizer_states, activations
    flops_per_token: float
    world_size: int
    activated_per_token: float = 0.0  # main-model parameters one token passes through (top-k experts; no MTP)
    pipeline: list[tuple[int, str, int, int, float]] = dataclasses.field(default_factory=list)
    # per pipeline rank: (rank, its stages, transformer blocks, parameters of its TP/EP shard, bytes planned)
    busiest_rank: int = 0  # the pipeline rank `bytes_per_rank` is of (0 without pipelining)
    activations_note: str = ""  # what the activation lines count, for the dry run

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    @property
    def main_params(self) -> int:
        """Parameters without the multi-token-prediction modules (how DeepSeek-V3 counts its 671B)."""
        return self.total_params - self.params.get("mtp", 0)

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes_per_rank.values())

    def tokens_per_s(self, peak_tflops: float, mfu: float) -> float:
        """Tokens per second of all the run's GPUs together at `mfu` of `peak_tflops` each."""
        return peak_tflops * 1e12 * mfu * self.world_size / self.flops_per_token

    def render(self, peak_tflops: float, mfu: float) -> str:
        lines = ["| part | parameters |", "|---|---|"]
        lines += [f"| {part} | {count / 1e6:,.2f}M |" for part, count in self.params.items()]
        lines += [f"| **total** | **{self.total_params / 1e6:,.2f}M** |"]
        if "mtp" in self.params or "experts" in self.params:
            lines += [f"| without MTP | {self.main_params / 1e6:,.2f}M |",
                      f"| activated per token (top-k experts, without MTP) | {self.activated_per_token / 1e6:,.2f}M |"]
        if self.pipeline:
            lines += ["", "| pipeline rank | stages | blocks | parameters (one TP/EP shard) | memory GiB |",
                      "|---|---|---|---|---|"]
            lines += [f"| {rank} | {stages} | {blocks} | {count / 1e6:,.2f}M | {memory / GIB:,.2f} |"
                      for rank, stages, blocks, count, memory in self.pipeline]
        busiest = f", pipeline rank {self.busiest_rank} (the busiest)" if self.pipeline else ""
        lines += ["",
                  f"| memory per rank ({self.world_size} rank(s){busiest}) | GiB |", "|---|---|"]
        lines += [f"| {k.replace('_', ' ')} | {v / GIB:,.2f} |" for k, v in self.bytes_per_rank.items()]
        lines += [f"| **total** | **{self.total_bytes / GIB:,.2f}** |"]
        lines += ["", self.activations_note] if self.activations_note else []
        lines += ["",
                  f"training FLOPs per token: {self.flops_per_token / 1e9:,.2f} GFLOP",
                  f"tokens/s at {100 * mfu:.0f}% MFU of {peak_tflops:g} TFLOP/s per GPU, all {self.world_size} "
                  f"GPU(s) together: {self.tokens_per_s(peak_tflops, mfu):,.0f} "
                  f"({self.tokens_per_s(peak_tflops, mfu) / self.world_size:,.0f} per GPU)"]
        return "\n".join(lines)


def _part(name: str) -> str:
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".experts." in name:
        return "experts"
    return "attention" if ".attn." in name else "mlp"


def pipeline_layout(cfg: Config) -> Optional[PipelineLayout]:
    """The run's pipeline stages and the ranks holding them; None without pipeline parallelism."""
    par = cfg.parallel
    if par.pp == 1:
        return None
    return build_layout(cfg.model.num_layers, par.pp, par.pp_schedule, par.pp_virtual_stages, par.pp_layout)


def make_plan(cfg: Config, world_size: int, layout: Optional[PipelineLayout] = None) -> Plan:
    """The plan of `cfg` on `world_size` ranks (parallel.tp of them per model replica); `model.vocab_size`
    must be set. `layout`: the run's pipeline where the caller has built it (`pipeline_layout`)."""
    if cfg.model.vocab_size is None:
        raise ConfigError("planning needs model.vocab_size (it is otherwise read from the data): set it")
    tp, pp, ep = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep
    dp = data_parallel_size(world_size, tp, pp, ep)
    layout = layout if layout is not None else pipeline_layout(cfg)
    recipe_name = cfg.precision.recipe if cfg.precision.recipe != "auto" else "fp8"
    shard_layout = TensorParallel(None, tp, 0, cfg.parallel.sequence_parallel)  # shapes only: no group needed
    recipe = PrecisionRecipe.from_name(recipe_name)
    fp8 = Fp8Converter(cfg.precision, recipe, cfg.model.num_layers)

    def meta_model(stages: Optional[list[StageSpec]] = None) -> Transformer:
        return Transformer(cfg.model, recipe, cfg.data.seq_len, shard_layout, device="meta",
                           ep=ExpertParallel(None, ep, 0), stages=stages, cp=ContextParallel(None, cfg.parallel.cp, 0))

    whole = meta_model()
    params: dict[str, int] = {p: 0 for p in ("embedding", "attention", "mlp", "experts", "norms", "lm_head", "mtp")}
    for name, p in whole.named_parameters():
        params[_part(name)] += math.prod(full_shape(p))  # every expert, every TP shard
    # Each pipeline rank's model: its stages' parts (without pipelining, the whole model).
    ranks = [(whole, None)] if layout is None else [(meta_model(stages), stages) for stages in
                                                    (layout.local_stages(r) for r in range(pp))]
    micro_batch = MicroBatch.of(cfg)
    replicas = dp // cfg.parallel.cp  # a context-parallel group reads one replica's micro-batches
    micro_batches = max(1, cfg.training.global_batch_size // (cfg.training.micro_batch_size * replicas))
    pipeline, per_rank = [], []
    for rank, (model, stages) in enumerate(ranks):
        rank_params = list(model.parameters())
        n = sum(p.numel() for p in rank_params)
        n_expert = sum(p.numel() for p in rank_params if is_expert(p))
        weight_bytes = sum(p.numel() * p.element_size() for p in rank_params)  # the recipe's dtype; routers FP32
        memory = _static_bytes(cfg, n, n_expert, *_fp8_weight_numel(model, fp8), dp, weight_bytes)
        recompute = recomputed_blocks(cfg.training.recompute, cfg.training.recompute_layers, _blocks(model))
        memory.update(_largest_phase(model, fp8, micro_batch, recompute, _in_flight(cfg, rank, micro_batches)))
        per_rank.append(memory)
        if stages is not None:
            pipeline.append((rank, _describe_stages(stages), len(model.layers), n, sum(memory.values())))
    for part, unused in (("experts", not cfg.model.moe.enabled), ("mtp", cfg.model.mtp_depth == 0)):
        if unused:
            del params[part]
    # The pipeline rank whose weights, gradients, optimizer state, FP8 copies and activations take the most memory.
    busiest = max(range(len(per_rank)), key=lambda r: sum(per_rank[r].values()))
    moe = cfg.model.moe
    routed_share = moe.top_k / moe.num_experts if moe.enabled else 1.0
    activated = sum(v for k, v in params.items() if k not in ("experts", "mtp")) + params.get("experts", 0) * routed_share
    return Plan(params, per_rank[busiest], training_flops_per_token(cfg.model, cfg.data.seq_len), world_size,
                activated, pipeline, busiest, _activations_note(cfg, _in_flight(cfg, busiest, micro_batches)))


def _blocks(model: Transformer) -> int:
    """The transformer blocks of a rank's model: its layers, and the MTP modules' where it holds the head."""
    return len(model.layers) + (len(model.mtp) if model.has_head else 0)


def _largest_phase(model: Transformer, fp8: Fp8Converter, micro_batch: MicroBatch, recompute: int,
                   in_flight: float) -> dict[str, float]:
    """Activation bytes of `model` (a meta copy) with its GEMM layers as the FP8 plan runs them; under
    `precision.fp8_start_step`, of the phase that needs more (before it every layer runs BF16)."""
    phases = [fp8.start_step] + ([0] if fp8.runs_fp8_at(fp8.start_step) and fp8.start_step > 0 else [])
    candidates = []
    for step in phases:
        fp8.convert(model, step)
        candidates.append(rank_activations(model, micro_batch, recompute, in_flight))
    return max(candidates, key=lambda c: sum(c.values()))


# Bytes per weight of one FP8 copy in 128x128 blocks: one byte per value, one FP32 scale per block.
_FP8_COPY_BYTES = 1 + 4 / (128 * 128)


def _static_bytes(cfg: Config, n: int, n_expert: int, n_fp8: int, n_fp8_experts: int, largest_expert_fp8: int,
                  largest_dense_fp8: int, dp: int, weight_bytes: int) -> dict[str, float]:
    """One rank's bytes of weights (`weight_bytes`: its parameters in their dtypes), FP32 gradients, masters and
    moments (sharded over data-parallel ranks, the routed experts over their expert-data-parallel replicas) and FP8
    weight copies; `n` parameters, `n_expert` of them routed experts, `n_fp8` in dense FP8 GEMM layers (the largest
    has `largest_dense_fp8`) and `n_fp8_experts` in FP8 expert projections (the largest: `largest_expert_fp8`). A
    sharded optimizer reduce-scatters into a shard buffer of its own, except over a group of one (the gradients are
    their own shard: `megafp8.parallel.grad_buckets`)."""
    ep = cfg.parallel.ep
    dense_shard, expert_shard = (n - n_expert) / dp, n_expert / (dp // ep)
    sharded_numel = dense_shard + expert_shard if cfg.optimizer.sharded else n
    shard_buffers = (dense_shard if dp > 1 else 0) + (expert_shard if dp // ep > 1 else 0)
    moment_bytes = 4 if cfg.optimizer.moment_dtype == "fp32" else 2
    keep_transpose = cfg.precision.fp8_keep_weight_transpose
    static = {
        "weights": weight_bytes,
        "grads": n * 4 + (shard_buffers * 4 if cfg.optimizer.sharded else 0),
        "master_weights": sharded_numel * 4,
        "optimizer_states": sharded_numel * 2 * moment_bytes,
        # Each dense FP8 layer keeps its weight quantized for the step, with the transposed copy dgrad reads unless
        # `precision.fp8_keep_weight_transpose` is false; the expert projections keep only the weight. Transposes
        # not kept are made in backward, one at a time (one of each kind counted).
        "fp8_weight_copies": ((2 if keep_transpose else 1) * n_fp8 + n_fp8_experts) * _FP8_COPY_BYTES,
    }
    if largest_expert_fp8:
        static["fp8_expert_transpose_in_backward"] = largest_expert_fp8 * _FP8_COPY_BYTES
    if largest_dense_fp8 and not keep_transpose:
        static["fp8_dense_transpose_in_backward"] = largest_dense_fp8 * _FP8_COPY_BYTES
    return static


def _fp8_weight_numel(model: Transformer, fp8: Fp8Converter) -> tuple[int, int, int, int]:
    """Weights of `model` (a meta copy) in layers that run FP8 under the config's layer plan: (in dense layers, in
    expert projections, in the largest expert projection, in the largest dense layer)."""
    layers = dict(model.named_modules())
    sizes = [(layers[name].weight.numel(), is_expert(layers[name].weight)) for name in fp8.plan(model).fp8_layers]
    experts = [numel for numel, expert in sizes if expert]
    dense = [numel for numel, expert in sizes if not expert]
    return sum(dense), sum(experts), max(experts, default=0), max(dense, default=0)


def _describe_stages(stages: list[StageSpec]) -> str:
    """A pipeline rank's stages in words, e.g. `0, 31 (embedding, head)`."""
    extras = (["embedding"] if any(s.first for s in stages) else []) + (["head"] if any(s.last for s in stages) else [])
    return ", ".join(str(s.index) for s in stages) + (f" ({', '.join(extras)})" if extras else "")


def _activations_note(cfg: Config, in_flight: float) -> str:
    """What the activation lines of the memory table count, in one line."""
    training = cfg.training
    keeps = "what each block keeps for backward" + (" (compiled)" if training.compile else "")
    if training.recompute != "full":
        kept = keeps
    elif training.recompute_layers is None:
        kept = "each block's input (recomputed in backward)"
    else:
        kept = (f"the input of each rank's first {training.recompute_layers} block(s) (recomputed in backward), "
                f"{keeps} of the others")
    return (f"activations: {kept}, {in_flight:g} micro-batch(es) in flight; logits and loss: the head's kept logits, "
            "LM head input and norm, per loss; transient peak: the largest temporary on top, counted once "
            "(megafp8/train/activations.py)")


def _in_flight(cfg: Config, pp_rank: int, micro_batches: int) -> float:
    """Micro-batches whose activations pipeline rank `pp_rank` holds at once (1 without pipelining), at most the
    step's `micro_batches`."""
    pp, schedule = cfg.parallel.pp, cfg.parallel.pp_schedule
    if pp == 1:
        return 1.0
    if schedule == "1f1b":
        in_flight = pp - pp_rank  # warm-up forwards: the first rank holds pp, the last one
    elif schedule in ("interleaved_1f1b", "interleaved_zb"):
        v = cfg.parallel.pp_virtual_stages
        in_flight = pp * (1 + (pp - 1) / (pp * v))  # Megatron's interleaved-schedule activation factor
    else:
        in_flight = pp + 1 if schedule == "dualpipev" else pp  # the V schedules: the same on every rank
    return float(min(in_flight, micro_batches))


def with_vocab(cfg: Config) -> Config:
    """`cfg` with model.vocab_size resolved from the data's tokenizer when it is not set."""
    if cfg.model.vocab_size is not None:
        return cfg

    try:
        vocab = read_meta(cfg.data.directories[0]).vocab_size
    except ConfigError:
        raise ConfigError(f"a dry run needs model.vocab_size or the data at data.path ({cfg.data.directories[0]}): "
                          "set model.vocab_size=N") from None
    return dataclasses.replace(cfg, model=resolve_vocab_size(cfg.model, vocab, cfg.parallel.tp))


def vocab_note(cfg: Config) -> Optional[str]:
    """A YAML comment line for a printed config whose model.vocab_size is null: what start-up resolves it to from
    the data at data.path (or that it will, where there is no data there yet); None where it is set."""
    if cfg.model.vocab_size is not None:
        return None
    where = cfg.data.directories[0]
    try:
        meta = read_meta(where)
    except ConfigError:
        return f"# model.vocab_size: null is set at start-up from the tokenizer of the data at {where}\n"
    padded = resolve_vocab_size(cfg.model, meta.vocab_size, cfg.parallel.tp).vocab_size
    return (f"# model.vocab_size: null is {padded} at start-up: the {meta.vocab_size} ids of {where}'s "
            f"tokenizer ({meta.tokenizer}), padded (model.pad_vocab_to_multiple_of)\n")


def dry_run(cfg: Config, world_size: int, peak_tflops: float, mfu: float) -> str:
    """The plan of `cfg` on `world_size` ranks as text (nothing is allocated, no process group is needed)."""
    cfg = with_vocab(cfg)
    validate_for_world(cfg, world_size)  # every check the launch applies before it allocates
    m = cfg.model
    header = (f"{cfg.run_name or 'run'}: {describe_blocks(m)}{f', MTP depth {m.mtp_depth}' if m.mtp_depth else ''}, "
              f"{describe_rope(m.rope_theta, m.rope_scaling)}, "
              f"vocab {m.vocab_size}, seq "
              f"{cfg.data.seq_len}, micro-batch {cfg.training.micro_batch_size}, precision {cfg.precision.recipe}, "
              f"tp {cfg.parallel.tp}{' with sequence parallelism' if cfg.parallel.sequence_parallel else ''}"
              f"{f', ep {cfg.parallel.ep}' if cfg.parallel.ep > 1 else ''}"
              f"{f', cp {cfg.parallel.cp} (each rank 1/{cfg.parallel.cp} of a sequence)' if cfg.parallel.cp > 1 else ''}"
              f"{f', pp {cfg.parallel.pp} ({cfg.parallel.pp_schedule})' if cfg.parallel.pp > 1 else ''}, "
              f"optimizer {'sharded' if cfg.optimizer.sharded else 'replicated'} over "
              f"{data_parallel_size(world_size, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep)} data-parallel "
              "rank(s)" + (" | memory of the busiest pipeline rank" if cfg.parallel.pp > 1 else ""))
    return header + "\n\n" + make_plan(cfg, world_size).render(peak_tflops, mfu)


def device_capacity(device: torch.device, ranks_on_host: int = 1) -> Optional[int]:
    """Bytes of memory one rank may use: its GPU's, or on CPU this host's physical memory shared by its ranks
    (None where the host does not say)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, ranks_on_host)
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(plan: Plan, capacity: Optional[int], where: str = "the GPU has") -> None:
    """Fail fast, before allocating anything, when a GPU of `capacity` bytes cannot hold the planned state."""
    if capacity is not None and plan.total_bytes > capacity:
        parts = ", ".join(f"{k} {v / GIB:,.1f}" for k, v in plan.bytes_per_rank.items())
        raise ConfigError(
            f"this run needs about {plan.total_bytes / GIB:,.1f} GiB per GPU ({parts} GiB) but {where} "
            f"{capacity / GIB:,.1f} GiB: use more ranks, a smaller micro-batch or model; "
            "see `python launch/pretrain.py --config ... --dry-run --world-size N`"
        )
