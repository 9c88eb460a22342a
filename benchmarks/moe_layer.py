#!/usr/bin/env python
"""Forward+backward time of one MoE layer (router, dispatch, routed experts, combine, shared expert), FP8 vs BF16.

Default shape (issue 6): 64 experts, top-8, hidden 2048, expert FFN 1024, one shared expert,
16k tokens, one GPU (EP=1: dispatch is a local sort, no all-to-all). The router's weights are
random, so loads are uneven the way an untrained router's are. Expert weights' FP8 copies are
quantized every iteration (one micro-batch per optimizer step). Timings: CUDA-event median
(triton.testing.do_bench).

Usage: python benchmarks/moe_layer.py [--tokens 16384] [--experts 64] [--top-k 8] [--hidden 2048] [--ffn 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config import ModelConfig, MoeConfig  # noqa: E402
from megafp8.model import init_weights  # noqa: E402
from megafp8.model.moe import MoE  # noqa: E402
from megafp8.parallel import ExpertParallel, TensorParallel  # noqa: E402
from megafp8.precision import PrecisionRecipe  # noqa: E402


def time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench(cfg: ModelConfig, tokens: int, recipe: str, profile: bool = False) -> tuple[float, list[int]]:
    moe = MoE(cfg.moe, cfg.hidden_size, PrecisionRecipe.from_name(recipe), TensorParallel.single(),
              ExpertParallel.single(), device="cuda")
    init_weights(moe, cfg, seed=0)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)

    def step():
        y, _ = moe(x, batch=1, seq_len=tokens)
        y.backward(dy)
        for p in moe.parameters():  # as the optimizer step would: fresh weights, fresh FP8 copies
            p.grad = None
            torch.autograd.graph.increment_version(p)

    ms = time_ms(step)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"{recipe}: top CUDA kernels of one iteration")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
    moe.router.load.zero_()
    with torch.no_grad():
        moe(x, batch=1, seq_len=tokens)
    return ms, moe.router.load.int().tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--profile", action="store_true", help="also print the top CUDA kernels of one iteration")
    args = parser.parse_args()
    groups = 8 if args.experts % 8 == 0 else 1  # DeepSeek-V3's group-limited routing: 4 of 8 groups
    cfg = ModelConfig(hidden_size=args.hidden, num_heads=16,
                      moe=MoeConfig(num_experts=args.experts, top_k=args.top_k, ffn_hidden_size=args.ffn,
                                    num_shared_experts=1, first_dense_layers=0, n_group=groups,
                                    topk_group=max(1, groups // 2)))
    # Expert GEMM FLOPs: 3 weight matrices of hidden x ffn per active expert (top-k + shared), 2 FLOPs per
    # multiply-add, x3 for forward + backward.
    flops = 6.0 * args.tokens * (args.top_k + 1) * 3 * args.hidden * args.ffn
    results = {}
    for recipe in ("bf16", "fp8"):
        results[recipe], load = bench(cfg, args.tokens, recipe, args.profile)
    print(f"MoE layer: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, expert FFN {args.ffn}, "
          f"1 shared expert, {args.tokens} tokens; tokens per expert min {min(load)} max {max(load)}\n")
    print("| recipe | fwd+bwd ms | expert TFLOP/s | vs BF16 |\n|---|---|---|---|")
    for recipe, ms in results.items():
        print(f"| {recipe} | {ms:.3f} | {flops / ms / 1e9:.0f} | {results['bf16'] / ms:.2f}x |")


if __name__ == "__main__":
    main()
