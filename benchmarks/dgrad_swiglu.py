#!/usr/bin/env python
"""The down projection's dgrad and SwiGLU's backward (issues 18 and 19): two steps against one.

    PYTHONPATH=. python benchmarks/dgrad_swiglu.py [--tokens 16384 --experts 64 --top-k 8 --hidden 2048 --ffn 1024]

The experts in the MoE step's padded expert layout (the layer's own `expert_rows`, tokens routed at random), then
the dense MLPs of the ~1B and 8B-layer shapes (16,384 tokens), per call, ms of device time replayed from CUDA
graphs (`fused_quantize.graphed_ms`):

- two steps (what the FP8 experts run by default): the hopper backend's grouped dgrad da = dy @ w_down in BF16,
  then `swiglu_backward_quantize(gu, da)` (SwiGLU's row and column kernels);
- the definition: the same with da in FP32 (`Fp8Backend.grouped_dgrad_swiglu_backward`'s composition);
- one step: `HopperBackend.grouped_dgrad_swiglu_backward` (dense: `dgrad_swiglu_backward`), SwiGLU's backward in
  the dgrad's epilogue (`megafp8.precision.kernels.ws_swiglu_dgrad`; `grouped.FUSE_SWIGLU_DGRAD`,
  `fp8_mlp.FUSE_SWIGLU_DGRAD`).

The one step's outputs are checked against the definition's: the share of FP8 bytes that differ and the largest
difference in FP8 ULPs, per output (the numerics contract allows one). Needs an SM90 GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.formats import E4M3  # noqa: E402

from fused_quantize import graphed_ms  # noqa: E402

DENSE = {"~1B": (2048, 5632), "8B-layers": (4096, 14336)}  # hidden, F
OUTPUTS = ("d(gu) rows", "d(gu) scales", "d(gu)^T", "d(gu)^T scales", "a^T", "a^T scales")


def fp8_ulps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    """The largest distance, in positions on the FP8 grid, between two FP8 tensors of the same shape."""
    def ordinal(q: torch.Tensor) -> torch.Tensor:
        code = q.view(torch.uint8).to(torch.int32)
        return torch.where(code & 0x80 != 0, -(code & 0x7F), code & 0x7F)
    return int((ordinal(got) - ordinal(want)).abs().max()) if got.numel() else 0


def compare(got: tuple, want: tuple) -> list[str]:
    """Per output: the share of differing bytes and, for the FP8 values, the largest distance in ULPs."""
    cells = []
    for name, a, b in zip(OUTPUTS, got, want):
        differ = (a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).float().mean().item()
        ulps = f", {fp8_ulps_apart(a, b)} ULP" if a.element_size() == 1 else ""
        cells.append(f"{name}: {100 * differ:.3f}% differ{ulps}")
    return cells


def timed_forms(two_steps, one_step, definition, iters: int) -> None:
    """The three forms' rows of the table, and the one step's agreement with the definition."""
    forms = {"two steps, da in BF16 (the default)": lambda: two_steps(torch.bfloat16),
             "two steps, da in FP32 (the definition)": lambda: two_steps(torch.float32),
             "one step, SwiGLU's backward in the dgrad's epilogue": one_step}
    for name, fn in forms.items():
        print(f"| {name} | {graphed_ms(fn, iters=iters):.3f} |")
    print("\none step against the definition: " + "; ".join(compare(one_step(), definition())) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=1024, help="each expert's FFN width F (gu is 2F wide)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    from megafp8.precision.backends import select_backend
    from megafp8.precision.backends.reference import Fp8Backend
    from megafp8.precision.expert_layout import expert_rows

    hopper = select_backend("hopper", device)
    g = torch.Generator(device=device).manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=g, device=device).bfloat16()  # noqa: E731
    chosen = torch.rand(args.tokens, args.experts, generator=g, device=device).topk(args.top_k, dim=1).indices
    counts = torch.bincount(chosen.flatten(), minlength=args.experts)
    rows = expert_rows(counts, device, rows=chosen.numel())
    weight = hopper.empty_weight(torch.Size((args.experts, args.hidden, args.ffn)), E4M3, device)
    hopper.quantize_weight_(randn(args.experts, args.hidden, args.ffn) * args.ffn ** -0.5, weight, E4M3, False)
    dy, dy_s = hopper.quantize_rows(randn(rows.total, args.hidden), E4M3, False)
    gu = randn(rows.total, 2 * args.ffn)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print(f"Experts: {rows.total} padded rows ({args.tokens} tokens x top-{args.top_k} of {args.experts}), hidden "
          f"{args.hidden}, F {args.ffn}\n\n| form | ms |\n|---|---|")
    timed_forms(
        lambda dtype: hopper.swiglu_backward_quantize(
            gu, hopper.grouped_gemm_1x128_128x128(dy, dy_s, weight, True, rows, dtype), E4M3, E4M3, False),
        lambda: hopper.grouped_dgrad_swiglu_backward(dy, dy_s, weight, True, rows, gu, E4M3, E4M3, False),
        lambda: Fp8Backend.grouped_dgrad_swiglu_backward(hopper, dy, dy_s, weight, True, rows, gu, E4M3, E4M3, False),
        args.iters)
    for name, (hidden, f) in DENSE.items():
        w = hopper.empty_weight(torch.Size((hidden, f)), E4M3, device)
        hopper.quantize_weight_(randn(hidden, f) * f ** -0.5, w, E4M3, False)
        dy, dy_s = hopper.quantize_rows(randn(args.tokens, hidden), E4M3, False)
        gu = randn(args.tokens, 2 * f)
        print(f"Dense, {name}: {args.tokens} tokens, hidden {hidden}, F {f}\n\n| form | ms |\n|---|---|")
        timed_forms(
            lambda dtype: hopper.swiglu_backward_quantize(
                gu, hopper.gemm_1x128_128x128(dy, dy_s, w.wt_fp8, w.wt_scale, dtype), E4M3, E4M3, False),
            lambda: hopper.dgrad_swiglu_backward(dy, dy_s, w.wt_fp8, w.wt_scale, gu, E4M3, E4M3, False),
            lambda: Fp8Backend.dgrad_swiglu_backward(hopper, dy, dy_s, w.wt_fp8, w.wt_scale, gu, E4M3, E4M3, False),
            args.iters)


if __name__ == "__main__":
    main()
