#!/usr/bin/env python
"""The experts' weight gradients with uneven experts: the warp-specialized kernel's programs walking the tiles
expert by expert against the balanced walk (`megafp8.precision.kernels.schedule.balanced_tile_order`).

    PYTHONPATH=. python benchmarks/grouped_wgrad_balance.py [--iters 20] [--spreads 0 0.3 0.6 1.0]

Why: in the MoE step's profile the down projection's grouped wgrad ran at 598 TFLOP/s against 757 alone with every
expert given the same rows (docs/benchmarks.md, job EP/EQ). With 64 tiles an expert (2,048 x 1,024 in 256-wide
tiles) on 132 SMs, the programs of the expert-by-expert walk each take a stripe of experts, and the busiest stripe
sets the time; the gate/up projection's 128 tiles an expert meet every program about once.

The MoE benchmark's shapes (`train_step.py --model moe`): 64 experts, hidden 2,048, expert FFN 1,024, 16,384 tokens
routed to 8 experts each (131,072 rows). Rows per expert are log-normally uneven with the given spread (seeded;
spread 0: equal), each padded to 128. The wgrads add into an FP32 main_grad, as in training:

    gate/up  main_grad[e] (2,048 x 2,048) += d(gu)[rows of e]^T @ x[rows of e]
    down     main_grad[e] (2,048 x 1,024) += dy[rows of e]^T @ a[rows of e]

Timed as the step runs them: `--iters` calls captured in one CUDA graph, the median of five replays. Printed per
shape and spread: the busiest expert's rows over the mean, each walk's ms and TFLOP/s, and the programs' modelled
imbalance (the busiest program's K steps over the mean, `schedule.program_loads`)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grouped_gemm import graphed_ms  # noqa: E402
from megafp8.precision import E4M3  # noqa: E402
from megafp8.precision.backends import select_backend  # noqa: E402
from megafp8.precision.expert_layout import expert_rows  # noqa: E402
from megafp8.precision.kernels import gemm  # noqa: E402
from megafp8.precision.kernels.schedule import balanced_tile_order, program_loads  # noqa: E402
from megafp8.precision.kernels.ws_gemm import _sm_count  # noqa: E402

SHAPES = {"gate/up": (2048, 2048), "down": (2048, 1024)}  # (N, K) of main_grad[e]: the product's rows, columns
EXPERTS, ROWS = 64, 131_072


def uneven_counts(spread: float, seed: int = 0) -> torch.Tensor:
    """Rows per expert summing to ROWS (up to rounding), log-normally spread."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.exp(spread * torch.randn(EXPERTS, generator=g, dtype=torch.float64))
    counts = torch.floor(ROWS * weights / weights.sum()).long()
    counts[0] += ROWS - int(counts.sum())
    return counts


def modelled_imbalance(tile_count: torch.Tensor, tiles_per_expert: int, programs: int, balanced: bool) -> float:
    cost = tile_count.cpu().double().repeat_interleave(tiles_per_expert) + 2.0  # + the epilogue, in K steps
    order = balanced_tile_order(tile_count.cpu(), tiles_per_expert, programs) if balanced else \
        torch.arange(cost.numel(), dtype=torch.int32)
    loads = program_loads(cost, order, programs)
    return float(loads.max() / loads.mean())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--spreads", type=float, nargs="+", default=[0.0, 0.3, 0.6, 1.0])
    parser.add_argument("--block-n", type=int, default=256, choices=[128, 256])
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    quantizer = select_backend("hopper", device)
    programs = _sm_count(device)
    print("| wgrad (N x K) | spread | busiest expert's rows / mean | expert by expert: ms (TFLOP/s), modelled "
          "imbalance | balanced: ms (TFLOP/s), modelled imbalance | balanced / by expert |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        for spread in args.spreads:
            counts = uneven_counts(spread)
            rows = expert_rows(counts.tolist(), device)
            g = torch.Generator(device=device).manual_seed(1)
            dy = torch.randn(rows.total, n, generator=g, device=device).bfloat16()
            x = torch.randn(rows.total, k, generator=g, device=device).bfloat16()
            # Along the tokens, as the backward quantizes them for the wgrad (1x128 tiles of the transposes).
            dyt, dyt_s = quantizer.quantize_rows_cols(dy, E4M3, False)[2:]
            xt, xt_s = quantizer.quantize_rows_cols(x, E4M3, False)[2:]
            main_grad = torch.zeros(EXPERTS, n, k, device=device)
            tiles_per_expert = (n // 128) * (k // args.block_n)
            cells = []
            for balanced in (False, True):
                def run(balanced=balanced):
                    return gemm.grouped_wgrad(dyt, dyt_s, xt, xt_s, rows.tile_start, rows.tile_count,
                                              torch.float32, kernel="ws", accumulate=main_grad,
                                              block_n=args.block_n, balance_groups=balanced)
                ms = graphed_ms(run, args.iters)
                tflops = 2.0 * int(rows.tile_count.sum()) * 128 * n * k / ms / 1e9
                cells.append((ms, f"{ms:.3f} ({tflops:,.0f}), "
                                  f"{modelled_imbalance(rows.tile_count, tiles_per_expert, programs, balanced):.3f}"))
            ratio = float(counts.max()) / float(counts.float().mean())
            print(f"| {name} ({n} x {k}) | {spread:g} | {ratio:.2f} | {cells[0][1]} | {cells[1][1]} | "
                  f"{cells[1][0] / cells[0][0]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
