#!/usr/bin/env python
"""The MoE router's group-limited top-k (`megafp8.parallel.routing`): the Triton kernel against its pure-torch twin
(three `torch.topk` calls and the masking between them), eagerly and compiled, on the MoE benchmark's routing
(64 experts in 8 groups, 4 groups kept, top-8) and DeepSeek-V3's (256 experts, 8 groups, 4 kept, top-8).

    PYTHONPATH=. python benchmarks/routing.py [--tokens 16384] [--iters 50]

Prints ms per call (device time under a CUDA graph) and the tokens whose chosen experts differ between the two;
where scores tie, `torch.topk` may order equal experts otherwise than the kernel (which takes the lower index), so
those tokens' chosen scores are compared too ("ties only": the same scores, best first).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.parallel.routing import group_limited_topk, group_limited_topk_reference  # noqa: E402
from fused_quantize import graphed_ms  # noqa: E402  (benchmarks/, beside this file)

SHAPES = {"moe benchmark": (64, 8, 4, 8), "DeepSeek-V3": (256, 8, 4, 8)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/routing.py times CUDA kernels: run it on a GPU machine")
    print("| routing | tokens | twin ms | twin compiled ms | kernel ms | tokens choosing otherwise |")
    print("|---|---|---|---|---|---|")
    for name, (e, n_group, topk_group, top_k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        choice = torch.randn(args.tokens, e, device="cuda", generator=g).sigmoid()
        twin = lambda c: group_limited_topk_reference(c, n_group, topk_group, top_k)  # noqa: E731
        kernel = lambda c: group_limited_topk(c, n_group, topk_group, top_k)  # noqa: E731
        compiled = torch.compile(twin)
        compiled(choice)
        ms = [graphed_ms(f, choice, iters=args.iters) for f in (twin, compiled, kernel)]
        print(f"| {name} ({e} experts) | {args.tokens} | {ms[0]:.4f} | {ms[1]:.4f} | {ms[2]:.4f} | "
              f"{differing(choice, kernel(choice), twin(choice))} |")


def differing(choice: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> str:
    """How many tokens choose other experts, and whether their chosen scores are the same all the same."""
    rows = (got != want).any(dim=1)
    if not rows.any():
        return "0"
    same_scores = torch.equal(choice[rows].gather(1, got[rows]), choice[rows].gather(1, want[rows]))
    return f"{int(rows.sum())} ({'ties only' if same_scores else 'not only ties'})"


if __name__ == "__main__":
    main()
