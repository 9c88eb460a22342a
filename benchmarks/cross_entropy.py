#!/usr/bin/env python
"""The loss's forward + backward: `F.cross_entropy(logits.float())` (what the head ran before) against
`megafp8.parallel.cross_entropy` (two Triton kernels, no FP32 copy), on BF16 logits; then the kernels' block sizes.

    PYTHONPATH=. python benchmarks/cross_entropy.py [--iters 20] [--shapes 16384x32768 ...]

First the numbers: the mean loss of both and the largest gradient difference in BF16 steps. Then ms of eager
forward + backward (the head runs eagerly), GB/s counted as the logits read twice and their gradient written once
(what the kernels move), and the memory the loss adds while it runs (peak above the logits and targets). The
variants table times each kernel alone (eager, back to back) at other block sizes and warp counts.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.parallel import IGNORE_INDEX, vocab_parallel_cross_entropy  # noqa: E402
from megafp8.parallel import cross_entropy_kernels as kernels  # noqa: E402
# benchmarks/, beside this file
from fused_quantize import timed_ms  # noqa: E402

SHAPES = ["16384x32768", "16384x16384", "16384x129280", "8192x50304"]  # tokens x vocab (or a TP rank's columns)


def torch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)


def forward_backward(loss_fn, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits.grad = None
    loss = loss_fn(logits, targets)
    loss.backward()
    return loss


def added_peak(loss_fn, logits, targets) -> float:
    """GiB the loss's forward + backward adds to what is allocated before it (the gradient included)."""
    forward_backward(loss_fn, logits, targets)
    logits.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    forward_backward(loss_fn, logits, targets)
    torch.cuda.synchronize()
    logits.grad = None
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    args = parser.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| tokens x vocab | loss: torch / ours | largest gradient difference (BF16 steps) | torch: ms, GB/s, "
          "added GiB | ours: ms, GB/s, added GiB | speed-up |\n|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    variants = []
    for shape in args.shapes:
        n, v = (int(x) for x in shape.split("x"))
        logits = (torch.randn(n, v, device="cuda", generator=g) * 2).bfloat16().requires_grad_(True)
        targets = torch.randint(0, v, (n,), device="cuda", generator=g)
        targets[::50] = IGNORE_INDEX
        ref = forward_backward(torch_loss, logits, targets).item()
        ref_grad = logits.grad.float()
        ours = forward_backward(vocab_parallel_cross_entropy, logits, targets).item()
        step = ref_grad.abs().clamp(min=1e-30) * 2 ** -8  # one BF16 step at each value
        worst = ((logits.grad.float() - ref_grad).abs() / step).max().item()
        del ref_grad
        moved = 3 * n * v * logits.element_size() / 1e9  # GB: the logits read twice, the gradient written once
        cells = []
        times = []
        for fn in (torch_loss, vocab_parallel_cross_entropy):
            ms = timed_ms(forward_backward, fn, logits, targets, iters=args.iters)
            times.append(ms)
            cells.append(f"{ms:.3f}, {moved / ms * 1e3:.0f}, {added_peak(fn, logits, targets):.2f}")
        print(f"| {shape} | {ref:.6f} / {ours:.6f} | {worst:.2f} | {cells[0]} | {cells[1]} | "
              f"{times[0] / times[1]:.2f}x |", flush=True)
        variants.append(_variants(logits.detach(), targets.clamp(min=0), args.iters))
        del logits
    print("\n| tokens x vocab | row pass: (block, warps) ms ... | gradient pass: (block, warps) ms ... |\n|---|---|---|")
    for shape, (stats, grads) in zip(args.shapes, variants):
        print(f"| {shape} | {stats} | {grads} |")


def _variants(logits: torch.Tensor, targets: torch.Tensor, iters: int) -> tuple[str, str]:
    n = logits.shape[0]
    lse = torch.zeros(n, device="cuda")
    dloss = torch.full((n,), 1.0 / n, device="cuda")
    kept = (kernels.STATS_BLOCK, kernels.STATS_WARPS, kernels.GRAD_BLOCK, kernels.GRAD_WARPS)
    stats, grads = [], []
    try:
        for block in (2048, 4096, 8192):
            for warps in (4, 8):
                kernels.STATS_BLOCK, kernels.STATS_WARPS = block, warps
                stats.append(f"({block}, {warps}) {timed_ms(kernels.row_stats, logits, targets, iters=iters):.3f}")
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                kernels.GRAD_BLOCK, kernels.GRAD_WARPS = block, warps
                ms = timed_ms(kernels.logits_grad, logits, lse, targets, dloss, iters=iters)
                grads.append(f"({block}, {warps}) {ms:.3f}")
    finally:
        kernels.STATS_BLOCK, kernels.STATS_WARPS, kernels.GRAD_BLOCK, kernels.GRAD_WARPS = kept
    return "; ".join(stats), "; ".join(grads)


if __name__ == "__main__":
    main()
