#!/usr/bin/env python
"""The MoE router's three FP32 GEMMs: cuBLAS (the twin, `F.linear(x.float(), W)` and autograd's backward of it)
against our Triton FP32 kernel (`megafp8.parallel.router_gemm_kernels`), at the MoE step's shape, and the kernel's
tile configurations (`--configs`).

    PYTHONPATH=. python benchmarks/router_gemm.py [--tokens 16384] [--hidden 2048] [--experts 64] [--configs]

Each cell is device time per call (CUDA-graph replays of 20 calls, median of five), ms and TFLOP/s; "all three" is
the logits, the input's gradient (BF16 out) and the weight's gradient, with the twin's FP32 copy of x and cast of
dx included (what the step runs).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = [(64, 64, 32, 4), (128, 64, 32, 8), (64, 64, 16, 4), (32, 64, 32, 4), (64, 128, 32, 8)]


def gemms(tokens: int, hidden: int, experts: int) -> tuple[dict[str, Callable[[], object]], dict[str, Callable]]:
    """(cuBLAS's, ours): each GEMM of the router as a zero-argument call on fixed operands."""
    from megafp8.parallel import router_gemm_kernels as k
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    w = torch.randn(experts, hidden, device="cuda", generator=g) * 0.02
    grad = torch.randn(tokens, experts, device="cuda", generator=g) * 1e-4
    cublas = {"logits": lambda: torch.nn.functional.linear(x.float(), w),
              "input grad": lambda: (grad @ w).to(x.dtype),
              "weight grad": lambda: grad.t() @ x.float()}
    ours = {"logits": lambda: k.fp32_gemm(x, w.t(), torch.float32),
            "input grad": lambda: k.fp32_gemm(grad, w, x.dtype),
            "weight grad": lambda: k.fp32_gemm(grad.t(), x, torch.float32)}
    for name in cublas:  # the same values, to FP32 rounding
        a, b = cublas[name]().float(), ours[name]().float()
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-6 * float(a.abs().max())), name
    return cublas, ours


def table(tokens: int, hidden: int, experts: int, iters: int) -> str:
    from benchmarks.grouped_gemm import graphed_ms
    cublas, ours = gemms(tokens, hidden, experts)
    flops = 2.0 * tokens * hidden * experts
    lines = ["| GEMM | cuBLAS (twin) ms (TFLOP/s) | ours ms (TFLOP/s) | ours / cuBLAS |", "|---|---|---|---|"]
    totals = [0.0, 0.0]
    for name in cublas:
        times = [graphed_ms(cublas[name], iters), graphed_ms(ours[name], iters)]
        totals = [t + s for t, s in zip(totals, times)]
        lines.append(f"| {name} | " + " | ".join(f"{t:.3f} ({flops / t / 1e9:.1f})" for t in times)
                     + f" | {times[1] / times[0]:.3f} |")
    lines.append(f"| all three | {totals[0]:.3f} | {totals[1]:.3f} | {totals[1] / totals[0]:.3f} |")
    return "\n".join(lines)


def config_table(tokens: int, hidden: int, experts: int, iters: int) -> str:
    from benchmarks.grouped_gemm import graphed_ms
    from megafp8.parallel import router_gemm_kernels as k
    lines = ["| BLOCK_M, BLOCK_N, BLOCK_K, warps | logits ms | input grad ms | weight grad ms | sum |",
             "|---|---|---|---|---|"]
    default = (k.BLOCK_M, k.BLOCK_N, k.BLOCK_K, k.WARPS)
    try:
        for config in CONFIGS:
            k.BLOCK_M, k.BLOCK_N, k.BLOCK_K, k.WARPS = config
            _, ours = gemms(tokens, hidden, experts)
            times = [graphed_ms(ours[name], iters) for name in ours]
            mark = " (default)" if config == default else ""
            lines.append(f"| {', '.join(map(str, config))}{mark} | " + " | ".join(f"{t:.3f}" for t in times)
                         + f" | {sum(times):.3f} |")
    finally:
        k.BLOCK_M, k.BLOCK_N, k.BLOCK_K, k.WARPS = default
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20, help="calls per CUDA graph replay")
    parser.add_argument("--configs", action="store_true", help="also time the kernel's tile configurations")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens x hidden {args.hidden} x "
          f"{args.experts} experts\n")
    print(table(args.tokens, args.hidden, args.experts, args.iters))
    if args.configs:
        print()
        print(config_table(args.tokens, args.hidden, args.experts, args.iters))


if __name__ == "__main__":
    main()
