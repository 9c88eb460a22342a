#!/usr/bin/env python
"""The attention core alone: SDPA's backends on our models' shapes, forward + backward (`model.attention_backend`).

    PYTHONPATH=. python benchmarks/attention.py [--iters 20] [--backends cudnn flash efficient]

Shapes (causal, BF16, the layout our attention hands SDPA: (B, T, heads, dim) memory seen as (B, heads, T, dim)):
the ~1B model (8 x 2048 tokens, 16 heads of 128), the 8B-layer shape (4 x 4096, 32 heads of 128), and DeepSeek-V3's
MLA at 16 heads a rank (1 x 4096, query/key width 192, value width 128). Each backend is timed alone (forward,
then forward + backward with a random output gradient) and checked first against FP32 math on the same BF16
inputs: the relative Frobenius error of the output and of dq, dk and dv ("n/a" where the backend cannot take the
shape). TFLOP/s count the causal half of the scores: forward 2 B heads T^2 (d_qk + d_v) / 2, backward 2.5x that.
`torch` is torch's own order (no preference set), `auto` what `model.attention_backend: auto` runs on this GPU.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grouped_gemm import timed_ms  # noqa: E402  (benchmarks/, beside this file)
from megafp8.model.sdpa import Backends, attention_kernels, sdpa_backends, sdpa_backends_for  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """One attention call: batch x seq tokens, `heads` query (and key/value) heads of widths d_qk and d_v."""

    name: str
    batch: int
    seq: int
    heads: int
    d_qk: int
    d_v: int

    def flops(self) -> float:
        return 2 * self.batch * self.heads * self.seq ** 2 * (self.d_qk + self.d_v) / 2


SHAPES = [Shape("1b", 8, 2048, 16, 128, 128), Shape("8b-layers", 4, 4096, 32, 128, 128),
          Shape("mla (V3, 16 heads)", 1, 4096, 16, 192, 128)]


def inputs(s: Shape, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q, k, v as our modules pass them: (B, T, heads, dim) tensors transposed to (B, heads, T, dim) views."""
    g = torch.Generator(device=device).manual_seed(0)

    def make(dim: int) -> torch.Tensor:
        t = torch.randn(s.batch, s.seq, s.heads, dim, device=device, dtype=torch.bfloat16, generator=g)
        return t.transpose(1, 2).requires_grad_()
    return make(s.d_qk), make(s.d_qk), make(s.d_v)


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: Optional[torch.Tensor],
        backends: Backends) -> tuple[torch.Tensor, ...]:
    with attention_kernels(backends):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if dout is None:
        return (out,)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backends", nargs="+", default=["cudnn", "flash", "efficient"])
    args = parser.parse_args()
    device = torch.device("cuda")
    auto = sdpa_backends_for("auto", device)
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; auto = {[b.name for b in auto] if auto else 'torch order'}\n")
    print("| shape | backend | forward ms | TFLOP/s | fwd + bwd ms | TFLOP/s | err out | err dq | err dk | err dv |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in SHAPES:
        q, k, v = inputs(s, device)
        dout = torch.randn(s.batch, s.seq, s.heads, s.d_v, device=device, dtype=torch.bfloat16).transpose(1, 2)
        want = run(*(t.detach().float().requires_grad_() for t in (q, k, v)), dout.float(),
                   sdpa_backends("math", "cuda", None))
        for name in [*args.backends, "torch", "auto"]:
            backends = auto if name == "auto" else sdpa_backends(name, "cuda", None)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = run(q, k, v, dout, backends)
            except RuntimeError as err:
                print(f"| {s.name} | {name} | n/a ({str(err).splitlines()[0][:60]}) | | | | | | | |")
                continue
            errs = " | ".join(f"{rel_err(g, w):.2e}" for g, w in zip(got, want))
            fwd = timed_ms(lambda: run(q, k, v, None, backends)[0], device, args.iters)
            both = timed_ms(lambda: run(q, k, v, dout, backends)[1], device, args.iters)
            print(f"| {s.name} | {name} | {fwd:.3f} | {s.flops() / fwd / 1e9:.0f} | {both:.3f} | "
                  f"{3.5 * s.flops() / both / 1e9:.0f} | {errs} |")


if __name__ == "__main__":
    main()
