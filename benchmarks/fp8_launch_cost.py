#!/usr/bin/env python
"""Host cost per call of each piece of the FP8 linear, on operands too small to keep the GPU busy.

With a 128x256 activation and a 256x256 weight every kernel finishes long before the next is
launched, so the time per call is Python, argument checking and launch: the floor each FP8 layer
pays per micro-batch regardless of its size. BF16 `F.linear` and a torch `add` are the yardsticks; the last rows
time a whole small layer's forward and backward, BF16 and FP8.
`--cprofile N` also prints, for each piece, the N Python functions with the most own time over its calls
(cProfile): where the host time goes.
Usage (GPU machine, repo root): PYTHONPATH=. python benchmarks/fp8_launch_cost.py [--cprofile 25]
"""
import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from megafp8.precision import E4M3, select_backend  # noqa: E402


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    backend = select_backend("cublas", torch.device("cuda"))
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
        "F.scaled_mm blockwise (fprop or dgrad GEMM)": lambda: backend.gemm_1x128_128x128(
            x_fp8, x_scale, cache.w_fp8, cache.w_scale, torch.bfloat16),
        "wgrad GEMM into FP32 main_grad (cuBLASLt)": lambda: backend.gemm_1x128_1x128_accumulate_(
            main_grad, xt_fp8, xt_scale, xt_fp8, xt_scale),
    }
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    args = parser.parse_args()
    layers = whole_layers()
    print("| piece | host us per call |\n|---|---|")
    for name, fn in pieces.items():
        print(f"| {name} | {per_call_us(fn):.1f} |")
    for name, fn in layers.items():  # a whole layer takes longer: fewer calls
        print(f"| {name} | {per_call_us(fn, 500):.1f} |")
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


def whole_layers() -> dict:
    """Forward + backward of one small layer (128 tokens, 256 -> 256), BF16 and FP8 (weight cached, as for every
    micro-batch after a step's first): the host's floor per layer and micro-batch."""
    from megafp8.parallel import ColumnParallelLinear
    from megafp8.precision import Fp8Recipe, PrecisionRecipe

    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    layers = {"BF16 linear, forward + backward": ColumnParallelLinear(256, 256, PrecisionRecipe.from_name("bf16"),
                                                                      device="cuda")}
    fp8 = ColumnParallelLinear(256, 256, PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="cublas")),
                               device="cuda")
    fp8.weight.main_grad = torch.zeros(256, 256, device="cuda", dtype=torch.float32)
    layers["FP8 linear, forward + backward (weight cached)"] = fp8
    return {name: (lambda layer=layer: layer(x).backward(dy)) for name, layer in layers.items()}


if __name__ == "__main__":
    main()
