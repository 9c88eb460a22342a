"""BF16 and FP16 matrix products on CPUs without BF16 GEMM instructions: computed in FP32 and rounded once.

torch runs a BF16 matrix product on the CPU through oneDNN where the CPU has the instructions for it (AVX-512 BF16,
AMX: `torch.ops.mkldnn._is_mkldnn_bf16_supported()`); elsewhere (AVX2 machines, many laptops and CI runners) a
generic loop does it, 34x slower than torch's FP32 product on a 2-core AVX2 machine (1.2 against 42 GFLOP/s at
1024 x 256 x 768, one thread): 93% of a tiny BF16 model's training step, and most of this project's CPU test
suite. The same product from the operands widened to FP32 (exact) and rounded to BF16 once is the arithmetic of a
BF16 GEMM with FP32 accumulation (oneDNN's, cuBLAS's, and that loop's own), up to the order of the sums.

`widen_reduced_precision_gemms` puts that in place for the process, as torch's backend flags are set: CPU kernels
for `aten::mm`, `aten::bmm` and `aten::addmm` that widen BF16 and FP16 operands and run torch's own FP32 kernels
(through the `out=` forms, which keep torch's kernels), and leave every other dtype to torch. Eager layers and
autograd's formulas reach them; compiled CPU code calls the `out=` forms itself, so it keeps torch's kernels. Every
CPU run that builds a model calls it (`megafp8.train.build.build_model`, `megafp8.train.generate`); the test suite
for its whole session and in its spawned ranks, so each comparison inside a test sees one arithmetic.
`MEGAFP8_CPU_GEMM=native` keeps torch's kernels (on such a CPU, ~30x slower BF16 GEMMs).
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch

_REDUCED = (torch.bfloat16, torch.float16)
NATIVE_ENV = "MEGAFP8_CPU_GEMM"


def cpu_has_bf16_gemm() -> bool:
    """Whether torch multiplies BF16 matrices on this CPU with oneDNN's BF16 instructions."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _product(out_form, shape: tuple, operands: tuple, **scalars) -> torch.Tensor:
    """`out_form(*operands, out=...)` (torch's own kernel): in FP32 and rounded once where every operand is BF16
    or FP16 alike, else as given (other dtypes; mixed dtypes stay torch's error)."""
    dtype = operands[-1].dtype
    if dtype not in _REDUCED or any(t.dtype != dtype for t in operands):
        return out_form(*operands, **scalars, out=operands[-1].new_empty(shape))
    out = operands[-1].new_empty(shape, dtype=torch.float32)
    return out_form(*(t.float() for t in operands), **scalars, out=out).to(dtype)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _product(torch.ops.aten.mm.out, (a.shape[0], b.shape[1]), (a, b))


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _product(torch.ops.aten.bmm.out, (a.shape[0], a.shape[1], b.shape[2]), (a, b))


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    return _product(torch.ops.aten.addmm.out, (a.shape[0], b.shape[1]), (c, a, b), beta=beta, alpha=alpha)


def widen_reduced_precision_gemms() -> bool:
    """Compute BF16/FP16 `mm`, `bmm` and `addmm` on the CPU in FP32 (rounded once) where torch has no BF16 GEMM
    instructions on this CPU and `MEGAFP8_CPU_GEMM` is not `native`; whether it does. CUDA is never touched."""
    return _widening_kernels() is not None


@functools.cache  # once a process: the kernels stay for the process's life, as torch's backend flags do
def _widening_kernels() -> Optional[torch.library.Library]:
    if cpu_has_bf16_gemm() or os.environ.get(NATIVE_ENV, "") == "native":
        return None
    library = torch.library.Library("aten", "IMPL")  # kept by the cache: collected, it would remove its kernels
    with warnings.catch_warnings():  # torch says it overrides its kernel: that is the point
        warnings.simplefilter("ignore", UserWarning)
        for name, kernel in (("mm", _mm), ("bmm", _bmm), ("addmm", _addmm)):
            library.impl(name, kernel, "CPU")
    return library
