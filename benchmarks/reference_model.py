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

`--experts N` makes it the MoE yardstick, torchtitan's DeepSeek-V3 MoE in plain PyTorch: after `--first-dense`
dense blocks each block's MLP is an FP32 sigmoid router choosing `--top-k` of N experts (group-limited:
`--groups`, `--topk-groups`), the chosen rows permuted into experts' groups padded to 8 rows (16 under torchao's
FP8, which needs it), the experts' SwiGLU (`--expert-ffn` wide) as `torch._grouped_mm` over stacked weights, the
rows weighted and added back to their tokens, plus `--shared-experts` dense SwiGLU experts. The rowwise torchao
recipes also put the experts' grouped GEMMs through `torchao.prototype.moe_training` (`Float8TrainingOpConfig`: rowwise
FP8 `torch._scaled_grouped_mm`, its only FP8 recipe on SM90; torchao has no blockwise grouped GEMM, so
`torchao-blockwise` keeps BF16 experts). torchao 0.17's tests skip its FP8 experts compiled (pytorch/ao#4048):
with `--compile` their grouped GEMMs run eagerly inside the compiled blocks. The MoE shape of
`benchmarks/train_step.py --model moe`:

    PYTHONPATH=. python benchmarks/reference_model.py --compile --layers 8 --experts 64 --top-k 8 --expert-ffn 1024 \
        --shared-experts 1 --first-dense 1 --groups 8 --topk-groups 4 --recipes bf16 torchao-rowwise
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(y)) * self.w3(y))


class GroupedExperts(nn.Module):
    """The routed experts' stacked SwiGLU weights, (experts, out, in) as torchtitan keeps them, run as
    `torch._grouped_mm` over rows grouped by expert (torchao's FP8 wraps these three parameters)."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        def gmm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            # the cast is autocast's for a linear's weight; torchao's wrapper keeps its class through it
            return torch._grouped_mm(a, w.to(torch.bfloat16).transpose(-2, -1), offs=offs)

        return gmm(F.silu(gmm(x, self.w1)) * gmm(x, self.w3), self.w2)


class MoE(nn.Module):
    """DeepSeek-V3's MoE as torchtitan writes it: an FP32 sigmoid router with group-limited top-k and a selection
    bias (aux-loss-free balancing; the bias stays zero here, speed only), the chosen rows permuted into experts'
    groups padded to `align` rows, the grouped experts, the rows weighted by their normalized scores and added
    back to their tokens, plus the shared experts."""

    def __init__(self, hidden: int, experts: int, top_k: int, ffn: int, shared: int, groups: int,
                 topk_groups: int) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.groups, self.topk_groups = experts, top_k, groups, topk_groups
        self.router = nn.Parameter(torch.empty(experts, hidden))
        self.register_buffer("expert_bias", torch.zeros(experts), persistent=False)
        self.experts = GroupedExperts(experts, hidden, ffn)
        self.shared = SwiGLU(hidden, ffn * shared) if shared else None
        self.align = 8  # torchtitan's group alignment for BF16; 16 for FP8 (`apply_recipe`)
        self.load: Optional[torch.Tensor] = None  # the last forward's rows per expert

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> the chosen experts (T, top_k) and their combine weights (T, top_k), in FP32."""
        with torch.autocast(x.device.type, enabled=False):
            scores = torch.sigmoid(F.linear(x.float(), self.router))
        choice = scores.detach() + self.expert_bias
        if self.groups > 1:
            grouped = choice.view(choice.shape[0], self.groups, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_groups, dim=-1).indices
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        return chosen, weights / weights.sum(-1, keepdim=True)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        shape = y.shape
        x = y.reshape(-1, shape[-1]).to(torch.bfloat16)
        chosen, weights = self.route(x)
        ids = chosen.flatten()
        experts, rows = self.num_experts, ids.numel()
        counts = torch.zeros(experts, dtype=ids.dtype, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
        self.load = counts.detach()
        padded = (counts + self.align - 1) // self.align * self.align
        ends = padded.cumsum(0)
        order = torch.argsort(ids, stable=True)  # the rows by expert
        sorted_ids = ids[order]
        rank = torch.arange(rows, device=ids.device) - (counts.cumsum(0) - counts)[sorted_ids]
        dest = (ends - padded)[sorted_ids] + rank  # each sorted row's place in the padded layout
        token = order // self.top_k
        # a static row count (no host sync): every group padded, the padding rows zero
        grouped = x.new_zeros(rows + experts * (self.align - 1), x.shape[1]).index_copy(0, dest, x[token])
        out = self.experts(grouped, ends.to(torch.int32))[dest] * weights.flatten()[order].unsqueeze(1).to(x.dtype)
        combined = torch.zeros_like(x).index_add(0, token, out)
        if self.shared is not None:
            combined = combined + self.shared(x)
        return combined.view(shape)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: nn.Module) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.ffn_norm = nn.Parameter(torch.ones(hidden))
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = F.rms_norm(x, (h,), self.attn_norm)
        q, k, v = (proj(y).view(b, t, self.heads, -1).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.wo(attn)
        return x + self.mlp(F.rms_norm(x, (h,), self.ffn_norm))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Llama(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, ffn: int, seq: int,
                 moe: Optional[dict] = None, first_dense: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            Block(hidden, heads, MoE(hidden, **moe) if moe and i >= first_dense else SwiGLU(hidden, ffn))
            for i in range(layers))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.head = nn.Linear(hidden, vocab, bias=False)
        head_dim = hidden // heads
        freqs = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(F.rms_norm(x, (x.shape[-1],), self.norm))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def apply_recipe(model: Llama, recipe: str) -> None:
    """Swap the block linears for torchao's float8 ones (the LM head and the MoE router stay as they are) and, for
    the rowwise recipes, the routed experts' weights for torchao's FP8 grouped-GEMM wrappers."""
    if recipe == "bf16":
        return
    if recipe == "torchao-blockwise":
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

        for block in model.blocks:
            for parent in list(block.modules()):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, Float8BlockwiseLinear.from_float(child))
        return
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe.removeprefix("torchao-"))
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn.startswith("blocks."))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if moes and recipe.startswith("torchao-rowwise"):
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization.quant_api import quantize_

        quantize_(model, config=Float8TrainingOpConfig(),
                  filter_fn=lambda mod, fqn: isinstance(mod, GroupedExperts))
        for moe in moes:
            moe.align = 16  # `torch._scaled_grouped_mm`'s groups
            # torchao's FP8 grouped GEMMs do not trace (pytorch/ao#4048): eager inside the compiled blocks
            moe.experts.forward = torch.compiler.disable(moe.experts.forward)


