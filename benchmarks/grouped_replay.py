#!/usr/bin/env python
"""The MoE step's grouped GEMMs inside the step against the same calls alone: is a slow grouped GEMM slow because of
its inputs (the routing's uneven experts) or because of where it runs (the step around it)?

    PYTHONPATH=. python benchmarks/grouped_replay.py [--model moe] [--steps 6] [--iters 20] [overrides ...]

Builds `train_step.py`'s model (`--model`, FP8, `training.compile=true` unless overridden) and runs `--steps`
steps, the second to last profiled. Every call of the kernels module's `grouped_gemm` (the experts' fprop and dgrad) and
`grouped_wgrad` (their weight gradients, into `main_grad`) runs inside a `torch.profiler.record_function` range
named after its role and shape, so the profile gives each call's device time in one profiled step. The step after it
keeps its calls (their operands copied) and each is replayed alone afterwards: `--iters` calls captured in one CUDA
graph, the median of five replays (`grouped_gemm.graphed_ms`), into a copy of its `main_grad`. Printed per call:
the call (its kind and shape, numbered in call order: one per MoE layer and pass), the replayed step's 128-row tiles
per expert (busiest over the mean; experts without rows), device ms in the step and alone, and TFLOP/s of each
(2 x routed rows padded to 128 x N x K)."""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_step  # noqa: E402


class Recorder:
    """Wraps a kernels module's grouped GEMMs (`megafp8.precision.kernels.gemm`, whose functions the backends look
    up at each call): names each call's profiler range and, while `keeping`, copies its operands for a replay.
    `kept`: (range name, kind, (function, args, kwargs)) per kept call (a wgrad's tile counts are its args[5])."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        self.keeping = False
        self.kept: list[tuple[str, str, tuple]] = []
        self.wgrad, self.fprop = kernels.grouped_wgrad, kernels.grouped_gemm
        self._calls = defaultdict(int)

    def install(self) -> None:
        self.kernels.grouped_wgrad, self.kernels.grouped_gemm = self.grouped_wgrad, self.grouped_gemm

    def uninstall(self) -> None:
        self.kernels.grouped_wgrad, self.kernels.grouped_gemm = self.wgrad, self.fprop

    def name(self, kind: str, shape: tuple) -> str:
        key = (kind, shape)
        self._calls[key] += 1
        return f"replay:{kind} {'x'.join(map(str, shape))} #{self._calls[key]}"

    def start_step(self) -> None:
        self._calls.clear()

    def grouped_wgrad(self, a, a_scale, b, b_scale, tile_start, tile_count, out_dtype, **kwargs):
        name = self.name("wgrad", (tile_start.shape[0], a.shape[0], b.shape[0]))
        with torch.profiler.record_function(name):
            if self.keeping:
                copies = [t.clone() for t in (a, a_scale, b, b_scale, tile_start, tile_count)]
                into = kwargs.get("accumulate")
                kept_kwargs = dict(kwargs, accumulate=into.clone() if into is not None else None)
                self.kept.append((name, "wgrad", (self.wgrad, (*copies, out_dtype), kept_kwargs)))
            return self.wgrad(a, a_scale, b, b_scale, tile_start, tile_count, out_dtype, **kwargs)

    def grouped_gemm(self, a, a_scale, b, b_scale, tile_expert, out_dtype, **kwargs):
        name = self.name("fprop/dgrad", (b.shape[0], a.shape[0], a.shape[1], b.shape[1]))
        with torch.profiler.record_function(name):
            if self.keeping:
                copies = [t.clone() for t in (a, a_scale, b, b_scale, tile_expert)]
                self.kept.append((name, "fprop/dgrad", (self.fprop, (*copies, out_dtype), dict(kwargs))))
            return self.fprop(a, a_scale, b, b_scale, tile_expert, out_dtype, **kwargs)


def device_ms(prof, steps: int) -> dict[str, float]:
    """Device time per profiled step of each `replay:` range."""
    return {e.key: e.device_time_total / 1e3 / steps for e in prof.key_averages() if e.key.startswith("replay:")}


def flops(kind: str, args: tuple) -> float:
    """2 x padded routed rows x N x K of a kept call."""
    a, b = args[0], args[2]
    if kind == "wgrad":  # a (N, Mp), b (K, Mp): each expert's 128-row K steps
        return 2.0 * float(args[5].sum()) * 128 * a.shape[0] * b.shape[0]
    # fprop/dgrad: a (Mp, K), b (E, N, K); the tiles of real experts (padding tiles are -1)
    return 2.0 * float((args[4] >= 0).sum()) * 128 * a.shape[1] * b.shape[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="moe", choices=sorted(train_step.MODELS))
    parser.add_argument("--config", default="tiny_dense")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--data", type=Path, default=Path("/tmp/megafp8-bench-data"))
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    args.overrides = ["training.compile=true"] + args.overrides
    args.log_interval, args.out, args.global_batch = 1, Path(tempfile.mkdtemp(prefix="megafp8-replay-")), None
    trainer, device = train_step.new_trainer(train_step.run_config(args.model, "fp8", args,
                                                                   train_step.corpus(args.data)))
    from grouped_gemm import graphed_ms
    from megafp8.precision.kernels import gemm  # (Triton: imported here, so the CPU tests can import this file)
    recorder = Recorder(gemm)
    recorder.install()  # (the backends look the kernels up at each call)
    for _ in range(args.steps - 2):
        recorder.start_step()
        trainer.train_step()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        recorder.start_step()
        trainer.train_step()
        torch.cuda.synchronize(device)
    in_step = device_ms(prof, 1)
    # The next step's calls, copied for the replay (outside the profile: the copies would sit between the kernels).
    # Its routing comes one step after the profiled one's; the table's spread of rows is this step's.
    recorder.start_step()
    recorder.keeping = True
    trainer.train_step()
    recorder.keeping = False
    recorder.uninstall()
    del trainer, prof
    train_step.release_memory(device)
    print("| call | 128-row tiles per expert: busiest / mean, experts without rows | in the step: ms (TFLOP/s) | "
          "alone: ms (TFLOP/s) | alone / in the step |")
    print("|---|---|---|---|---|")
    ratios = defaultdict(list)
    for name, kind, (function, call_args, kwargs) in recorder.kept:
        alone = graphed_ms(lambda: function(*call_args, **kwargs), args.iters)
        here = in_step.get(name)
        work = flops(kind, call_args)
        spread = "-"
        if kind == "wgrad":
            counts = call_args[5].double()  # each expert's 128-row tiles
            spread = f"{float(counts.max() / counts.mean()):.2f}, {int((counts == 0).sum())}"
        here_cell = f"{here:.3f} ({work / here / 1e9:,.0f})" if here else "n/a (not in the profiled step)"
        ratio = f"{alone / here:.2f}" if here else "-"
        print(f"| {name[len('replay:'):]} | {spread} | {here_cell} | {alone:.3f} ({work / alone / 1e9:,.0f}) | "
              f"{ratio} |", flush=True)
        if here:
            ratios[name.split(" #")[0]].append(here / alone)
    for name, values in ratios.items():
        print(f"{name[len('replay:'):]}: in the step / alone, median {statistics.median(values):.2f} over "
              f"{len(values)} calls")


if __name__ == "__main__":
    main()
