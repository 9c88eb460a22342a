#!/usr/bin/env python
"""Whole training steps, one table: tokens/s, TFLOP/s and MFU per device, peak memory, for each recipe.

    PYTHONPATH=. python benchmarks/train_step.py --model 1b --recipes bf16 fp8
    PYTHONPATH=. python benchmarks/train_step.py --model 8b-layers training.compile=true \
        training.compile_mode=reduce-overhead
    PYTHONPATH=. torchrun --nproc_per_node=2 benchmarks/train_step.py --model 1b parallel.tp=2
    PYTHONPATH=. torchrun --nproc_per_node=8 benchmarks/train_step.py parallel.tp=2 parallel.pp=2 parallel.ep=2 \
        parallel.pp_schedule=dualpipev parallel.sequence_parallel=true --config 16b_moe_fp8 --model config \
        --global-batch 16
    PYTHONPATH=. python benchmarks/train_step.py --model tiny --steps 4 training.device=cpu   # a smoke test

Models (issue 10's shapes):
- `1b`: hidden 2048, 16 layers, FFN 5632, 16 heads, vocab 32768, seq 2048, micro-batch 8 (956M parameters);
- `moe`: 8 layers of the same attention, a DeepSeek-style MoE FFN in layers 1-7 (64 routed experts of FFN 1024,
  top-8 in 8 groups choosing 4, one shared expert, sigmoid routing): 3.2B parameters, 0.7B activated per token;
- `8b-layers`: 8 layers of Llama-3-8B's width (hidden 4096, FFN 14336, 32 heads, no GQA as in
  `reference_model.py`), vocab 32768, seq 4096, micro-batch 4 (16k tokens);
- `mla`: the `1b` shape with DeepSeek's multi-head latent attention (16 heads, no query compression, key/value
  rank 512, query/key width 128 + 64 rotary, value width 128);
- `tiny`: the CPU smoke-test shape of `configs/tiny_dense.yaml`;
- `config`: the model, sequence length and micro-batch of `--config` as configured (e.g. `--config 16b_moe_fp8`;
  the others start from `tiny_dense`).
Every recipe runs the same steps on the same data (the built-in Python standard library corpus, tokenized to
`--data` when missing), one after another in this process. Timing is the median of the loop's own per-step
records (windows of `--log-interval` steps, each timed until the device finishes it) after `--warmup` steps (all of
them: `--steps` must exceed `--warmup`, and a window may be shorter where fewer steps are left); extra
`section.key=value` overrides apply to every run (a layout, `training.recompute=full`, ...). Peak memory is the
allocator's high-water mark over the timed steps (the steady state) and over the whole run (compilation,
autotuning and CUDA graph recording in the warm-up included), the largest over the ranks; "planned GiB" is the
memory planner's prediction for the busiest rank at the same configuration (`tools/plan.py --dry-run`; under pipeline
parallelism the pipeline rank it plans as the busiest), and "steady / planned" their ratio (issue 23 holds the
planner to within 10%). With several ranks the "per rank" column lists each rank's steady peak against the planner's
prediction for that rank's pipeline stage. Under CUDA graphs the steady high-water mark leaves out the graphs' own
memory pools, which hold their activations (allocated while recording, never again): "held GiB, steady" is what
the process holds in steady state, the allocator's reserved memory from the last warm-up step on (its idle cache
emptied before that step), pools included; it needs `--warmup` of 2 or more, else it counts compilation too, and
it leaves out NCCL's buffers and the CUDA context. Compare recipes by it under CUDA graphs. Graph breaks counts where torch.compile
split a compiled block (there should be none: a split block runs slower, see `docs/performance.md`). Under pipeline
parallelism the column before the last gives the schedule's theoretical bubble (the one the training loop's start-up line logs:
simulated from the schedule's actions with forward = input-gradient = weight-gradient time);
`benchmarks/scaling_table.py` sets it beside the measured one. For MoE models the column before it gives the
routing's balance over the timed windows (medians): the spread of routed rows per expert (coefficient of variation, the
layers' mean) and the busiest expert's rows over the mean (the worst layer), which set how evenly the experts'
grouped GEMMs share out their work. The last column counts the timed steps skipped for non-finite gradients (an FP16
loss scaler backing off, a diverging run): a skipped step is not a training step (FP16's leave out the optimizer), so a
row whose count is not 0 does not time training (a warning says so too). Rank 0 prints the table as Markdown.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from megafp8.config import load_config  # noqa: E402
from megafp8.data.corpus import stdlib_files  # noqa: E402
from megafp8.data.preprocess import preprocess  # noqa: E402
from megafp8.train.command_line import srun_launch_status  # noqa: E402
from megafp8.train.runtime import env_rank, init_distributed, seed_everything, shutdown  # noqa: E402
from megafp8.train.plan import make_plan, with_vocab  # noqa: E402
from megafp8.train.fp8_health import is_sampled  # noqa: E402
from megafp8.train.trainer import Trainer  # noqa: E402

import kernel_breakdown  # noqa: E402  (benchmarks/, beside this file)
from torch._dynamo.utils import counters  # noqa: E402

MODELS = {
    "1b": ["model.size=1b", "model.vocab_size=32768", "data.seq_len=2048", "training.micro_batch_size=8"],
    "moe": ["model.size=1b", "model.vocab_size=32768", "data.seq_len=2048", "training.micro_batch_size=8",
            "model.moe.num_experts=64", "model.moe.top_k=8", "model.moe.ffn_hidden_size=1024",
            "model.moe.num_shared_experts=1", "model.moe.first_dense_layers=1", "model.moe.n_group=8",
            "model.moe.topk_group=4", "model.moe.score_func=sigmoid", "model.num_layers=8"],
    "8b-layers": ["model.size=null", "model.hidden_size=4096", "model.ffn_hidden_size=14336", "model.num_heads=32",
                  "model.attention.num_kv_heads=32", "model.num_layers=8", "model.vocab_size=32768",
                  "data.seq_len=4096", "training.micro_batch_size=4"],
    "mla": ["model.size=null", "model.hidden_size=2048", "model.num_layers=16", "model.num_heads=16",
            "model.ffn_hidden_size=5632", "model.attention.kind=mla", "model.attention.kv_lora_rank=512",
            "model.attention.qk_nope_head_dim=128", "model.attention.qk_rope_head_dim=64",
            "model.attention.v_head_dim=128", "model.vocab_size=32768", "data.seq_len=2048",
            "training.micro_batch_size=8"],
    "1b-32k": ["model.size=1b", "model.vocab_size=32768", "data.seq_len=32768", "training.micro_batch_size=1"],
    "config": [],
    "tiny": ["model.vocab_size=384", "data.seq_len=64", "training.micro_batch_size=2", "model.hidden_size=128",
             "model.num_layers=2", "model.num_heads=2", "model.attention.num_kv_heads=1", "model.ffn_hidden_size=256",
             "model.size=null"],
}


def corpus(path: Path) -> Path:
    if not (path / "meta.json").is_file() and env_rank()[0] == 0:
        preprocess([str(p) for p in stdlib_files()], path, valid_fraction=0.01, seed=0)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return path


def label(model: str, args: argparse.Namespace) -> str:
    """The model's name in the table and run names: the config's for `--model config`."""
    return args.config if model == "config" else model


def global_batch(model: str, args: argparse.Namespace) -> str:
    """The override setting the step's global batch: `--global-batch`, else one micro-batch per rank."""
    base = load_config(args.config, MODELS[model] + args.overrides)
    return f"training.global_batch_size={args.global_batch or base.training.micro_batch_size * env_rank()[2]}"


