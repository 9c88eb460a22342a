#!/usr/bin/env python
"""Host cost per call of each piece of the FP8 linear, on operands too small to keep the GPU busy.

With a 128x256 activation and a 256x256 weight every kernel finishes long before the next is
launched, so the time per call is Python, argument checking and launch: the floor each FP8 layer
pays per micro-batch regardless of its size. BF16 `F.linear` and a torch `add` are the yardsticks.
Usage (GPU machine, repo root): PYTHONPATH=. python benchmarks/fp8_launch_cost.py
"""
import sys
import time

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
    x_fp8, x_scale = backend.quantize_rows(x, E4M3, False)
    cache = backend.empty_weight(w.shape, E4M3, w.device)
    backend.quantize_weight_(w, cache, E4M3, False)
    pieces = {
        "torch add (a plain launch)": lambda: x.add(1),
        "BF16 F.linear": lambda: F.linear(x, w),
        "Triton quantize_rows (x)": lambda: backend.quantize_rows(x, E4M3, False),
        "Triton quantize_rows_cols (x or dy, both layouts)": lambda: backend.quantize_rows_cols(x, E4M3, False),
        "Triton weight + transpose, in place (w)": lambda: backend.quantize_weight_(w, cache, E4M3, False),
        "F.scaled_mm blockwise (one GEMM)": lambda: backend.gemm_1x128_128x128(x_fp8, x_scale, cache.w_fp8,
                                                                               cache.w_scale, torch.bfloat16),
    }
    print("| piece | host us per call |\n|---|---|")
    for name, fn in pieces.items():
        print(f"| {name} | {per_call_us(fn):.1f} |")


if __name__ == "__main__":
    main()
