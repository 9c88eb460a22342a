"""The cuBLASLt call's arguments (`megafp8.precision.kernels.cublaslt`) on the CPU: the column-major problem it
derives from row-major torch tensors, replayed as cuBLAS defines it, computes out += a @ b^T; what it cannot take
is refused with a reason (the backend then falls back). The call itself runs in `tests/test_fp8_gpu.py`."""
from __future__ import annotations

import pytest
import torch

from megafp8.precision.kernels import cublaslt

E4M3 = torch.float8_e4m3fn


def _fp8(rows: int, cols: int, seed: int, row_stride: int = 0) -> torch.Tensor:
    """An FP8 (rows, cols) tensor, as a view with a longer row stride when `row_stride` is given."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(rows, row_stride or cols, generator=g).to(E4M3)
    return full[:, :cols]


def _cublas_call(p: cublaslt.Problem, a_mem: torch.Tensor, b_mem: torch.Tensor, d_mem: torch.Tensor) -> None:
    """What cuBLAS does with `p`, written out in torch on flat storage: D = op(A) op(B) + D, each matrix read
    column-major from its storage with its leading dimension (op(A) = A^T, op(B) = B: the binding's "TN")."""
    def column_major(mem: torch.Tensor, rows: int, cols: int, ld: int) -> torch.Tensor:
        return mem.as_strided((rows, cols), (1, ld))
    a_op = column_major(a_mem, p.k, p.m, p.lda).t()  # op T
    b_op = column_major(b_mem, p.k, p.n, p.ldb)  # op N
    column_major(d_mem, p.m, p.n, p.ldd).add_(a_op @ b_op)


def _replay(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out` after the cuBLAS call `problem` describes, done on flat copies of the three tensors' storage."""
    p = cublaslt.problem(a, b, out)

    def memory(t: torch.Tensor) -> torch.Tensor:  # the whole storage as one flat FP32 copy
        return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).float().clone()
    a_mem = memory(b)[b.storage_offset():]  # cuBLAS's A is b
    b_mem = memory(a)[a.storage_offset():]  # cuBLAS's B is a
    d_mem = memory(out)
    d_view = d_mem[out.storage_offset():]
    _cublas_call(p, a_mem, b_mem, d_view)
    return d_mem.as_strided(out.shape, out.stride(), out.storage_offset())


@pytest.mark.parametrize("m, n, k", [(256, 384, 512), (128, 128, 128), (640, 256, 1024)])
def test_the_column_major_problem_computes_out_plus_a_times_b_transposed(m, n, k):
    a, b = _fp8(m, k, 0), _fp8(n, k, 1)
    out = torch.randn(m, n)
    got = _replay(a, b, out)
    want = out + a.float() @ b.float().t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    p = cublaslt.problem(a, b, out)
    assert (p.m, p.n, p.k) == (n, m, k)  # D is out^T: cuBLAS's rows are out's columns


def test_leading_dimensions_follow_row_strides_of_views():
    """Operands and output that are views with longer rows (a gradient buffer's slices, padded tokens)."""
    a, b = _fp8(256, 384, 2, row_stride=512), _fp8(128, 384, 3, row_stride=640)
    big = torch.randn(256, 256)
    out = big[:, 64:192]
    p = cublaslt.problem(a, b, out)
    assert (p.lda, p.ldb, p.ldd) == (640, 512, 256)
    got = _replay(a, b, out)
    torch.testing.assert_close(got, out + a.float() @ b.float().t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("what, make", [
    ("multiple of 128", lambda: (_fp8(200, 256, 0), _fp8(128, 256, 1), torch.zeros(200, 128))),
    ("FP32 output", lambda: (_fp8(128, 256, 0), _fp8(128, 256, 1), torch.zeros(128, 128, dtype=torch.bfloat16))),
    ("FP8 operands", lambda: (torch.zeros(128, 256), _fp8(128, 256, 1), torch.zeros(128, 128))),
    ("do not fit", lambda: (_fp8(128, 256, 0), _fp8(128, 384, 1), torch.zeros(128, 128))),
    ("contiguous rows", lambda: (_fp8(128, 256, 0), _fp8(128, 256, 1), torch.zeros(128, 128).t())),
    ("16-byte aligned", lambda: (_fp8(128, 256, 0), _fp8(128, 256, 1), torch.zeros(128 * 128 + 1)[1:].view(128, 128))),
])
def test_what_cublaslt_cannot_take_is_refused_with_the_reason(what, make):
    with pytest.raises(ValueError, match=what):
        cublaslt.problem(*make())


def test_a_cpu_device_is_not_offered_to_cublaslt():
    assert "CUDA device" in cublaslt.unavailable_reason(torch.device("cpu"))
    assert cublaslt.cached_unavailable_reason(torch.device("cpu")) == cublaslt.unavailable_reason(torch.device("cpu"))


# Parameter counts of the cuBLASLt functions the binding calls, as cublasLt.h (CUDA 12.9 / 13.x) declares them.
HEADER_ARITY = {"cublasLtGetVersion": 0, "cublasLtGetStatusName": 1, "cublasLtCreate": 1,
                "cublasLtMatmulDescCreate": 3, "cublasLtMatrixLayoutCreate": 5, "cublasLtMatmulDescSetAttribute": 4,
                "cublasLtMatmulPreferenceCreate": 1, "cublasLtMatmulPreferenceSetAttribute": 4,
                "cublasLtMatmulPreferenceDestroy": 1, "cublasLtMatmulAlgoGetHeuristic": 10, "cublasLtMatmul": 16}


def test_the_binding_declares_each_function_with_the_headers_parameter_count():
    """ctypes checks every call against the declared signature; a signature off by one fails only on a GPU."""
    class Function:
        argtypes, restype = None, None

    class Library:
        def __getattr__(self, name):
            setattr(self, name, Function())
            return getattr(self, name)
    lib = cublaslt.declare(Library())
    for name, arity in HEADER_ARITY.items():
        assert len(getattr(lib, name).argtypes) == arity, name
