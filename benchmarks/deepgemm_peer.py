"""DeepGEMM's SM90 FP8 GEMMs as a peer column of `dense_gemm.py` and `grouped_gemm.py` (issues 18 and 19).

DeepSeek's DeepGEMM (github.com/deepseek-ai/DeepGEMM) is the public anchor for DeepSeek-V3's blockwise FP8 GEMMs
on Hopper: the 1x128 x 128x128 ("1D2D") kernel for fprop and dgrad, the 1x128 x 1x128 ("1D1D") one for the weight
gradient, with TMA multicast across clusters of two CTAs, which our Gluon kernels cannot issue. It is not a
dependency of megafp8: these columns run only where `import deep_gemm` works (it JIT-compiles its kernels with the
CUDA toolkit's nvcc at first call, so each shape's first call takes seconds) and print why not elsewhere.

Its operands are ours, quantized by the benchmark's backend; only their layouts are changed, untimed, to the ones
DeepGEMM asks for (its 1x128 scales MN-major and TMA-aligned, its weight's block scales (N/128, K/128), its
k-grouped operands one expert after another). Each column's output is checked by its benchmark like the others.
"""
from __future__ import annotations

from typing import Callable

import torch


def _deep_gemm():
    """The `deep_gemm` module, or an ImportError that says how to get it."""
    try:
        import deep_gemm
    except ImportError as exc:
        raise ImportError(f"DeepGEMM is not importable here ({exc}); build it with tools/install_deepgemm.py and "
                          "source the deepgemm.env it writes to fill this column") from exc
    return deep_gemm


def _tokens_scales(dg, scale: torch.Tensor) -> torch.Tensor:
    """1x128 scales (rows, K/128) as DeepGEMM's SM90 kernels read them (MN-major, TMA-aligned; already so, they are
    passed as they are)."""
    return dg.get_mn_major_tma_aligned_tensor(scale)


def dense(gemm: str, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
          out: torch.Tensor) -> Callable[[], torch.Tensor]:
    """DeepGEMM's `fp8_gemm_nt` for one dense GEMM: out = a @ b^T with a (M, K) in 1x128 tiles and b (N, K) in
    128x128 blocks (fprop, dgrad: `b_scale` (N/128, K/128), out BF16) or in 1x128 tiles along K (wgrad: `b_scale`
    (N, K/128), out the FP32 main_grad it adds into)."""
    dg = _deep_gemm()
    a_s = _tokens_scales(dg, a_scale)
    if gemm == "wgrad":
        b_s = _tokens_scales(dg, b_scale)
        return lambda: dg.fp8_gemm_nt((a, a_s), (b, b_s), out, c=out, recipe=(1, 1, 128)) or out
    b_s = b_scale.contiguous()
    return lambda: dg.fp8_gemm_nt((a, a_s), (b, b_s), out) or out  # (it writes `out` and returns None)


def m_grouped(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, experts: int,
              rows: int) -> Callable[[], torch.Tensor]:
    """DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous`: rows sorted by expert, `rows` (a multiple of 128) each;
    a (E*rows, K) in 1x128 tiles, b (E, N, K) in 128x128 blocks with `b_scale` (E, N/128, K/128). BF16 out."""
    dg = _deep_gemm()
    a_s = _tokens_scales(dg, a_scale)
    expert_of_row = torch.arange(experts, dtype=torch.int32, device=a.device).repeat_interleave(rows)
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)
    b_s = b_scale.contiguous()
    return lambda: dg.m_grouped_fp8_gemm_nt_contiguous((a, a_s), (b, b_s), out, expert_of_row) or out


def k_grouped(at: torch.Tensor, at_scale: torch.Tensor, bt: torch.Tensor, bt_scale: torch.Tensor, experts: int,
              rows: int, main_grad: torch.Tensor) -> Callable[[], torch.Tensor]:
    """DeepGEMM's `k_grouped_fp8_gemm_nt_contiguous` (its SM90 1D1D wgrad, adding into FP32 `main_grad` (E, N, K)):
    at (N, E*rows) = dy^T and bt (K, E*rows) = x^T, both in 1x128 tiles along the rows (scales (N or K, E*rows/128)),
    re-laid out here (untimed) one expert's (N, rows) block after another, as it reads them."""
    dg = _deep_gemm()

    def per_expert(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, e * rows:(e + 1) * rows].contiguous().flatten() for e in range(experts)])
    a, b = per_expert(at), per_expert(bt)
    ks = [rows] * experts
    ks_tensor = torch.tensor(ks, dtype=torch.int32, device=at.device)
    a_s, b_s = _tokens_scales(dg, at_scale), _tokens_scales(dg, bt_scale)
    return lambda: dg.k_grouped_fp8_gemm_nt_contiguous((a, a_s), (b, b_s), main_grad, ks, ks_tensor, main_grad,
                                                       recipe=(1, 1, 128)) or main_grad

