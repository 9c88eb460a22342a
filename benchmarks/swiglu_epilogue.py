#!/usr/bin/env python
"""The experts' gate/up fprop with SwiGLU in its epilogue against the GEMM then `swiglu_quantize`: device time and bits.

    PYTHONPATH=. python benchmarks/swiglu_epilogue.py [--iters 20] [--repeats 4] [--busy 13]

The shapes are the MoE step's (`train_step.py --model moe`): 64 experts, 131,072 (token, expert) rows, hidden 2,048,
expert FFN 1,024, so the gate/up projection is N 2,048 x K 2,048 and SwiGLU's output (the down projection's input)
is 1,024 wide. Two routings: every expert busy with equal rows, and the collapsed router of jobs FS/IE (`--busy`
experts with rows, one with every token; `grouped_wgrad_walk.collapsed_counts`).

Per routing, on the hopper backend (warp-specialized grouped kernel):

- separate: `grouped_gemm_1x128_128x128` (gu in BF16) then `swiglu_quantize(gu)`: two kernels, SwiGLU re-reading gu
  (the reference composition, `Fp8Backend.grouped_gemm_swiglu_1x128_128x128`, what the step runs by default);
- fused: `grouped_gemm_swiglu_1x128_128x128` with the backend's `grouped_swiglu_epilogue` on: one kernel storing gu
  and SwiGLU's FP8 output and scales from its epilogue.

Each cell is device time (CUDA-graph replays of `--iters` calls, median of five; the two take turns over `--repeats`
rounds, the order reversed every other round, and the median over rounds is printed). `bits` compares gu, a_fp8 and
a's scales of the two, all three bit for bit.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXPERTS, ROWS, HIDDEN, FFN = 64, 131_072, 2048, 1024


def routings(busy: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows per expert of the two routings measured (labels to counts)."""
    from benchmarks.grouped_wgrad_walk import HEAVY_ROWS, collapsed_counts
    return {"64 busy, equal rows": torch.full((EXPERTS,), ROWS // EXPERTS, dtype=torch.long),
            f"{busy} busy, one with {HEAVY_ROWS:,} rows": collapsed_counts(busy, seed)}


def gpu_table(busy: int, iters: int, seed: int, repeats: int) -> str:
    from benchmarks.grouped_gemm import graphed_ms
    from megafp8.precision import E4M3, quantize as ref
    from megafp8.precision.backends import QuantizedWeight, select_backend
    from megafp8.precision.backends.reference import Fp8Backend
    from megafp8.precision.grouped import expert_rows
    device = torch.device("cuda")
    fused = select_backend("hopper", device)
    fused.grouped_swiglu_epilogue = True  # (this instance only)
    if fused.grouped_kernel != "ws":
        return f"(the hopper backend runs the {fused.grouped_kernel!r} grouped kernel here: no SwiGLU epilogue)"
    g = torch.Generator(device=device).manual_seed(1)
    w_fp8, w_scale = [], []
    for _ in range(EXPERTS):
        q, s = ref.quantize_128x128(torch.randn(2 * FFN, HIDDEN, generator=g, device=device).bfloat16() * 0.02,
                                    E4M3)
        w_fp8.append(q)
        w_scale.append(s)
    w = QuantizedWeight(torch.stack(w_fp8), torch.stack(w_scale), None, None)
    del w_fp8, w_scale
    lines = ["| routing | separate ms | fused ms | fused / separate | saved ms | bits |", "|---|---|---|---|---|---|"]
    for label, counts in routings(busy, seed).items():
        rows = expert_rows(counts.to(device), device, rows=ROWS)
        x = torch.randn(rows.total, HIDDEN, generator=g, device=device).bfloat16()
        a, a_s = ref.quantize_1x128(x, E4M3)
        del x
        runs = {"separate": lambda: Fp8Backend.grouped_gemm_swiglu_1x128_128x128(  # noqa: B023
                    fused, a, a_s, w, rows, torch.bfloat16, E4M3, False),  # noqa: B023
                "fused": lambda: fused.grouped_gemm_swiglu_1x128_128x128(  # noqa: B023
                    a, a_s, w, rows, torch.bfloat16, E4M3, False)}  # noqa: B023
        outs = {name: run() for name, run in runs.items()}
        same = all(torch.equal(p.contiguous().view(torch.uint8), q.contiguous().view(torch.uint8))
                   for p, q in zip(outs["separate"], outs["fused"]))
        del outs
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(repeats):
            for name in (("separate", "fused") if r % 2 == 0 else ("fused", "separate")):
                times[name].append(graphed_ms(runs[name], iters))
        sep, fus = (statistics.median(times[n]) for n in ("separate", "fused"))
        lines.append(f"| {label} | {sep:.3f} | {fus:.3f} | {fus / sep:.3f} | {sep - fus:.3f} | "
                     f"{'equal' if same else 'DIFFERENT'} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="calls per CUDA graph replay")
    parser.add_argument("--repeats", type=int, default=4, help="rounds of the two, in turn, the order reversed every "
                        "other round; each cell is the median of its rounds")
    parser.add_argument("--busy", type=int, default=13, help="experts with rows in the collapsed routing")
    parser.add_argument("--seed", type=int, default=0, help="the draw of the collapsed routing's busy experts")
    args = parser.parse_args(argv)
    if not 1 <= args.busy <= EXPERTS:
        parser.error(f"--busy {args.busy}: give 1 to {EXPERTS}")
    if args.repeats < 1 or args.iters < 1:
        parser.error("--repeats and --iters: give at least 1")
    if not torch.cuda.is_available():
        print("no CUDA GPU here: this benchmark needs an SM90 GPU (the warp-specialized kernel)")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.iters} calls a replay, "
          f"{args.repeats} rounds\n")
    print(gpu_table(args.busy, args.iters, args.seed, args.repeats))


if __name__ == "__main__":
    main()