def run_config(model: str, recipe: str, args: argparse.Namespace, data: Path):
    overrides = MODELS[model] + [
        f"precision.recipe={recipe}", f"data.path={data}", f"training.steps={args.steps}",
        global_batch(model, args), "training.eval_interval=0",
        f"logging.log_interval={args.log_interval}",
        f"logging.output_dir={args.out}", f"run_name={label(model, args)}_{recipe}", "checkpoint.resume=none",
        # The parity run's learning rate: the tiny config's 2e-3 makes a 1B model's first steps erratic.
        "optimizer.lr=3e-4", "optimizer.min_lr=3e-5", f"optimizer.warmup_steps={min(10, args.steps)}"] + args.overrides
    return load_config(args.config, overrides)


def release_memory(device: torch.device) -> None:
    """Free the last run's model, optimizer and caches, so the next recipe's peak memory is its own (the
    trainer's hooks form reference cycles: only the cycle collector frees them)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated(device)
        if left > 2**30:
            print(f"warning: {left / 2**30:.1f} GiB still allocated after a run: the next run's peak includes it",
                  file=sys.stderr)
        torch.cuda.reset_peak_memory_stats(device)


def sampled_steps(first: int, stop: int, interval: int) -> list[int]:
    """The 0-based steps in [first, stop) that sample FP8 health every `interval` steps (none if 0)."""
    return [step for step in range(first, stop) if is_sampled(step, interval)]


def new_trainer(cfg) -> tuple[Trainer, torch.device]:
    """This process's trainer for `cfg`: the process group set up and the run seeded first."""
    dims, device = init_distributed(cfg)
    seed_everything(cfg.training.seed)
    return Trainer(cfg, dims, device), device


