"""Cross-field validation of a config, with messages that say which setting to change.

`validate_config` needs only the config; `validate_for_world` also needs the number of ranks. Both run
before anything is allocated (the launch and the dry run apply both), so sizes are bounded here with
arithmetic only: a model of absurd size is refused in one line instead of overflowing a tensor's size or
taking minutes to plan. (Every float is finite: the loader refuses inf and nan.)
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Optional

from megafp8.config.architecture import approximate_parameters
from megafp8.config.errors import ConfigError, divisors_near, nearest
from megafp8.config.layout import V_SHAPED, ZERO_BUBBLE, layer_counts, micro_batch_problem
from megafp8.config.schema import (Config, DataConfig, ModelConfig, OptimizerConfig, PrecisionConfig,
                                   RopeScalingConfig)

# The model.rope_scaling fields each scaling type reads (factor and original_max_position_embeddings: all).
_ROPE_SCALING_FIELDS = {"none": (), "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                             "mscale", "mscale_all_dim"),
                        "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}


MAX_LAYERS = 1024  # planning builds every block on the meta device: 1000 take ~7 s on the 2-core CPU machine
MAX_PARAMETERS = 10**15  # ~1500x DeepSeek-V3's 671B; far below where a tensor's byte size overflows int64
MAX_MICRO_BATCH_TOKENS = 2**31
MAX_TIMEOUT_MINUTES = 7 * 24 * 60  # torch.distributed's timeout is a C++ duration: no further


def _check_positive(cfg: Config) -> None:
    checks = {
        "model.hidden_size": cfg.model.hidden_size,
        "model.num_layers": cfg.model.num_layers,
        "model.num_heads": cfg.model.num_heads,
        "model.ffn_hidden_size": cfg.model.ffn_hidden_size,
        "model.pad_vocab_to_multiple_of": cfg.model.pad_vocab_to_multiple_of,
        "data.seq_len": cfg.data.seq_len,
        "training.steps": cfg.training.steps,
        "training.global_batch_size": cfg.training.global_batch_size,
        "training.micro_batch_size": cfg.training.micro_batch_size,
        "logging.log_interval": cfg.logging.log_interval,
        "parallel.tp": cfg.parallel.tp,  # before anything divides by them (the vocabulary's padding, the layout)
        "parallel.pp": cfg.parallel.pp,
        "parallel.ep": cfg.parallel.ep,
    }
    for key, value in checks.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if cfg.training.eval_iters < -1:
        raise ConfigError(f"training.eval_iters must be >= 0, or -1 for the whole validation split, got "
                          f"{cfg.training.eval_iters}")
    if cfg.training.eval_interval > 0 and cfg.training.eval_iters == 0:
        raise ConfigError(f"training.eval_iters={cfg.training.eval_iters}: evaluation (training.eval_interval="
                          f"{cfg.training.eval_interval}) needs at least 1 micro-batch; raise it, set it to -1 for "
                          "the whole validation split, or set training.eval_interval=0 to turn evaluation off")
    if cfg.training.max_consecutive_skips < 1:
        raise ConfigError(f"training.max_consecutive_skips must be at least 1, got {cfg.training.max_consecutive_skips}")
    if not 0 < cfg.parallel.timeout_minutes <= MAX_TIMEOUT_MINUTES:
        raise ConfigError(f"parallel.timeout_minutes must be above 0 and at most {MAX_TIMEOUT_MINUTES} (a week), got "
                          f"{cfg.parallel.timeout_minutes:g}")
    if cfg.logging.peak_tflops is not None and cfg.logging.peak_tflops <= 0:
        raise ConfigError(f"logging.peak_tflops must be positive (or null), got {cfg.logging.peak_tflops:g}")
    for key, value in {
        "training.eval_interval": cfg.training.eval_interval,
        "optimizer.warmup_steps": cfg.optimizer.warmup_steps,
        "checkpoint.interval": cfg.checkpoint.interval,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "logging.fp8_health_interval": cfg.logging.fp8_health_interval,  # (negative: silently never sampled)
    }.items():
        if value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")


def _check_model(cfg: Config) -> None:
    m = cfg.model
    m.attention.validate(m.hidden_size, m.num_heads)
    m.moe.validate(m.num_layers)
    if m.vocab_size is not None and m.vocab_size <= 0:
        raise ConfigError(f"model.vocab_size must be positive or null, got {m.vocab_size}")
    if m.mtp_depth < 0 or m.mtp_loss_weight < 0:
        raise ConfigError("model.mtp_depth and model.mtp_loss_weight must be >= 0")
    if m.mtp_depth >= cfg.data.seq_len:
        raise ConfigError(f"model.mtp_depth={m.mtp_depth} leaves no token to predict in data.seq_len="
                          f"{cfg.data.seq_len}: lower mtp_depth")
    if m.norm_eps <= 0 or m.init_std <= 0 or m.rope_theta <= 0:
        raise ConfigError("model.norm_eps, model.init_std and model.rope_theta must be positive")
    _check_rope_scaling(m.rope_scaling)


def _check_rope_scaling(rs: RopeScalingConfig) -> None:
    """Each type's settings in range, and no setting given that the chosen type would ignore."""
    default = RopeScalingConfig()
    for name in (f.name for f in dataclasses.fields(rs)):
        if name != "type" and name not in _ROPE_SCALING_FIELDS[rs.type] and getattr(rs, name) != getattr(default, name):
            raise ConfigError(f"model.rope_scaling.{name}={getattr(rs, name)} has no effect with "
                              f"model.rope_scaling.type={rs.type}: remove it or set the type that uses it")
    if rs.type == "none":
        return
    if rs.factor < 1 or rs.original_max_position_embeddings <= 0:
        raise ConfigError(f"model.rope_scaling.factor must be >= 1 and original_max_position_embeddings positive, got "
                          f"{rs.factor} and {rs.original_max_position_embeddings}")
    if rs.type == "yarn" and not (0 < rs.beta_slow < rs.beta_fast and rs.mscale >= 0 and rs.mscale_all_dim >= 0):
        raise ConfigError(f"model.rope_scaling needs 0 < beta_slow < beta_fast and mscale, mscale_all_dim >= 0, got "
                          f"beta_slow={rs.beta_slow}, beta_fast={rs.beta_fast}, mscale={rs.mscale}, "
                          f"mscale_all_dim={rs.mscale_all_dim}")
    if rs.type == "llama3" and not 0 < rs.low_freq_factor < rs.high_freq_factor:
        raise ConfigError(f"model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                          f"{rs.low_freq_factor} and {rs.high_freq_factor}")


# Settings only one precision recipe reads (`auto` may resolve to any: it is judged at launch, on the device).
_RECIPE_ONLY = {
    "fp8": ("fp8_start_step", "fp8_backend", "fp8_grad_format", "fp8_power_of_two_scales", "fp8_fprop", "fp8_dgrad",
            "fp8_wgrad", "fp8_keep_weight_transpose", "fp8_wgrad_input_blocks", "fp8_layers", "bf16_layers",
            "bf16_first_last_blocks"),
    "fp16": ("loss_scale_initial", "loss_scale_growth_interval", "loss_scale_growth_factor",
             "loss_scale_backoff_factor", "loss_scale_hysteresis", "loss_scale_min"),
}


def ignored_settings(cfg: Config) -> list[str]:
    """A warning line for each setting given (other than its default) that the rest of the config makes inert:
    a precision setting `precision.recipe` does not read (`precision.fp8_layers=[...]` on a BF16 config trained BF16
    without a word), `parallel.ep_dispatch_fp8` outside FP8, `optimizer.wsd_decay_fraction` without the wsd schedule.
    Warnings, not errors: one command may run several recipes with the same settings (`benchmarks/train_step.py
    --recipes bf16 fp8`)."""
    recipe, default = cfg.precision.recipe, PrecisionConfig()
    lines = []
    if recipe != "auto":  # (`auto` may resolve to any recipe)
        lines += [f"precision.{key}={json.dumps(getattr(cfg.precision, key))} has no effect with "
                  f"precision.recipe={recipe} (only {owner} reads it)"
                  for owner, keys in _RECIPE_ONLY.items() if owner != recipe
                  for key in keys if getattr(cfg.precision, key) != getattr(default, key)]
    if cfg.parallel.ep_dispatch_fp8 and recipe not in ("fp8", "auto"):
        lines.append(f"parallel.ep_dispatch_fp8=true has no effect with precision.recipe={recipe} (tokens travel in "
                     "the recipe's own format)")
    if cfg.optimizer.decay_style != "wsd" and cfg.optimizer.wsd_decay_fraction != OptimizerConfig().wsd_decay_fraction:
        lines.append(f"optimizer.wsd_decay_fraction={cfg.optimizer.wsd_decay_fraction:g} has no effect with "
                     f"optimizer.decay_style={cfg.optimizer.decay_style} (only wsd reads it)")
    return lines


def _check_fp8(cfg: Config) -> None:
    """FP8 tiles are 128 wide: every dimension an FP8 GEMM contracts over or outputs must be a multiple of 128."""
    p = cfg.precision
    if p.bf16_first_last_blocks < 0 or p.fp8_start_step < 0:
        raise ConfigError("precision.bf16_first_last_blocks and precision.fp8_start_step must be >= 0")
    if p.loss_scale_initial <= 0 or p.loss_scale_min <= 0 or p.loss_scale_growth_interval <= 0:
        raise ConfigError("precision.loss_scale_initial, loss_scale_min and loss_scale_growth_interval must be positive")
    if p.loss_scale_min > p.loss_scale_initial:  # a back-off, max(scale x backoff, min), then raised the scale
        raise ConfigError(f"precision.loss_scale_min={p.loss_scale_min:g} exceeds precision.loss_scale_initial="
                          f"{p.loss_scale_initial:g}: an overflow would raise the scale to the minimum instead of "
                          "lowering it; lower loss_scale_min or raise loss_scale_initial")
    if not (0 < p.loss_scale_backoff_factor < 1 < p.loss_scale_growth_factor) or p.loss_scale_hysteresis < 1:
        raise ConfigError("precision: need 0 < loss_scale_backoff_factor < 1 < loss_scale_growth_factor and "
                          "loss_scale_hysteresis >= 1")
    if p.recipe not in ("fp8", "auto"):
        return
    m = cfg.model
    # FFN widths (dense and expert) that are not whole tiles keep those layers in BF16, named at start-up: not
    # checked here.
    sizes = {"model.hidden_size": (m.hidden_size, "model.hidden_size"), **m.attention.fp8_widths(m.hidden_size,
                                                                                                m.num_heads)}
    for what, (size, setting) in sizes.items():
        if size % 128 != 0:
            up = -(-size // 128) * 128
            raise ConfigError(
                f"precision.recipe=fp8 needs GEMM dims that are multiples of the 128-wide FP8 tile, but {what} = "
                f"{size}: change {setting} (e.g. to make it {up}), or use precision.recipe=bf16"
            )


def _check_optimizer(cfg: Config) -> None:
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr must be positive, got {o.lr}")
    if o.bucket_size_mb <= 0:  # (it made one bucket per parameter, unsaid)
        raise ConfigError(f"optimizer.bucket_size_mb must be positive, got {o.bucket_size_mb:g} (MB of FP32 gradients "
                          "a bucket holds; default 64)")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be between 0 and optimizer.lr={o.lr}")
    if o.warmup_steps > cfg.training.steps:
        raise ConfigError(
            f"optimizer.warmup_steps={o.warmup_steps} exceeds training.steps={cfg.training.steps}: lower warmup_steps"
        )
    if not 0 < o.wsd_decay_fraction <= 1:
        raise ConfigError(f"optimizer.wsd_decay_fraction must be in (0, 1], got {o.wsd_decay_fraction}")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        raise ConfigError("optimizer.beta1 and optimizer.beta2 must be in [0, 1)")
    if o.eps <= 0 or o.weight_decay < 0 or o.grad_clip < 0:
        raise ConfigError("optimizer.eps must be positive; optimizer.weight_decay and grad_clip must be >= 0")


def _check_sizes(cfg: Config) -> None:
    """Bounds that keep planning fast and every tensor's size representable."""
    if cfg.model.num_layers > MAX_LAYERS:
        raise ConfigError(f"model.num_layers={cfg.model.num_layers} exceeds {MAX_LAYERS}, the most megafp8 plans for")
    tokens = cfg.training.micro_batch_size * cfg.data.seq_len
    if tokens > MAX_MICRO_BATCH_TOKENS:
        raise ConfigError(f"a micro-batch of training.micro_batch_size x data.seq_len = {tokens} tokens exceeds "
                          f"{MAX_MICRO_BATCH_TOKENS} (2^31, the index range of the kernels): lower either")
    params = approximate_parameters(cfg.model)
    if params > MAX_PARAMETERS:
        raise ConfigError(f"this model would have about {params:.2g} parameters, more than {MAX_PARAMETERS:.0e}: check "
                          "model.hidden_size, ffn_hidden_size, num_layers, vocab_size and the expert sizes")


def _alloc_conf_items(conf: str) -> list[str]:
    """The comma-separated items of an allocator string; commas inside brackets (`roundup_power2_divisions:[256:1,
    512:2]`) stay in their item."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(conf):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(conf[start:i])
            start = i + 1
    items.append(conf[start:])
    return [item.strip() for item in items if item.strip()]


def _check_alloc_conf(conf: str) -> None:
    """The allocator string's form (`key:value` items) and the boolean keys' spelling: torch checks the rest when CUDA
    starts, where a mistake would surface as torch's error on the first CUDA call."""
    if conf == "auto":
        return
    for item in _alloc_conf_items(conf):
        key, sep, value = (part.strip() for part in item.partition(":"))
        if not sep or not key or not value:
            raise ConfigError(
                f"training.cuda_alloc_conf={conf!r}: {item!r} is not `key:value`; write e.g. "
                "\"expandable_segments:True\" (comma-separated `key:value` pairs, as PYTORCH_CUDA_ALLOC_CONF), "
                "\"auto\", or \"\" for torch's defaults"
            )
        if key == "expandable_segments" and value not in ("True", "False"):
            raise ConfigError(f"training.cuda_alloc_conf={conf!r}: expandable_segments takes True or False (torch "
                              f"reads no other spelling), got {value!r}")


SEED_LIMIT = 2**32  # numpy's global seed takes [0, 2^32); the sample order's generator no negative seed


def _check_seeds(cfg: Config) -> None:
    """Both seeds in [0, 2^32), before a model is built (numpy refused them at the first step, in a traceback)."""
    for key, seed in (("training.seed", cfg.training.seed), ("data.seed", cfg.data.seed)):
        if seed is not None and not 0 <= seed < SEED_LIMIT:
            raise ConfigError(f"{key}={seed} is not between 0 and 2^32 - 1 ({SEED_LIMIT - 1}): give a seed in that "
                              "range")


def _check_mixture(data: DataConfig) -> None:
    """`data.weights` go with `data.paths`, one positive finite number each; no directory twice."""
    if data.weights and not data.paths:
        raise ConfigError("data.weights weighs the directories of data.paths, which is empty: give data.paths too "
                          "(or drop data.weights)")
    if data.weights and len(data.weights) != len(data.paths):
        raise ConfigError(f"data.weights has {len(data.weights)} weights for the {len(data.paths)} directories of "
                          "data.paths: give one weight per directory, in their order (or none: shares by size)")
    bad = [w for w in data.weights if not (math.isfinite(w) and w > 0)]
    if bad:
        raise ConfigError(f"data.weights must be positive finite numbers, got {bad[0]:g}")
    seen: dict[Path, str] = {}
    for path in data.paths:  # compared resolved: "d", "d/", "./d" and a link to d are one directory
        resolved = Path(path).resolve()
        if resolved in seen:
            first = seen[resolved]
            also = "" if first == path else f" (as {first} and as {path})"
            raise ConfigError(f"data.paths names {first} more than once{also}: give each directory once, and weigh "
                              "it up with data.weights")
        seen[resolved] = path


def validate_config(cfg: Config) -> None:
    """Checks that need only the config."""
    _check_positive(cfg)
    _check_seeds(cfg)
    _check_mixture(cfg.data)
    _check_sizes(cfg)
    _check_model(cfg)
    _check_optimizer(cfg)
    _check_fp8(cfg)
    if cfg.training.global_batch_size % cfg.training.micro_batch_size != 0:
        raise ConfigError(
            f"training.global_batch_size={cfg.training.global_batch_size} is not a multiple of "
            f"training.micro_batch_size={cfg.training.micro_batch_size}"
        )
    if cfg.training.eval_interval > 0 and cfg.data.valid_split == cfg.data.train_split:
        raise ConfigError("data.valid_split equals data.train_split: validation must use held-out data")
    if cfg.checkpoint.resume not in ("auto", "none") and not cfg.checkpoint.resume:
        raise ConfigError("checkpoint.resume must be 'auto', 'none' or a checkpoint path")
    _check_alloc_conf(cfg.training.cuda_alloc_conf)
    _check_recompute_layers(cfg)
    _check_recompute_under_graphs(cfg)
    _check_profiling(cfg)
    _check_run_name(cfg.run_name)
    _check_metrics_file(cfg.logging.metrics_file)
    if cfg.training.compile_mode != "default" and not cfg.training.compile:
        raise ConfigError(f"training.compile_mode={cfg.training.compile_mode} needs training.compile=true (nothing is "
                          "compiled otherwise): set it, or drop compile_mode")


# The compile modes whose Inductor options put CUDA graphs around compiled code (`megafp8.model.uses_cuda_graphs` asks
# torch itself; the config package does not import it).
_GRAPHED_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def recomputes_in_compiled_graph(cfg: Config) -> bool:
    """Whether recomputed blocks recompute inside their compiled backward (`training.recompute_compiled`, `auto`
    resolved: wherever the blocks compile into one graph); what the build hands `megafp8.model.apply_compile`."""
    t = cfg.training
    if not (t.compile and t.recompute == "full"):
        return False
    if t.recompute_compiled != "auto":
        return t.recompute_compiled == "in_graph"
    return _layers_run_eagerly_in_blocks(cfg) is None


def _layers_run_eagerly_in_blocks(cfg: Config) -> Optional[str]:
    """Why the layout makes layers run eagerly inside the compiled blocks (so a block cannot compile into one
    graph), or None."""
    par = cfg.parallel
    if par.ep > 1:
        return f"parallel.ep={par.ep} runs the experts eagerly inside them"
    if par.pp > 1 and par.pp_schedule in ZERO_BUBBLE:
        return f"parallel.pp_schedule={par.pp_schedule} defers weight gradients, whose layers run eagerly inside them"
    return None


def _check_recompute_under_graphs(cfg: Config) -> None:
    """Recomputed compiled blocks run under CUDA graphs only where they compile into one graph (their recomputation
    is then part of the compiled backward); layers that run eagerly inside a block break its graph."""
    t = cfg.training
    if t.recompute_compiled != "auto" and not (t.compile and t.recompute == "full"):
        missing = " and ".join(f"training.{key}={want}" for key, want, have in (
            ("compile", "true", t.compile), ("recompute", "full", t.recompute == "full")) if not have)
        raise ConfigError(f"training.recompute_compiled={t.recompute_compiled} says how compiled blocks recompute, and "
                          f"this run has none: set {missing}, or drop recompute_compiled")
    if not (t.compile and t.compile_mode in _GRAPHED_COMPILE_MODES and t.recompute == "full"):
        return
    if t.recompute_compiled == "around":
        raise ConfigError(f"training.recompute_compiled=around replays the compiled blocks inside backward, which CUDA "
                          f"graphs (training.compile_mode={t.compile_mode}) cannot: the replay overwrites the other "
                          f"blocks' outputs. Set training.recompute_compiled=auto, or training.compile_mode=default")
    why = _layers_run_eagerly_in_blocks(cfg)
    if why is None:
        return
    raise ConfigError(f"training.recompute=full under CUDA graphs (training.compile_mode={t.compile_mode}) needs "
                      f"blocks that compile into one graph, and {why}: set training.compile_mode=default, or "
                      f"training.recompute=none")


def _check_recompute_layers(cfg: Config) -> None:
    n, t = cfg.training.recompute_layers, cfg.training
    if n is None:
        return
    if t.recompute != "full":
        raise ConfigError(f"training.recompute_layers={n} picks which blocks recompute, and training.recompute="
                          f"{t.recompute} recomputes none: set training.recompute=full, or drop recompute_layers")
    blocks = cfg.model.num_layers + cfg.model.mtp_depth  # transformer layers and MTP blocks
    if not 1 <= n <= blocks:
        raise ConfigError(f"training.recompute_layers={n}: give 1 to {blocks} (the model's {cfg.model.num_layers} "
                          f"layers and {cfg.model.mtp_depth} MTP blocks), or null for every block")


def _check_profiling(cfg: Config) -> None:
    steps, last = cfg.logging.profile_steps, cfg.training.steps
    if steps and (len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= last):
        raise ConfigError(f"logging.profile_steps={steps}: give [first, last] with 1 <= first <= last <= "
                          f"training.steps={last} (e.g. [{min(5, last)}, {min(6, last)}]), or [] to trace nothing")
    if cfg.logging.memory_snapshot_steps < 0:
        raise ConfigError(f"logging.memory_snapshot_steps={cfg.logging.memory_snapshot_steps}: give the number of "
                          "steps to record (0: off)")


def _check_run_name(name: str) -> None:
    """The run's directory is `<logging.output_dir>/<run_name>`: a name with a path in it would put the run (and
    an `overwrite` start's deletion) somewhere else."""
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"run_name={name!r} must be a plain name, not a path (it names the directory "
                          "<logging.output_dir>/<run_name>); to put runs elsewhere, set logging.output_dir")


def _check_metrics_file(name: str) -> None:
    """The metrics file must name a file: an empty name (or `.`) named the run directory itself, which the first
    record then failed to open, in a traceback after the model was built."""
    if Path(name.strip()).name in ("", ".", ".."):
        raise ConfigError(f"logging.metrics_file={name!r} names no file: give a file name (e.g. metrics.jsonl, "
                          "relative to the run directory, or an absolute path)")


def data_parallel_size(world_size: int, tp: int, pp: int = 1, ep: int = 1) -> int:
    """world / (tp x pp), or a ConfigError naming the setting to change."""
    for name, size in (("parallel.tp", tp), ("parallel.pp", pp), ("parallel.ep", ep)):
        if size < 1:
            raise ConfigError(f"{name} must be at least 1, got {size}")
    fewest = tp * pp * ep  # the data-parallel size is a multiple of ep, so the world one of tp x pp x ep
    settings = "parallel.tp" + (" / parallel.pp" if pp > 1 else "") + (" / parallel.ep" if ep > 1 else "")
    if world_size % (tp * pp) != 0:
        raise ConfigError(
            f"{world_size} rank(s) cannot be split into tp={tp} x pp={pp} x data-parallel replicas: launch a "
            f"multiple of {fewest} ranks (at least {fewest} = tp x pp x ep) or change {settings}"
        )
    dp = world_size // (tp * pp)
    if dp % ep != 0:
        raise ConfigError(f"parallel.ep={ep} must divide the data-parallel size {dp} (= {world_size} ranks / "
                          f"(tp {tp} x pp {pp})): launch a multiple of {fewest} ranks (at least {fewest} = tp x pp "
                          f"x ep) or change {settings}")
    return dp


def _tp_problem(m: ModelConfig, tp: int) -> Optional[tuple[str, str]]:
    """What parallel.tp=`tp` cannot split in model `m`, and the setting to change; None where it splits it all:
    whole heads on every rank, and every split width whole 128-wide tiles on every rank."""
    for key, heads in m.attention.split_heads(m.num_heads):
        if heads % tp != 0:
            return f"{key}={heads} is not divisible by parallel.tp={tp}: every tensor-parallel rank needs whole heads", key
    if tp == 1:
        return None
    shards = {**m.attention.tp_widths(m.hidden_size, m.num_heads),
              "model.ffn_hidden_size": (m.ffn_hidden_size, "model.ffn_hidden_size"), **m.moe.tp_widths()}
    for what, (size, key) in shards.items():
        if size % (128 * tp) != 0:
            # The rule holds in BF16 too (DESIGN.md, section 3: every shard boundary on a tile edge), so that a run
            # changes recipe, or resumes another's checkpoint, at the same layout.
            return (f"{what} = {size} splits into {size / tp:g} per rank at parallel.tp={tp}, not a multiple of 128 "
                    f"(tensor-parallel shards hold whole 128-wide FP8 tiles, in every recipe): make it a multiple of "
                    f"{128 * tp}", key)
    return None


def _fitting_tps(m: ModelConfig, near: int) -> str:
    """The parallel.tp values nearest `near` that split model `m` (see `_tp_problem`) and its configured
    vocabulary (`_check_tensor_parallel`), as text for a suggestion."""
    return nearest([t for t in range(1, m.num_heads + 1) if _tp_problem(m, t) is None
                    and (m.vocab_size is None or m.vocab_size % t == 0)], near)


def _check_tensor_parallel(cfg: Config, tp: int) -> None:
    """Heads and widths split evenly, each shard a whole number of 128-element FP8 tiles."""
    m = cfg.model
    problem = _tp_problem(m, tp)
    if problem is not None:
        what, key = problem
        raise ConfigError(f"{what} (change {key}), or set parallel.tp to one that splits this model: "
                          f"{_fitting_tps(m, tp)}")
    if tp == 1:
        return
    if m.vocab_size is not None and m.vocab_size % tp != 0:  # BF16 embedding and LM head: no FP8 tiles to keep
        raise ConfigError(f"model.vocab_size={m.vocab_size} does not split evenly over parallel.tp={tp}: make it a "
                          f"multiple of {tp}, or null to pad the tokenizer's vocabulary automatically")
    local = cfg.data.seq_len // cfg.parallel.cp  # each context-parallel rank's share of a sequence
    if cfg.parallel.sequence_parallel and (cfg.training.micro_batch_size * local) % tp != 0:
        shares = f" / parallel.cp {cfg.parallel.cp}" if cfg.parallel.cp > 1 else ""
        raise ConfigError(
            f"parallel.sequence_parallel splits each micro-batch's {cfg.training.micro_batch_size} x "
            f"{cfg.data.seq_len}{shares} tokens over tp={tp} ranks, which does not divide: change data.seq_len"
        )


def validate_layout(cfg: Config, world_size: int) -> int:
    """The parallel layout's checks (sizes multiply out, shards on tile edges); returns the data-parallel size."""
    tp, ep, pp = cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.pp
    dp = data_parallel_size(world_size, tp, pp, ep)
    _check_recompute_under_graphs(cfg)  # layout-dependent too: the layout search tries other EP sizes and schedules
    experts = cfg.model.moe.num_experts
    if ep > 1 and experts == 0:
        raise ConfigError(f"parallel.ep={ep} needs a mixture-of-experts model: set model.moe.num_experts or "
                          "parallel.ep=1")
    if experts % ep != 0:
        raise ConfigError(f"model.moe.num_experts={experts} is not divisible by parallel.ep={ep}: every "
                          f"expert-parallel rank needs the same number of experts; set parallel.ep to one of "
                          f"{divisors_near(experts, ep)}")
    if cfg.parallel.dp is not None and cfg.parallel.dp != dp:
        raise ConfigError(
            f"parallel.dp={cfg.parallel.dp} but {world_size} rank(s) at parallel.tp={tp} x pp={pp} give {dp} "
            f"data-parallel replicas: set parallel.dp to {dp} or null, or launch {cfg.parallel.dp * tp * pp} ranks"
        )
    _check_context_parallel(cfg, dp)
    _check_tensor_parallel(cfg, tp)
    _check_pipeline_layout(cfg)
    return dp


def _check_context_parallel(cfg: Config, dp: int) -> None:
    """The context-parallel group within the data-parallel ranks, and sequences that split into its 2 x cp chunks."""
    cp, seq_len = cfg.parallel.cp, cfg.data.seq_len
    if cp < 1:
        raise ConfigError(f"parallel.cp must be at least 1, got {cp}")
    if cp == 1:
        return
    if dp % cp != 0:
        raise ConfigError(f"parallel.cp={cp} must divide the data-parallel ranks ({dp}): context-parallel groups are "
                          f"made of data-parallel ranks; set parallel.cp to one of {divisors_near(dp, cp)}, or launch "
                          f"a multiple of {cp * cfg.parallel.tp * cfg.parallel.pp} ranks")
    if seq_len % (2 * cp) != 0:
        raise ConfigError(f"data.seq_len={seq_len} does not split into 2 x parallel.cp = {2 * cp} equal chunks: make "
                          f"it a multiple of {2 * cp}, or change parallel.cp")
    if cfg.model.attention_backend not in ("auto", "torch"):
        raise ConfigError(f"model.attention_backend={cfg.model.attention_backend} with parallel.cp={cp}: context "
                          "parallelism runs its own attention kernels (FlashAttention-2, or the memory-efficient "
                          "kernel where key and value widths differ): set model.attention_backend=auto")


def _check_pipeline_layout(cfg: Config) -> None:
    """The stages cover every layer once; MTP (on the last stage) needs the embedding on the same rank."""
    par = cfg.parallel
    if par.pp_virtual_stages < 1:
        raise ConfigError(f"parallel.pp_virtual_stages must be at least 1, got {par.pp_virtual_stages}")
    if par.pp == 1:
        if par.pp_layout:
            raise ConfigError("parallel.pp_layout is set but parallel.pp=1: remove pp_layout or raise parallel.pp")
        return
    layer_counts(cfg.model.num_layers, par.pp, par.pp_schedule, par.pp_virtual_stages, par.pp_layout)
    if cfg.model.mtp_depth > 0 and par.pp_schedule not in V_SHAPED:
        raise ConfigError(
            f"model.mtp_depth={cfg.model.mtp_depth} with parallel.pp={par.pp}: the MTP modules on the last stage share "
            f"the embedding of the first, which only V-shaped schedules place on the same rank; set "
            f"parallel.pp_schedule to zbv or dualpipev (not {par.pp_schedule})")


def validate_for_world(cfg: Config, world_size: int) -> int:
    """Checks that need the number of ranks; returns the gradient-accumulation micro-batch count."""
    dp = validate_layout(cfg, world_size)
    replicas = dp // cfg.parallel.cp  # a context-parallel group reads one replica's sequences
    ranks = f"{replicas} data-parallel replicas" if cfg.parallel.cp > 1 else f"{dp} data-parallel ranks"
    per_step = cfg.training.micro_batch_size * replicas
    if cfg.training.global_batch_size % per_step != 0:
        lower = max(per_step, cfg.training.global_batch_size // per_step * per_step)
        raise ConfigError(
            f"training.global_batch_size={cfg.training.global_batch_size} must be a multiple of "
            f"micro_batch_size x {ranks.split(' ', 1)[1]} = {cfg.training.micro_batch_size} x {replicas} = "
            f"{per_step}: set global_batch_size to e.g. {lower} or {lower + per_step}, or change "
            "training.micro_batch_size"
        )
    n_micro = cfg.training.global_batch_size // per_step
    problem = micro_batch_problem(cfg.parallel.pp_schedule, cfg.parallel.pp, n_micro) if cfg.parallel.pp > 1 else None
    if problem:
        raise ConfigError(
            f"{problem}, but training.global_batch_size={cfg.training.global_batch_size} / (micro_batch_size "
            f"{cfg.training.micro_batch_size} x {ranks}) = {n_micro}: raise "
            "training.global_batch_size or lower training.micro_batch_size")
    return n_micro
