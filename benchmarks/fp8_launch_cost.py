#!/usr/bin/env python
"""Host cost per call of each piece of the FP8 linear, on operands too small to keep the GPU busy.

With a 128x256 activation and a 256x256 weight every kernel finishes long before the next is
launched, so the time per call is Python, argument checking and launch: the floor each FP8 layer
pays per micro-batch regardless of its size. BF16 `F.linear` and a torch `add` are the yardsticks; the last rows
time a whole small layer's forward and backward, BF16 and FP8.
`--cprofile N` also prints, for each piece, the N Python functions with the most own time over its calls
(cProfile): where the host time goes. `--kernels` prints, for each whole layer, the device kernels and the torch
operators one forward + backward runs (torch.profiler), at the small shape and at 8192 x 4096 -> 4096: a copy or
fill kernel nobody asked for shows there.
`--backend hopper` times the hopper backend's pieces and layers instead of the cublas backend's: its fprop and
dgrad GEMMs are our warp-specialized Gluon kernel (five TMA descriptors and Gluon's launcher a call), the rest is
the cublas backend's.
Each piece's calls are timed in `--windows` windows (default 5): the table gives the median window and the lowest.
Usage (GPU machine, repo root): PYTHONPATH=. python benchmarks/fp8_launch_cost.py [--backend hopper] [--cprofile 25]
                                [--kernels] [--windows 5]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from megafp8.precision import E4M3, select_backend  # noqa: E402


def per_call_us(fn, calls: int = 2000, windows: int = 5, sync=None) -> tuple[float, float]:
    """(median, lowest) µs per call of fn over `windows` timing windows of calls / windows calls each, after a
    warm-up: the host's state (other tenants, the clock) moves single windows by tens of percent, the median and
    the lowest window much less. `sync` waits for the device (default: torch.cuda.synchronize)."""
    sync = sync or torch.cuda.synchronize
    for _ in range(50):
        fn()
    sync()
    per_window = max(1, calls // windows)
    times = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(per_window):
            fn()
        sync()
        times.append((time.perf_counter() - start) / per_window * 1e6)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="cublas", choices=["cublas", "hopper"])
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--kernels", action="store_true", help="each whole layer's kernels and operators")
    parser.add_argument("--windows", type=int, default=5, help="timing windows per piece (median and lowest shown)")
    args = parser.parse_args()
    backend = select_backend(args.backend, torch.device("cuda"))
    gemm = "F.scaled_mm blockwise" if args.backend == "cublas" else "warp-specialized GEMM"
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    x_fp8, x_scale = backend.quantize_rows(x, E4M3, False)
    _, _, xt_fp8, xt_scale = backend.quantize_rows_cols(x, E4M3, False)
    main_grad = torch.zeros(256, 256, device="cuda", dtype=torch.float32)
    cache = backend.empty_weight(w.shape, E4M3, w.device)
    backend.quantize_weight_(w, cache, E4M3, False)
    pieces = {
        "torch add (a plain launch)": lambda: x.add(1),
        "BF16 F.linear": lambda: F.linear(x, w),
        "quantize_rows (x)": lambda: backend.quantize_rows(x, E4M3, False),
        "quantize_rows_cols (x or dy, both layouts)": lambda: backend.quantize_rows_cols(x, E4M3, False),
        "rmsnorm_quantize (RMSNorm's output, both layouts)": lambda: backend.rmsnorm_quantize(x, norm_w, 1e-5, E4M3,
                                                                                              False),
        "weight + transpose, in place (w)": lambda: backend.quantize_weight_(w, cache, E4M3, False),
        "transpose of the FP8 weight (dgrad without a kept w^T)": lambda: backend.transpose_weight(cache.w_fp8,
                                                                                                  cache.w_scale),
        f"{gemm} (fprop or dgrad)": lambda: backend.gemm_1x128_128x128(
            x_fp8, x_scale, cache.w_fp8, cache.w_scale, torch.bfloat16),
        "wgrad GEMM into FP32 main_grad (cuBLASLt)": lambda: backend.gemm_1x128_1x128_accumulate_(
            main_grad, xt_fp8, xt_scale, xt_fp8, xt_scale),
    }
    # The GEMM as the layer calls it: operands fresh from their producers at every call, not made once.
    rc_fp8, rc_scale = backend.quantize_rows_cols(x, E4M3, False)[:2]
    wt_fp8, wt_scale = backend.transpose_weight(cache.w_fp8, cache.w_scale)
    pieces.update({
        f"{gemm} on quantize_rows_cols' x (made once)": lambda: backend.gemm_1x128_128x128(
            rc_fp8, rc_scale, cache.w_fp8, cache.w_scale, torch.bfloat16),
        f"quantize_rows_cols, then {gemm} on its x": lambda: backend.gemm_1x128_128x128(
            *backend.quantize_rows_cols(x, E4M3, False)[:2], cache.w_fp8, cache.w_scale, torch.bfloat16),
        f"{gemm} on a transposed weight (made once)": lambda: backend.gemm_1x128_128x128(
            rc_fp8, rc_scale, wt_fp8, wt_scale, torch.bfloat16),
        f"transpose_weight, then {gemm} on it": lambda: backend.gemm_1x128_128x128(
            rc_fp8, rc_scale, *backend.transpose_weight(cache.w_fp8, cache.w_scale), torch.bfloat16),
    })
    layers = whole_layers(backend=args.backend)
    if args.kernels:
        for tokens, features in ((128, 256), (8192, 4096)):
            for name, fn in whole_layers(tokens, features, args.backend).items():
                print(f"\n### {name}, {tokens} tokens, {features} -> {features}\n")
                print(kernels_and_operators(fn))
    print(f"{args.backend} backend\n\n| piece | host us per call (median of {args.windows} windows) | lowest window |"
          "\n|---|---|---|")
    for name, fn in pieces.items():
        print("| {} | {:.1f} | {:.1f} |".format(name, *per_call_us(fn, windows=args.windows)))
    for name, fn in layers.items():  # a whole layer takes longer: fewer calls
        print("| {} | {:.1f} | {:.1f} |".format(name, *per_call_us(fn, 500, args.windows)))
    for name, fn in {**pieces, **layers}.items() if args.cprofile else ():
        print(f"\n### {name}: own time per call by function (cProfile, 200 calls)\n")
        print(own_times(fn, args.cprofile))


def own_times(fn, top: int, calls: int = 200) -> str:
    """The `top` functions by own time over `calls` calls of fn, in microseconds per call of fn."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profile.disable()
    stats = pstats.Stats(profile, stream=io.StringIO())
    # (file, line, name) -> (primitive calls, calls, own time, cumulative time, callers)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    lines = ["| function | own us per call | calls per call |", "|---|---|---|"]
    for (path, line, name), (_, ncalls, own, *_) in rows:
        where = f"{Path(path).name}:{line}" if line else path
        lines.append(f"| `{name}` ({where}) | {own / calls * 1e6:.1f} | {ncalls / calls:g} |")
    return "\n".join(lines)