def bench(recipe: str, args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    moe = (dict(experts=args.experts, top_k=args.top_k, ffn=args.expert_ffn, shared=args.shared_experts,
                groups=args.groups, topk_groups=args.topk_groups) if args.experts else None)
    model = Llama(args.vocab, args.hidden, args.layers, args.heads, args.ffn, args.seq, moe,
                  args.first_dense).to(device)
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
    # the GEMMs' parameters a token passes through: the routed experts' top_k of every `experts`
    expert_params = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    gemm_params = (sum(p.numel() for p in model.parameters() if p.dim() == 2) - model.embed.weight.numel()
                   + (expert_params * args.top_k // args.experts if args.experts else 0))
    flops_per_token = 6 * gemm_params + 6 * args.layers * args.seq * args.hidden  # + causal attention
    return {"recipe": recipe + (" (compiled)" if args.compile else ""), "step_s": step_s, "load": expert_load(model),
            "tokens_per_s": args.batch * args.seq / step_s,
            "tflops": args.batch * args.seq / step_s * flops_per_token / 1e12,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan,
            "loss": float(loss.detach())}


def expert_load(model: Llama) -> str:
    """The last step's routing over the MoE blocks: the rows per expert's coefficient of variation and busiest /
    mean (the worst block's), and the share of experts without rows; "-" for a dense model."""
    loads = [m.load.double() for m in model.modules() if isinstance(m, MoE) and m.load is not None]
    if not loads:
        return "-"
    cv = max(float(load.std(unbiased=False) / load.mean()) for load in loads)
    busiest = max(float(load.max() / load.mean()) for load in loads)
    idle = sum(int((load == 0).sum()) for load in loads) / sum(load.numel() for load in loads)
    return f"{cv:.2f}, {busiest:.2f}x, {idle:.0%}"


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
    parser.add_argument("--experts", type=int, default=0, help="routed experts of each MoE block (0: dense)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--expert-ffn", type=int, default=1024)
    parser.add_argument("--shared-experts", type=int, default=1)
    parser.add_argument("--first-dense", type=int, default=1, help="blocks before the first MoE block")
    parser.add_argument("--groups", type=int, default=1, help="expert groups of the group-limited routing")
    parser.add_argument("--topk-groups", type=int, default=1, help="groups a token's experts come from")
    args = parser.parse_args(argv)
    if args.experts and (args.experts % args.groups or args.top_k > args.experts * args.topk_groups // args.groups):
        parser.error("--experts must split into --groups, and --topk-groups of them must hold --top-k experts")
    model_name = "plain PyTorch MoE" if args.experts else "plain PyTorch"
    print("| model | recipe | step (s) | tokens/s | TFLOP/s | peak GiB | final loss | expert load (cv, busiest / mean, "
          "idle) |")
    print("|---|---|---|---|---|---|---|---|")
    for recipe in args.recipes:
        try:
            r = bench(recipe, args)
        except Exception as err:  # a recipe that cannot run here (no torchao, no SM90) is one row, not a crash
            print(f"| {model_name} | {recipe} | failed: {type(err).__name__}: {str(err)[:200]} | | | | | |",
                  flush=True)
            continue
        print(f"| {model_name} | {r['recipe']} | {r['step_s']:.4f} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
              f"{r['peak_gib']:.2f} | {r['loss']:.4f} | {r['load']} |", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
