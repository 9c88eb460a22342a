#!/usr/bin/env python
"""The experts' grouped wgrad into main_grad with most experts idle: the warp-specialized kernel walking every
expert's tiles against walking only the busy experts' (`ws_gemm(compact_groups=...)`), and a model of why.

    PYTHONPATH=. python benchmarks/grouped_wgrad_walk.py [--busy 13] [--iters 20] [--repeats 4]
    PYTHONPATH=. python benchmarks/grouped_wgrad_walk.py --model-only     # the model alone (no GPU)

The routing is the MoE step's collapsed one (`train_step.py --model moe`, jobs FS and IE): 64 experts, 131,072
(token, expert) rows, `--busy` experts with rows, one of them with 16,384 (every token), the others sharing the rest;
the busy experts are spread over the 64 as a seeded draw. Shapes: the gate/up projection's wgrad (N 2,048 x K
2,048) and the down projection's (2,048 x 1,024), each added into a zeroed FP32 main_grad (what the training step
runs), 256-wide tiles; and, as a control, every expert busy with equal rows (the walks give the same tiles).

The model: the kernel's programs (one per SM) take tiles tile = program, program + SMs, ... ; in expert order an
expert's tiles are consecutive, so with few busy experts each busy expert's tiles land on one stripe of programs,
and programs under several stripes do several times the mean's work. The compact walk deals out only the busy
experts' tiles. The model's figure is the busiest program's K steps against the mean program's (1.00 is even).
The GPU table gives each walk's device time (CUDA-graph replays, median of five; with `--repeats`, the median over
rounds that take the two walks in turn, in alternating order) and checks their bits are equal.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXPERTS, ROWS, HEAVY_ROWS = 64, 131_072, 16_384
SHAPES = {"gate/up": (2048, 2048), "down": (2048, 1024)}  # (N, K) of each expert's weight gradient
TILE, BLOCK_N = 128, 256


def collapsed_counts(busy: int, seed: int = 0, experts: int = EXPERTS, rows: int = ROWS,
                     heavy: int = HEAVY_ROWS) -> torch.Tensor:
    """Rows per expert: `busy` experts (a seeded draw) with rows, one of them `heavy`, the rest shared evenly."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(experts, generator=g)[:busy]
    counts = torch.zeros(experts, dtype=torch.long)
    if busy == 1:
        counts[chosen] = rows
        return counts
    rest = rows - heavy
    counts[chosen[1:]] = rest // (busy - 1)
    counts[chosen[1]] += rest - (rest // (busy - 1)) * (busy - 1)
    counts[chosen[0]] = heavy
    return counts


def program_steps(counts: torch.Tensor, tiles_per_expert: int, programs: int, compact: bool) -> list[int]:
    """K steps (128-row blocks) each program takes, walking the experts' tiles in expert order or compactly."""
    steps = [-(-int(c) // TILE) for c in counts]
    order = [e for e in range(len(steps)) if steps[e] or not compact]
    load = [0] * programs
    for i, e in enumerate(e for e in order for _ in range(tiles_per_expert)):
        load[i % programs] += steps[e]
    return load


def imbalance(load: list[int]) -> float:
    """The busiest program's work over the mean program's."""
    return max(load) / (sum(load) / len(load))


def model_table(busy: int, programs: int, seeds: int = 20) -> str:
    lines = ["| wgrad | tiles an expert | busiest / mean program, expert order | compact |", "|---|---|---|---|"]
    for name, (n, k) in SHAPES.items():
        tiles = -(-n // TILE) * -(-k // BLOCK_N)
        walks = [[imbalance(program_steps(collapsed_counts(busy, s), tiles, programs, c)) for s in range(seeds)]
                 for c in (False, True)]
        lines.append(f"| {name} | {tiles} | " + " | ".join(f"{sum(w) / len(w):.2f} ({min(w):.2f}-{max(w):.2f})"
                                                          for w in walks) + " |")
    return "\n".join(lines)


def gpu_table(busy: int, iters: int, seed: int, repeats: int) -> str:
    from benchmarks.grouped_gemm import graphed_ms
    from megafp8.precision import E4M3
    from megafp8.precision.backends import select_backend
    from megafp8.precision.grouped import expert_rows
    from megafp8.precision.kernels.ws_gemm import ws_gemm
    device = torch.device("cuda")
    impl = select_backend("hopper", device)
    lines = ["| routing | wgrad | expert order ms (TFLOP/s) | compact ms (TFLOP/s) | compact / expert order | bits |",
             "|---|---|---|---|---|---|"]
    routings = {f"{busy} busy, one with {HEAVY_ROWS:,} rows": collapsed_counts(busy, seed),
                "64 busy, equal rows": torch.full((EXPERTS,), ROWS // EXPERTS, dtype=torch.long)}
    for label, counts in routings.items():
        rows = expert_rows(counts.to(device), device, rows=ROWS)
        for name, (n, k) in SHAPES.items():
            g = torch.Generator(device=device).manual_seed(1)
            dy = torch.randn(rows.total, n, generator=g, device=device).bfloat16()
            x = torch.randn(rows.total, k, generator=g, device=device).bfloat16()
            at, at_s = impl.quantize_rows_cols(dy, E4M3, False)[2:]
            bt, bt_s = impl.quantize_rows_cols(x, E4M3, False)[2:]
            del dy, x
            outputs = []
            for compact in (False, True):
                first = torch.zeros(EXPERTS, n, k, dtype=torch.float32, device=device)
                ws_gemm(at, at_s, bt, bt_s, first, b_blockwise=False, accumulate=True, k_start=rows.tile_start,
                        k_count=rows.tile_count, block_n=BLOCK_N, compact_groups=compact)
                outputs.append(first)
            times = {False: [], True: []}
            for r in range(repeats):  # the two walks in turn, the order reversed every other round (ABBA...)
                for compact in ((False, True) if r % 2 == 0 else (True, False)):
                    main_grad = torch.zeros(EXPERTS, n, k, dtype=torch.float32, device=device)
                    times[compact].append(graphed_ms(
                        lambda: ws_gemm(at, at_s, bt, bt_s, main_grad, b_blockwise=False,  # noqa: B023
                                        accumulate=True, k_start=rows.tile_start, k_count=rows.tile_count,
                                        block_n=BLOCK_N, compact_groups=compact), iters))
            cells = []
            for compact in (False, True):
                ms = statistics.median(times[compact])
                cells.append((ms, 2.0 * ROWS * n * k / ms / 1e9))
            same = torch.equal(outputs[0].view(torch.int32), outputs[1].view(torch.int32))
            lines.append(f"| {label} | {name} | " + " | ".join(f"{ms:.3f} ({tf:,.0f})" for ms, tf in cells)
                         + f" | {cells[1][0] / cells[0][0]:.3f} | {'equal' if same else 'DIFFERENT'} |")
            del outputs
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=13, help="experts with rows (IE's step: 13 of 64, 80%% idle)")
    parser.add_argument("--iters", type=int, default=20, help="calls per CUDA graph replay")
    parser.add_argument("--seed", type=int, default=0, help="the draw of the busy experts (GPU table)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the two walks, in turn, the order reversed "
                        "every other round; each cell is the median of its rounds (GPU table)")
    parser.add_argument("--programs", type=int, default=None, help="the model's programs (default: this GPU's SMs, "
                        "else an H100's 132)")
    parser.add_argument("--model-only", action="store_true", help="print the model only (no GPU needed)")
    args = parser.parse_args(argv)
    if not 1 <= args.busy <= EXPERTS:
        parser.error(f"--busy {args.busy}: give 1 to {EXPERTS}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: give at least 1")
    gpu = torch.cuda.is_available() and not args.model_only
    programs = args.programs or (torch.cuda.get_device_properties(0).multi_processor_count if gpu else 132)
    print(f"Model: {programs} programs, {args.busy} of {EXPERTS} experts busy (20 draws: mean (range))\n")
    print(model_table(args.busy, programs))
    if gpu:
        print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.iters} calls a replay\n")
        print(gpu_table(args.busy, args.iters, args.seed, args.repeats))
    elif not args.model_only:
        print("\n(no CUDA GPU here: the GPU table needs one)")


if __name__ == "__main__":
    main()
