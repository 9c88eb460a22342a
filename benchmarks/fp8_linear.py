#!/usr/bin/env python
"""Forward+backward speed of megafp8's FP8 linear against BF16 `nn.Linear`, and activation memory saved.

For each (M x K x N) shape: one training iteration = forward, then backward for dx and dw
(3 GEMMs, 6*M*K*N FLOPs). FP8 timings include every quantization: activations (both layouts), gradients
(both layouts), and the weight (re-quantized in place every iteration: its version is bumped, as the optimizer's
in-place update bumps it with one micro-batch per optimizer step; the "cached" column reuses it, as later
micro-batches of a step do). The FP32 weight gradient is accumulated into `main_grad`, as in training.

`--compiled` adds the same layer under `torch.compile` (the FP8 linear then runs as custom ops inside the graph,
quantizing its weight every iteration, or reading it from a cache prepared once, as a compiled block does) against
a compiled `nn.Linear`.

`--cuda-graphs` adds both layers' iterations captured in a CUDA graph and replayed: device time only, with the
host's launch cost out of the picture, as the training step runs under `training.compile_mode: reduce-overhead`.
Where the eager columns fall behind these, the eager iteration is bound by the host (Python and launches).

`--calling-thread` runs both layers' backward on the calling thread instead of autograd's CUDA worker thread, as
the training loop does (`training.backward_on_worker_thread: false`): less host time per iteration.

Usage: python benchmarks/fp8_linear.py [--backends cublas triton] [--iters 20] [--compiled] [--cuda-graphs]
       [--calling-thread]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.parallel import ColumnParallelLinear  # noqa: E402
from megafp8.precision import Fp8Recipe, PrecisionRecipe  # noqa: E402

SHAPES = [(8192, 7168, 18432), (8192, 18432, 7168), (8192, 4096, 4096), (8192, 2048, 7168)]


def time_ms(fn, iters: int) -> float:
    """Median milliseconds per call over CUDA-event-timed repeats (triton.testing.do_bench), after warm-up."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=max(100, 5 * iters), return_mode="median")


def graphed(fn, warmup: int = 3):
    """`fn` captured in a CUDA graph after `warmup` calls on a side stream (as torch's docs prescribe, so lazily
    made state such as `.grad` and the FP8 weight cache exists before capture); returns the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def saved_activation_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd keeps for backward besides the weights (parameters, and an FP8 layer's quantized weight and
    its transpose, which live in its cache anyway)."""
    weights = {p.data_ptr() for p in layer.parameters()}
    layer(x)  # fills an FP8 layer's weight cache
    cache = getattr(layer, "fp8_cache", None)
    if cache is not None and cache.entry is not None:
        weights |= {t.data_ptr() for t in cache.entry.tensors() if t is not None}
    total = 0

    def pack(t):
        nonlocal total
        if t is not None and t.data_ptr() not in weights:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum()
    return total


def bench_shape(m: int, k: int, n: int, backends: list[str], iters: int, compiled: bool = False,
                cuda_graphs: bool = False) -> dict[str, float]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    flops = 6.0 * m * k * n
    bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)

    def step_bf16():
        bf16(x).backward(dy)

    row = {"bf16_tflops": flops / time_ms(step_bf16, iters) / 1e9,
           "bf16_saved_mb": saved_activation_bytes(bf16, x) / 2**20}
    if compiled:
        bf16_compiled = torch.compile(bf16, dynamic=False)  # one shape each: no "automatic dynamic" recompile
        row["bf16_compiled_tflops"] = flops / time_ms(lambda: bf16_compiled(x).backward(dy), iters) / 1e9
    if cuda_graphs:
        row["bf16_graphed_tflops"] = flops / time_ms(graphed(step_bf16), iters) / 1e9
    bf16.weight.grad = None
    for name in backends:
        layer = ColumnParallelLinear(k, n, PrecisionRecipe.from_name("fp8", Fp8Recipe(backend=name)), device="cuda")
        with torch.no_grad():
            layer.weight.normal_(0, 0.02)
        layer.weight.main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)

        def step_fp8(requantize=True):
            if requantize:  # a new weight version, as the optimizer's in-place update makes: quantized in place
                torch.autograd.graph.increment_version(layer.weight)
            layer(x).backward(dy)

        row[f"{name}_tflops"] = flops / time_ms(step_fp8, iters) / 1e9
        row[f"{name}_cached_tflops"] = flops / time_ms(lambda: step_fp8(False), iters) / 1e9
        if cuda_graphs:
            row[f"{name}_graphed_tflops"] = flops / time_ms(graphed(step_fp8), iters) / 1e9
            row[f"{name}_graphed_cached_tflops"] = flops / time_ms(graphed(lambda: step_fp8(False)), iters) / 1e9
        row[f"{name}_saved_mb"] = saved_activation_bytes(layer, x) / 2**20
        if compiled:
            layer_compiled = torch.compile(layer, dynamic=False)
            layer.fp8_cache.clear()  # the graph quantizes the weight at every call
            row[f"{name}_compiled_tflops"] = flops / time_ms(lambda: layer_compiled(x).backward(dy), iters) / 1e9
            torch._dynamo.reset()
            layer.prepare_for_compiled()  # as a compiled block does: the graph reads the weight quantized once
            row[f"{name}_compiled_cached_tflops"] = flops / time_ms(lambda: layer_compiled(x).backward(dy),
                                                                    iters) / 1e9
        del layer
    return row


