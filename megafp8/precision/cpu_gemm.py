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
for its whole session and in its spawned ranks, so each comparison inside a test sees one arithmetic. `MEGAFP8_CPU_GEMM=native` keeps
torch's kernels (on such a CPU, ~30x slower BF16 GEMMs).
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


def _widened(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype in _REDUCED and a.dtype == b.dtype


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _widened(a, b):
        return torch.ops.aten.mm.out(a, b, out=a.new_empty((a.shape[0], b.shape[1])))
    out = a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)
    return torch.ops.aten.mm.out(a.float(), b.float(), out=out).to(a.dtype)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    shape = (a.shape[0], a.shape[1], b.shape[2])
    if not _widened(a, b):
        return torch.ops.aten.bmm.out(a, b, out=a.new_empty(shape))
    out = a.new_empty(shape, dtype=torch.float32)
    return torch.ops.aten.bmm.out(a.float(), b.float(), out=out).to(a.dtype)


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    shape = (a.shape[0], b.shape[1])
    if not (_widened(a, b) and c.dtype == a.dtype):
        return torch.ops.aten.addmm.out(c, a, b, beta=beta, alpha=alpha, out=a.new_empty(shape))
    out = a.new_empty(shape, dtype=torch.float32)
    return torch.ops.aten.addmm.out(c.float(), a.float(), b.float(), beta=beta, alpha=alpha, out=out).to(a.dtype)


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
