#!/usr/bin/env python
"""A dense layer's weight-gradient GEMM (issue 18): dw (N, K) = dy^T @ x over the tokens, added into FP32 main_grad.

    PYTHONPATH=. python benchmarks/wgrad_gemm.py [--model 1b 8b-layers] [--tokens 16384] [--iters 30] [--bf16-only]

The shapes are each model's linears (QKV, attention output, gate/up, down) at `--tokens` tokens per micro-batch.
Operands are quantized beforehand as the FP8 linear quantizes them (dy^T and x^T in 1x128 tiles along the tokens);
the timed call is the GEMM, alone and with the FP32 accumulation a micro-batch does:

- BF16 `mm`: dy^T @ x in BF16; "+ add" adds it into an FP32 main_grad (the BF16 recipe's wgrad until the
  fifteenth session); "into main_grad": one GEMM adding its FP32 product into main_grad
  (`megafp8.precision.bf16_linear.accumulate_product_`, the BF16 recipe's wgrad now). `--bf16-only`: these alone.
- cuBLAS FP8: `F.scaled_mm` with 1x128 x 1x128 scaling (the cublas backend's wgrad), BF16 out; "+ add" as above.
- cuBLASLt into main_grad: the same GEMM called through `megafp8.precision.kernels.cublaslt`, adding its FP32
  product into main_grad in the epilogue (the cublas backend's wgrad since the tenth session), with the
  heuristic's first algorithm and with the fastest of the algorithms it offers (timed; `[index/count]`).
- ours, warp-specialized: `megafp8.precision.kernels.gemm.wgrad`, 128- and 256-wide tiles, BF16 out, and
  accumulating into main_grad in its epilogue (no BF16 copy, no add pass).

TFLOP/s count 2 N K tokens per GEMM. Every output is checked first (relative Frobenius error above 1/64 prints
"wrong"): the FP8 columns against the FP32 product of the dequantized operands, the BF16 ones against the FP32
product of the BF16 operands.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.precision.backends import select_backend  # noqa: E402
from megafp8.precision.formats import E4M3  # noqa: E402
from megafp8.precision.quantize import mn_major  # noqa: E402
from grouped_gemm import timed_ms  # noqa: E402  (benchmarks/, beside this file)

LINEARS = {  # (name, N = output features, K = input features)
    "1b": [("qkv", 6144, 2048), ("out", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)],
    "8b-layers": [("qkv", 12288, 4096), ("out", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
WRONG = 2**-6


def columns(dy: torch.Tensor, x: torch.Tensor,
            bf16_only: bool = False) -> dict[str, tuple[Callable[[], object], Callable[[], torch.Tensor]]]:
    """name -> (timed call, its result as dw in FP32) for one shape."""
    from megafp8.precision.bf16_linear import accumulate_product_
    main_grad = torch.zeros(dy.shape[1], x.shape[1], dtype=torch.float32, device=dy.device)

    def accumulated(run: Callable[[], object]) -> Callable[[], torch.Tensor]:
        return accumulated_result(main_grad, run)

    def bf16_into():
        accumulate_product_(main_grad, dy.t(), x)

    cols = {
        "BF16 mm": (lambda: dy.t() @ x, lambda: (dy.t() @ x).float()),
        "BF16 mm + add": (lambda: main_grad.add_(dy.t() @ x), accumulated(lambda: main_grad.add_(dy.t() @ x))),
        "BF16 into main_grad": (bf16_into, accumulated(bf16_into)),
    }
    if bf16_only:
        return cols
    from megafp8.precision.kernels import gemm
    cublas = select_backend("cublas", dy.device)
    _, _, dyt, dyt_s = cublas.quantize_rows_cols(dy, E4M3, False)
    _, _, xt, xt_s = cublas.quantize_rows_cols(x, E4M3, False)
    bw1 = F.ScalingType.BlockWise1x128

    def cublas_dw():
        return F.scaled_mm(dyt, xt.t(), mn_major(dyt_s), bw1, mn_major(xt_s), bw1, output_dtype=torch.bfloat16)

    cols.update({
        "cuBLAS FP8": (cublas_dw, lambda: cublas_dw().float()),
        "cuBLAS FP8 + add": (lambda: main_grad.add_(cublas_dw()), accumulated(lambda: main_grad.add_(cublas_dw()))),
    })
    cols.update(cublaslt_columns(dyt, dyt_s, xt, xt_s, main_grad, accumulated))
    for block_n in (128, 256):
        def bf16_out(block_n=block_n):
            return gemm.wgrad(dyt, dyt_s, xt, xt_s, torch.bfloat16, block_n=block_n)

        def into_main_grad(block_n=block_n):
            return gemm.wgrad(dyt, dyt_s, xt, xt_s, torch.bfloat16, accumulate=main_grad, block_n=block_n)
        cols[f"ours {block_n}"] = (bf16_out, lambda f=bf16_out: f().float())
        cols[f"ours {block_n}, into main_grad"] = (into_main_grad, accumulated(into_main_grad))
    return cols


def accumulated_result(main_grad: torch.Tensor, run: Callable[[], object]) -> Callable[[], torch.Tensor]:
    """A call giving what `run` adds into `main_grad` alone: main_grad zeroed, `run`, a copy of main_grad."""
    def result():
        main_grad.zero_()
        run()
        return main_grad.clone()
    return result


def cublaslt_columns(dyt, dyt_s, xt, xt_s, main_grad, accumulated) -> dict:
    """cuBLASLt adding into main_grad in its epilogue (`megafp8.precision.kernels.cublaslt`): the heuristic's first
    algorithm (what the cublas backend runs), and the fastest of those the heuristic offers (timed here)."""
    from megafp8.precision.kernels import cublaslt
    if cublaslt.cached_unavailable_reason(dyt.device) is not None:
        return {}

    def into(choice=None):
        return cublaslt.gemm_accumulate_(main_grad, dyt, mn_major(dyt_s), xt, mn_major(xt_s), algorithm=choice)
    try:
        count = cublaslt.algorithm_count(main_grad, dyt, mn_major(dyt_s), xt, mn_major(xt_s))
        times = [timed_ms(lambda i=i: into(i), dyt.device, 10) for i in range(count)]
    except Exception as exc:  # noqa: BLE001 - the column says why cuBLASLt did not run
        def failed(exc=exc):
            raise exc
        return {"cuBLASLt into main_grad": (failed, failed)}
    best = min(range(count), key=times.__getitem__)
    return {"cuBLASLt into main_grad": (into, accumulated(into)),
            "cuBLASLt into main_grad, fastest of the heuristic's (index/count)": (
                lambda: into(best), accumulated(lambda: into(best)), f"{best}/{count}")}


def reference(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The FP32 product of the dequantized 1x128 operands (the reference quantizer)."""
    from megafp8.precision import quantize as ref
    dyt, dyt_s = ref.quantize_1x128(dy.t().contiguous(), E4M3)
    xt, xt_s = ref.quantize_1x128(x.t().contiguous(), E4M3)
    return ref.dequantize_1x128(dyt, dyt_s) @ ref.dequantize_1x128(xt, xt_s).t()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", default=list(LINEARS), choices=list(LINEARS))
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--bf16-only", action="store_true", help="only the BF16 columns")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (SM90 for the cuBLAS and warp-specialized columns)")
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens, TFLOP/s "
          f"(ms in brackets)\n")
    header = None
    g = torch.Generator(device="cuda").manual_seed(0)
    for model in args.model:
        for name, n, k in LINEARS[model]:
            dy = (torch.randn(args.tokens, n, device="cuda", generator=g) * 1e-3).bfloat16()
            x = torch.randn(args.tokens, k, device="cuda", generator=g).bfloat16()
            want_bf16 = dy.float().t() @ x.float()
            want_fp8 = None if args.bf16_only else reference(dy, x)
            cols = columns(dy, x, args.bf16_only)
            if header is None:
                header = ["model", "linear (N x K)", *cols]
                print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
            cells = []
            for label, (run, result, *note) in cols.items():
                try:
                    want = want_bf16 if label.startswith("BF16") else want_fp8
                    err = float((result() - want).norm() / want.norm())
                    if err > WRONG:
                        cells.append(f"wrong ({err:.3f})")
                        continue
                    ms = timed_ms(run, torch.device("cuda"), args.iters)
                    tflops = 2 * n * k * args.tokens / ms / 1e9
                    cells.append(f"{tflops:.0f} ({ms:.2f})" + "".join(f" [{t}]" for t in note))
                except Exception as exc:  # noqa: BLE001 - a column that cannot run says why
                    cells.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}".replace("|", "/"))
            print(f"| {model} | {name} ({n} x {k}) | " + " | ".join(cells) + " |", flush=True)
            del dy, x, want_fp8, want_bf16, cols


if __name__ == "__main__":
    main()