def whole_layers(tokens: int = 128, features: int = 256, backend: str = "cublas") -> dict:
    """Forward + backward of one layer (by default small: 128 tokens, 256 -> 256), BF16 and FP8 (weight cached, as
    for every micro-batch after a step's first), each adding its weight gradient into an FP32 main_grad as in
    training: the host's floor per layer and micro-batch."""
    from megafp8.parallel import ColumnParallelLinear
    from megafp8.precision import Fp8Recipe, PrecisionRecipe

    x = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, features, device="cuda", dtype=torch.bfloat16)
    layers = {}
    for name, recipe in (("BF16 linear, forward + backward", PrecisionRecipe.from_name("bf16")),
                         ("FP8 linear, forward + backward (weight cached)",
                          PrecisionRecipe.from_name("fp8", Fp8Recipe(backend=backend)))):
        layer = ColumnParallelLinear(features, features, recipe, device="cuda")
        layer.weight.main_grad = torch.zeros(features, features, device="cuda", dtype=torch.float32)
        layers[name] = layer
    runs = {name: (lambda layer=layer: layer(x).backward(dy)) for name, layer in layers.items()}
    for name, layer in layers.items():
        runs[name.replace("forward + backward", "forward alone")] = lambda layer=layer: layer(x)
        runs[name + ", backward on the calling thread"] = lambda layer=layer: _on_calling_thread(layer, x, dy)
    return runs


def _on_calling_thread(layer, x: torch.Tensor, dy: torch.Tensor) -> None:
    """Forward and backward with autograd's engine running backward on this thread, not its CUDA worker thread."""
    with torch.autograd.set_multithreading_enabled(False):
        layer(x).backward(dy)


def kernels_and_operators(fn, calls: int = 10) -> str:
    """The device kernels (launches per call, device us per call) and the torch operators with the most own host
    time (us per call) of `calls` calls of fn, after a warm-up."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type.name == "CUDA"), key=lambda e: -e.self_device_time_total)
    lines = ["| kernel | launches per call | device us per call |", "|---|---|---|"]
    lines += [f"| `{e.key[:110]}` | {e.count / calls:g} | {e.self_device_time_total / calls:.1f} |" for e in kernels]
    operators = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    lines += ["", "| operator | calls per call | own host us per call |", "|---|---|---|"]
    lines += [f"| `{e.key[:110]}` | {e.count / calls:g} | {e.self_cpu_time_total / calls:.1f} |"
              for e in operators[:25]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
