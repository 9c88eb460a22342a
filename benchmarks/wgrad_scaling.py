#!/usr/bin/env python
"""What the weight gradient's accuracy pays for coarser scaling of x: a numerics study on the CPU.

    PYTHONPATH=. python benchmarks/wgrad_scaling.py [--tokens 4096] [--features 2048] [--outputs 1024] [--seed 0]

The weight gradient dW = dy^T @ x contracts over the tokens. DeepSeek-V3's recipe (ours, `../shared/DESIGN.md`
section 3) quantizes both operands in 1x128 tiles along the tokens: one scale per feature and 128 tokens. Then the
GEMM must multiply each K step's product by the outer product of two scale vectors, one multiply per output element
more than fprop's promotion, and the wgrad runs 1.19-1.46x slower than the same kernel with x^T in 128 x 128 blocks
(features x tokens, one scale per block; `docs/benchmarks.md`, thirty-fifth session). This script measures the
accuracy side of that trade on activation distributions that stress the coarser blocks:

- gaussian: i.i.d. N(0, 1), the easy case;
- channel spread: each feature scaled by a log-normal factor (sigma 1): features of different magnitude share a
  block;
- massive channels: log-normal (sigma 2) feature scales and 0.5% of the features 100x larger, as the "massive
  activations" of trained LLMs' residual streams;
- SwiGLU output: silu(g) * u of two such channel-spread inputs (the down projection's x: heavy tails);
- token outliers: 1% of the tokens 50x larger (attention sinks, the first token).

dy is N(0, 1) with a log-normal (sigma 1) scale per token. Both are rounded to BF16 first (what the layers hand the
quantizers). For each case, the relative Frobenius error of dW against the FP64 product of those BF16 operands:

- recipe: dy^T and x^T both in 1x128 tiles along the tokens (E5M2 or E4M3 for dy as `--grad-format` says);
- x in 128x128 blocks: dy^T as in the recipe, x^T in 128 x 128 blocks;
- tensorwise: one scale per tensor for each (torchao's default float8 recipe), for scale.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.formats import E4M3, E5M2, Fp8Format  # noqa: E402
from megafp8.precision.quantize import (dequantize_128x128, dequantize_1x128, quantize_128x128,  # noqa: E402
                                        quantize_1x128, scales_from_amax)


def channel_scaled(m: int, k: int, g: torch.Generator, sigma: float) -> torch.Tensor:
    return torch.randn(m, k, generator=g) * torch.exp(sigma * torch.randn(k, generator=g))


def massive_channels(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = channel_scaled(m, k, g, 2.0)
    big = torch.randperm(k, generator=g)[: max(1, k // 200)]
    x[:, big] *= 100.0
    return x


def token_outliers(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=g)
    x[torch.randperm(m, generator=g)[: max(1, m // 100)]] *= 50.0
    return x


CASES: dict[str, Callable[[int, int, torch.Generator], torch.Tensor]] = {
    "gaussian": lambda m, k, g: torch.randn(m, k, generator=g),
    "channel spread (log-normal sigma 1)": lambda m, k, g: channel_scaled(m, k, g, 1.0),
    "massive channels (sigma 2, 0.5% x100)": massive_channels,
    "SwiGLU output": lambda m, k, g: F.silu(channel_scaled(m, k, g, 1.0)) * channel_scaled(m, k, g, 1.0),
    "token outliers (1% x50)": token_outliers,
}


def along_tokens(t: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """t (M, C) -> dequantized t^T (C, M) from 1x128 tiles along the tokens."""
    return dequantize_1x128(*quantize_1x128(t.t().contiguous(), fmt))


def in_blocks(t: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """t (M, C) -> dequantized t^T (C, M) from 128 x 128 blocks."""
    return dequantize_128x128(*quantize_128x128(t.t().contiguous(), fmt))


def tensorwise(t: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """t (M, C) -> dequantized t^T (C, M) with one scale for the whole tensor."""
    scale, inv = scales_from_amax(t.float().abs().amax().reshape(1), fmt, False)
    return ((t.t().float() * inv).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() * scale)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def study(tokens: int, features: int, outputs: int, seed: int, grad_fmt: Fp8Format) -> list[tuple[str, ...]]:
    """One row per case: (case, recipe error, x-in-blocks error, its ratio to the recipe's, tensorwise error)."""
    rows = []
    for name, make in CASES.items():
        g = torch.Generator().manual_seed(seed)
        x = make(tokens, features, g).bfloat16()
        dy = (torch.randn(tokens, outputs, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g))).bfloat16()
        want = dy.double().t() @ x.double()
        dyt = along_tokens(dy, grad_fmt)
        recipe = relative_error(dyt @ along_tokens(x, E4M3).t(), want)
        blocks = relative_error(dyt @ in_blocks(x, E4M3).t(), want)
        whole = relative_error(tensorwise(dy, grad_fmt) @ tensorwise(x, E4M3).t(), want)
        rows.append((name, f"{recipe:.4f}", f"{blocks:.4f}", f"{blocks / recipe:.2f}x", f"{whole:.4f}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--features", type=int, default=2048, help="x's features (the wgrad's K side)")
    parser.add_argument("--outputs", type=int, default=1024, help="dy's features (the wgrad's N side)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grad-format", choices=["e4m3", "e5m2"], default="e4m3", help="dy's FP8 format")
    args = parser.parse_args()
    for size, what in ((args.tokens, "--tokens"), (args.features, "--features"), (args.outputs, "--outputs")):
        if size % 128:
            parser.error(f"{what} must be a multiple of 128 (got {size})")
    grad_fmt = E4M3 if args.grad_format == "e4m3" else E5M2
    print(f"dW = dy^T x, {args.tokens} tokens, x {args.features} features, dy {args.outputs}; dy in "
          f"{args.grad_format}; relative Frobenius error against FP64\n")
    header = ("x", "recipe (1x128 along tokens)", "x in 128x128 blocks", "blocks / recipe", "tensorwise")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in study(args.tokens, args.features, args.outputs, args.seed, grad_fmt):
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
