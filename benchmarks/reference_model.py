#!/usr/bin/env python
"""The yardstick for issue 10: a plain PyTorch Llama-style model of the ~1B shape, BF16 or torchao float8.

    PYTHONPATH=. python benchmarks/reference_model.py --recipes bf16 torchao-tensorwise torchao-rowwise --compile
    PYTHONPATH=. python benchmarks/reference_model.py --device cpu --layers 2 --hidden 256 --ffn 512 --heads 4 \
        --vocab 512 --seq 128 --batch 2 --steps 3 --recipes bf16       # a CPU smoke test

What a torchtitan-style single-GPU run does, with nothing of megafp8 in it: `nn.Linear` projections (q, k, v, o,
SwiGLU w1/w3/w2; no bias), `F.rms_norm`, RoPE, `F.scaled_dot_product_attention` (causal), an untied LM head,
FP32 parameters under `torch.autocast(bfloat16)`, fused AdamW, `torch.compile` per block when `--compile`.
The torchao recipes swap every block linear (not the LM head, as torchtitan does) with
`torchao.float8.convert_to_float8_training` (`tensorwise`, `rowwise`, `rowwise_with_gw_hp`) or
`torchao.prototype.blockwise_fp8_training` (`blockwise`: 1x128 activations, 128x128 weights, our recipe).
Tokens are random (speed only). Timing: CUDA events over `--steps` after `--warmup`; prints a Markdown table.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.ffn_norm = nn.Parameter(torch.ones(hidden))
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = F.rms_norm(x, (h,), self.attn_norm)
        q, k, v = (proj(y).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.wo(attn)
        y = F.rms_norm(x, (h,), self.ffn_norm)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Llama(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, ffn: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.head = nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        freqs = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(F.rms_norm(x, (x.shape[-1],), self.norm))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def apply_recipe(model: Llama, recipe: str) -> None:
    """Swap the block linears for torchao's float8 ones (the LM head stays BF16)."""
    if recipe == "bf16":
        return
    if recipe == "torchao-blockwise":
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        for block in model.blocks:
            for name, child in list(block.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(block, name, Float8BlockwiseLinear.from_float(child))
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe.removeprefix("torchao-"))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn.startswith("blocks."))


def bench(recipe: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = Llama(args.vocab, args.hidden, args.layers, args.heads, args.ffn, args.seq).to(device)
    apply_recipe(model, recipe)
    if args.compile:
        for block in model.blocks:
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for step in range(args.warmup + args.steps):
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    gemm_params = sum(p.numel() for p in model.parameters() if p.dim() == 2) - model.embed.weight.numel()
    flops_per_token = 6 * gemm_params + 6 * args.layers * args.seq * args.hidden  # + causal attention
    return {"recipe": recipe + (" (compiled)" if args.compile else ""), "step_s": step_s,
            "tokens_per_s": args.batch * args.seq / step_s,
            "tflops": args.batch * args.seq / step_s * flops_per_token / 1e12,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan,
            "loss": float(loss.detach())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["bf16", "torchao-tensorwise", "torchao-rowwise"],
                        choices=["bf16", "torchao-tensorwise", "torchao-rowwise", "torchao-rowwise_with_gw_hp",
                                 "torchao-blockwise"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    print("| model | recipe | step (s) | tokens/s | TFLOP/s | peak GiB | final loss |")
    print("|---|---|---|---|---|---|---|")
    for recipe in args.recipes:
        try:
            r = bench(recipe, args)
        except Exception as err:  # a recipe that cannot run here (no torchao, no SM90) is one row, not a crash
            print(f"| plain PyTorch | {recipe} | failed: {type(err).__name__}: {str(err)[:200]} | | | | |", flush=True)
            continue
        print(f"| plain PyTorch | {r['recipe']} | {r['step_s']:.4f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
              f"{r['peak_gib']:.2f} | {r['loss']:.4f} |", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