def profile(m: int, k: int, n: int, backend: str) -> None:
    """Kernel times of one FP8 training iteration (weight re-quantized), by kernel name."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    layer = ColumnParallelLinear(k, n, PrecisionRecipe.from_name("fp8", Fp8Recipe(backend=backend)), device="cuda")
    with torch.no_grad():
        layer.weight.normal_(0, 0.02)  # real values: uninitialized memory draws less power and flatters timings
    layer.weight.main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
    for _ in range(3):
        torch.autograd.graph.increment_version(layer.weight)
        layer(x).backward(dy)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.graph.increment_version(layer.weight)
            layer(x).backward(dy)
        torch.cuda.synchronize()
    print(f"## {backend}: kernel time per iteration, {m}x{k}x{n}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["cublas", "triton"])
    parser.add_argument("--iters", type=int, default=20, help="scales the timing window (5 ms per iter, >=100 ms)")
    parser.add_argument("--profile", action="store_true", help="print a kernel-time breakdown of the first shape")
    parser.add_argument("--compiled", action="store_true", help="also time both layers under torch.compile")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time both layers' iterations replayed from a CUDA graph (device time only)")
    parser.add_argument("--calling-thread", action="store_true",
                        help="run backward on the calling thread, as the training loop does")
    args = parser.parse_args()
    with torch.autograd.set_multithreading_enabled(not args.calling_thread):
        return run(args)


def run(args: argparse.Namespace) -> int:
    if args.profile:
        profile(*SHAPES[0], args.backends[0])
    thread = "calling thread" if args.calling_thread else "autograd's worker thread"
    print(f"# {torch.cuda.get_device_name()} | torch {torch.version.__version__} | CUDA {torch.version.cuda} | "
          f"backward on the {thread}")
    head = "| M x K x N | BF16 TFLOP/s | " + " | ".join(
        f"{b} TFLOP/s (x BF16) | {b} cached-weight TFLOP/s" for b in args.backends
    ) + (" | BF16 compiled | " + " | ".join(f"{b} compiled (x BF16 compiled) | {b} compiled, cached weight"
                                            for b in args.backends)
         if args.compiled else "") + (" | BF16 CUDA graph | " + " | ".join(
        f"{b} CUDA graph (x BF16 graph) | {b} CUDA graph, cached weight" for b in args.backends)
         if args.cuda_graphs else "") + " | saved activations BF16 -> FP8 (MiB) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for m, k, n in SHAPES:
        r = bench_shape(m, k, n, args.backends, args.iters, args.compiled, args.cuda_graphs)
        cells = [f"{m}x{k}x{n}", f"{r['bf16_tflops']:.0f}"]
        for b in args.backends:
            cells += [f"{r[f'{b}_tflops']:.0f} ({r[f'{b}_tflops'] / r['bf16_tflops']:.2f}x)",
                      f"{r[f'{b}_cached_tflops']:.0f} ({r[f'{b}_cached_tflops'] / r['bf16_tflops']:.2f}x)"]
        if args.compiled:
            cells.append(f"{r['bf16_compiled_tflops']:.0f}")
            for b in args.backends:
                cells += [f"{r[f'{b}_{kind}']:.0f} ({r[f'{b}_{kind}'] / r['bf16_compiled_tflops']:.2f}x)"
                          for kind in ("compiled_tflops", "compiled_cached_tflops")]
        if args.cuda_graphs:
            cells.append(f"{r['bf16_graphed_tflops']:.0f}")
            for b in args.backends:
                cells += [f"{r[f'{b}_{kind}']:.0f} ({r[f'{b}_{kind}'] / r['bf16_graphed_tflops']:.2f}x)"
                          for kind in ("graphed_tflops", "graphed_cached_tflops")]
        cells.append(f"{r['bf16_saved_mb']:.0f} -> {r[f'{args.backends[0]}_saved_mb']:.0f}")
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
