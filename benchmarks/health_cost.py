#!/usr/bin/env python
"""What FP8 health sampling (`logging.fp8_health_interval`) costs: a sampled step against a plain one, and the
statistics alone, pure torch against the backend's one-pass kernel.

    PYTHONPATH=. python benchmarks/health_cost.py [--model moe] [--interval 10] [--steps 40] [overrides ...]
    PYTHONPATH=. python benchmarks/health_cost.py --stats [--shapes 16384x4096 131072x2048 ...]

The first form runs `train_step.py`'s model in FP8 (`training.compile=true`; add
`training.compile_mode=reduce-overhead` for CUDA graphs), logging every step and sampling health every `--interval`
steps, and prints the median plain and sampled step, the extra time of a sample and what it adds at the default
interval of 100. With `--stats` it times `fp8_stats` of BF16 tensors of the given shapes (1x128 tiles) both ways
(CUDA events, median of 5 after a warm-up call) and prints the kernel's read rate.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_INTERVAL = 100  # `logging.fp8_health_interval`'s default


def sampled(step: int, interval: int) -> bool:
    """Whether the training record of (1-based) `step` is a health-sampled step (`fp8_health.is_sampled`)."""
    from megafp8.train.fp8_health import is_sampled
    return is_sampled(step - 1, interval)


def step_table(records: list[dict], interval: int) -> str:
    """Markdown: median plain and sampled step (ms), the extra time per sample, its share at `DEFAULT_INTERVAL`."""
    plain = [r["step_time_s"] * 1e3 for r in records if not sampled(r["step"], interval)]
    hits = [r["step_time_s"] * 1e3 for r in records if sampled(r["step"], interval)]
    if not plain or not hits:
        raise SystemExit(f"no {'plain' if not plain else 'sampled'} step was timed: raise --steps or lower "
                         f"--interval")
    base, sample = statistics.median(plain), statistics.median(hits)
    share = (sample - base) / (DEFAULT_INTERVAL * base)
    return ("| plain step (ms) | sampled step (ms) | extra per sample (ms) | added at interval 100 |\n"
            "|---|---|---|---|\n"
            f"| {base:.1f} ({len(plain)} steps) | {sample:.1f} ({len(hits)} steps) | {sample - base:.1f} | "
            f"{100 * share:.2f}% |")


def time_ms(run, iters: int = 5) -> float:
    run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stats_table(shapes: list[tuple[int, int]]) -> str:
    from megafp8.precision import E4M3, select_backend
    from megafp8.precision.health import fp8_stats

    backend = select_backend("auto", torch.device("cuda"))
    lines = [f"fp8_stats of BF16 tensors, 1x128 tiles ({backend.name} backend's health_sums against chunk_sums)",
             "", "| tensor | pure torch (ms) | one pass (ms) | speed-up | one pass: GB/s read |", "|---|---|---|---|---|"]
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = time_ms(lambda: fp8_stats(x, E4M3))
        fast = time_ms(lambda: fp8_stats(x, E4M3, sums=backend.health_sums))
        lines.append(f"| {m} x {k} | {ref:.2f} | {fast:.3f} | {ref / fast:.0f}x | {x.numel() * 2 / fast / 1e6:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    import train_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="moe", choices=sorted(train_step.MODELS))
    parser.add_argument("--config", default="tiny_dense")
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    parser.add_argument("--stats", action="store_true", help="time the statistics alone instead")
    parser.add_argument("--shapes", nargs="+", default=["16384x4096", "16384x14336", "131072x2048", "131072x4096"],
                        metavar="MxK")
    parser.add_argument("--data", type=Path, default=Path("/tmp/megafp8-bench-data"))
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    if args.stats:
        print(stats_table([tuple(int(v) for v in s.split("x")) for s in args.shapes]))
        return
    args.overrides = ["training.compile=true", f"logging.fp8_health_interval={args.interval}"] + args.overrides
    args.log_interval, args.out, args.global_batch = 1, Path(tempfile.mkdtemp(prefix="megafp8-health-cost-")), None
    trainer, _ = train_step.new_trainer(train_step.run_config(args.model, "fp8", args, train_step.corpus(args.data)))
    for _ in range(args.warmup):
        trainer.train_step()
    records = [r for r in trainer.fit() if r["kind"] == "train"]
    print(f"{args.model}, FP8, health sampled every {args.interval} steps ({' '.join(args.overrides)})\n")
    print(step_table(records, args.interval))


if __name__ == "__main__":
    main()