def run(model: str, recipe: str, args: argparse.Namespace, data: Path) -> dict:
    """One run; returns its summary row (rank 0's figures)."""
    cfg = run_config(model, recipe, args, data)
    warmup = args.warmup  # every one asked for, however few steps that leaves to time (main: at least one)
    health = sampled_steps(max(warmup - 1, 0), args.steps, cfg.logging.fp8_health_interval)
    if cfg.precision.recipe == "fp8" and health:  # (the last warm-up step counts: it sets the held memory)
        print(f"warning: step(s) {', '.join(str(s + 1) for s in health)} of the {recipe} run sample FP8 health "
              f"(logging.fp8_health_interval={cfg.logging.fp8_health_interval}), eagerly: the timing's median leaves "
              "them out, the steady and held memory columns do not; a --warmup past them keeps them out",
              file=sys.stderr)
    dims, device = init_distributed(cfg)
    seed_everything(cfg.training.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(cfg, dims, device)
    warmup_peak = 0.0
    for step in range(warmup):  # compiling, autotuning, CUDA graph recording
        if step == warmup - 1 and device.type == "cuda":
            # What the steady state holds: the allocator gives back its idle cache (the compilation's leftovers),
            # so the last warm-up step and the timed ones reserve only what a step needs, CUDA graphs' pools included.
            warmup_peak = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        trainer.train_step()
    if device.type == "cuda":
        warmup_peak = max(warmup_peak, torch.cuda.max_memory_allocated(device) / 2**30)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the first timed window starts with the warm-up finished, not queued
        torch.cuda.reset_peak_memory_stats(device)  # from here on: the steady state's high-water mark
    records = [r for r in trainer.fit() if r["kind"] == "train"]
    held_here = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0
    bubble = trainer.pipeline.bubble if trainer.pipeline is not None else None
    del trainer
    release_memory(device)
    timing = timing_columns(records, cfg.training.global_batch_size * cfg.data.seq_len)
    plan = make_plan(with_vocab(cfg), dims.world_size)  # the vocabulary: the data's where not configured
    # This rank's prediction: its pipeline stage's (every TP, EP and DP rank of a stage is planned alike).
    planned_here = plan.pipeline[dims.pp_rank][4] if plan.pipeline else plan.total_bytes
    steady_here = max((r["peak_memory_gib"] or 0.0) for r in records)
    skipped = sum(r["skipped_steps"] for r in records)
    if skipped:  # (an FP16 step its loss scaler skips leaves out the optimizer: a shorter step than training's)
        print(f"warning: {skipped} of the {recipe} run's timed steps skipped (non-finite gradients): its step time, "
              "tokens/s and MFU are not those of training steps; the table's last column counts them", file=sys.stderr)
    per_rank = over_ranks([steady_here, warmup_peak, planned_here / 2**30, held_here], device)
    steady_peak, warmup_peak, held = (max(values[i] for values in per_rank) for i in (0, 1, 3))  # the busiest rank's
    return {"model": label(model, args), "recipe": recipe, "ranks": dims.world_size, **timing,
            "peak_gib": steady_peak, "warmup_peak_gib": max(warmup_peak, steady_peak), "loss": records[-1]["loss"],
            "graph_breaks": sum(counters["graph_break"].values()), "planned_gib": plan.total_bytes / 2**30,
            "per_rank": [(steady, planned) for steady, _, planned, _ in per_rank], "bubble": bubble, "held_gib": held,
            "skipped": skipped,
            "expert_load": ((statistics.median(r["moe_load_cv"] for r in records),
                             statistics.median(r["moe_load_max_over_mean"] for r in records),
                             statistics.median(r["moe_idle_experts"] for r in records))
                            if "moe_load_cv" in records[0] else None)}


def timing_columns(records: list[dict], tokens_per_step: int) -> dict:
    """The table's step time, tokens/s, TFLOP/s and MFU, all from one step time: the median of the records' (each
    covers the `log_interval` steps before it, timed up to the device finishing them). TFLOP/s and MFU are each
    record's work (its figure times its step time, the same every step) over that median, not medians of their own:
    with an even count of windows a median of rates is not the rate of the median time, and the columns disagreed."""
    step_s = statistics.median(r["step_time_s"] for r in records)

    def rate(key: str) -> float:
        return statistics.median(r[key] * r["step_time_s"] for r in records) / step_s

    return {"step_s": step_s, "tokens_per_s": tokens_per_step / step_s, "tflops": rate("tflops_per_device"),
            "mfu": rate("mfu") if records[0]["mfu"] is not None else None}


def over_ranks(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values`, by rank (pipeline stages differ in memory)."""
    if not torch.distributed.is_initialized():
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def profile(model: str, recipe: str, args: argparse.Namespace, data: Path) -> str:
    """`args.warmup` untimed steps, then `args.profile` steps under `torch.profiler`; returns the Markdown
    breakdown of GPU kernel time (rank 0's GPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cfg = run_config(model, recipe, args, data)
    trainer, device = new_trainer(cfg)
    ranks = trainer.dims.world_size
    for _ in range(args.warmup):
        trainer.train_step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        started = time.perf_counter()
        for _ in range(args.profile):
            trainer.train_step()
        sync(device)
        wall_ms = (time.perf_counter() - started) * 1e3 / args.profile
    kernels = kernel_breakdown.cuda_kernels(prof)
    host = kernel_breakdown.host_ops(prof, args.profile, args.profile_top)
    ops = kernel_breakdown.device_ops(prof, args.profile, args.profile_top)
    trainer.metrics.close()
    del trainer, prof
    release_memory(device)
    title = f"{label(model, args)}, {recipe}{' (compiled)' if cfg.training.compile else ''}, {ranks} rank(s)"
    return kernel_breakdown.markdown(title, kernel_breakdown.breakdown(kernels, args.profile), wall_ms,
                                     kernel_breakdown.top_kernels(kernels, args.profile, args.profile_top), host, ops)


def table(rows: list[dict]) -> str:
    best_bf16 = max((r["tokens_per_s"] for r in rows if r["recipe"] == "bf16"), default=None)
    lines = ["| model | recipe | ranks | step (s) | tokens/s | vs BF16 | TFLOP/s per device | MFU | peak GiB, steady | "
             "peak GiB, with warm-up | final loss | graph breaks | planned GiB | steady / planned | "
             "per rank: steady / planned GiB | held GiB, steady | tokens/s per GPU | expert load: cv, busiest / mean, idle | "
             "bubble, theoretical | skipped steps, timed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / best_bf16:.2f}x" if best_bf16 else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        measured = f"{r['peak_gib'] / r['planned_gib']:.2f}" if r["peak_gib"] else "n/a"
        ranks = ", ".join(f"{steady:.2f} / {planned:.2f}" for steady, planned in r["per_rank"])
        bubble = f"{100 * r['bubble']:.1f}%" if r["bubble"] is not None else "-"
        load = (f"{r['expert_load'][0]:.2f}, {r['expert_load'][1]:.2f}x, {100 * r['expert_load'][2]:.0f}%"
                if r.get("expert_load") else "-")
        lines.append(f"| {r['model']} | {r['recipe']} | {r['ranks']} | {r['step_s']:.4f} | {r['tokens_per_s']:,.0f} | "
                     f"{ratio} | {r['tflops']:.1f} | {mfu} | {r['peak_gib']:.2f} | {r['warmup_peak_gib']:.2f} | "
                     f"{r['loss']:.4f} | {r['graph_breaks']} | {r['planned_gib']:.2f} | {measured} | {ranks} | "
                     f"{r['held_gib']:.2f} | {r['tokens_per_s'] / r['ranks']:,.0f} | {load} | {bubble} | "
                     f"{r['skipped']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="1b")
    parser.add_argument("--config", default="tiny_dense", help="the config the runs start from (see --model config)")
    parser.add_argument("--recipes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "fp16", "fp32"],
                        help="(put `section.key=value` overrides before this option)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--log-interval", type=int, default=5,
                        help="steps per timing window (the host waits for the device once per window)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="samples per step over all ranks (default: one micro-batch per rank)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="instead of timing, profile N steps per recipe after the warm-up")
    parser.add_argument("--profile-top", type=int, default=15, metavar="N",
                        help="rows in the profile's top-kernel, host-operator and device-operator tables")
    parser.add_argument("--data", type=Path, default=Path("/tmp/megafp8-bench-data"))
    parser.add_argument("--out", type=Path, default=None,
                        help="run directories (default: a new temporary directory, so runs never share one)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    refused = srun_launch_status()  # `srun -n N python benchmarks/train_step.py`: N lone rank-0 runs, as pretrain.py
    if refused is not None:
        return refused
    if not args.profile and args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves none of --steps {args.steps} to time: give more --steps")
    args.out = args.out or Path(tempfile.mkdtemp(prefix="megafp8-bench-runs-"))
    rows, profiles, clean = [], [], False
    try:
        data = None
        for recipe in args.recipes:
            if data is None:
                # The layout is checked against the global batch the runs take (DualPipeV needs enough micro-batches).
                init_distributed(load_config(args.config, MODELS[args.model] + [global_batch(args.model, args)]
                                             + args.overrides))
                data = corpus(args.data)
            if args.profile:
                profiles.append(profile(args.model, recipe, args, data))
            else:
                rows.append(run(args.model, recipe, args, data))
        clean = True
    finally:
        shutdown(clean)
    if env_rank()[0] == 0:
        print("\n\n".join(profiles) if args.profile else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
