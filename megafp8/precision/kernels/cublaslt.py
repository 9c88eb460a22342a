"""cuBLASLt's blockwise-scaled FP8 GEMM called directly, for the one thing `F.scaled_mm` does not expose: adding
the product into an existing FP32 tensor (beta = 1). A weight gradient then goes into the weight's `main_grad` in
the GEMM's epilogue, in FP32, with no BF16 copy of dw and no separate `main_grad += dw` pass (the ~1B step spent
3.9 ms, the 8B-layer step 9.1 ms on that pass; `docs/benchmarks.md`, job O). BF16's `main_grad.addmm_` gets the
same from cuBLAS; Transformer Engine calls the same cuBLASLt mode for its fused weight-gradient accumulation.

The library is the libcublasLt that torch itself loaded (ctypes, no build step). Everything here is host-side
set-up around one `cublasLtMatmul` on torch's current stream, so it is captured by CUDA graphs like any other
kernel launch. `unavailable_reason()` says why it cannot run (no CUDA, a cuBLAS older than 12.9, not SM90); the
backends then fall back to the GEMM plus a separate add.

Layout. torch tensors are row-major, cuBLAS is column-major: a row-major (R, C) tensor is cuBLAS's (C, R). For
out (M, N) += a (M, K) @ b (N, K)^T, cuBLAS computes D (N x M) = op(A) op(B) with A = b stored (K x N), op T;
B = a stored (K x M), op N: the "TN" form FP8 GEMMs require. `problem()` derives those arguments and
`tests/test_cublaslt.py` replays them as a column-major GEMM written out in torch.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import warnings
from typing import Optional

import torch

from megafp8.precision.formats import TILE

# Enum values from cublasLt.h / cublas_api.h / library_types.h (CUDA 12.9 and 13.x).
_CUDA_R_32F, _CUDA_R_8F_E4M3, _CUDA_R_8F_E5M2 = 0, 28, 29
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_VEC128_32F = 4  # one FP32 scale per 128 elements along K: the 1x128 tiles
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
_MIN_VERSION = 120900  # cuBLAS 12.9: the first with 1x128 and 128x128 block scaling
_MAX_WORKSPACE = 32 * 1024 * 1024
_FP8_TYPES = {torch.float8_e4m3fn: _CUDA_R_8F_E4M3, torch.float8_e5m2: _CUDA_R_8F_E5M2}


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One cuBLASLt call for out (M, N) += a (M, K) @ b (N, K)^T, in cuBLAS's column-major terms: D (m x n) =
    op(A) op(B), A = b stored (k x m) with leading dimension lda, B = a stored (k x n), ldb; C = D = out, ldd."""

    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldd: int
    a_type: int
    b_type: int
    align: tuple[int, int, int]  # byte alignment of cuBLAS's A, B and C/D pointers


def _alignment(ptr: int) -> int:
    """The largest power of two up to 256 that divides the address."""
    align = 256
    while ptr % align:
        align //= 2
    return align


def problem(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Problem:
    """The cuBLASLt arguments for out (M, N) += a (M, K) @ b (N, K)^T with row-major operands (see the module
    docstring); a ValueError says what does not fit (the callers then fall back to the GEMM and a separate add)."""
    (m_rows, k), (n_rows, k_b) = a.shape, b.shape
    if k != k_b or out.shape != (m_rows, n_rows):
        raise ValueError(f"cublaslt: shapes {tuple(a.shape)} @ {tuple(b.shape)}^T -> {tuple(out.shape)} do not fit")
    if a.stride(1) != 1 or b.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("cublaslt: operands and output need contiguous rows")
    if a.dtype not in _FP8_TYPES or b.dtype not in _FP8_TYPES or out.dtype != torch.float32:
        raise ValueError(f"cublaslt: FP8 operands and an FP32 output, got {a.dtype}, {b.dtype} -> {out.dtype}")
    if k % TILE or m_rows % TILE or n_rows % TILE:
        raise ValueError(f"cublaslt: every dimension a multiple of {TILE}, got M={m_rows} N={n_rows} K={k}")
    align = tuple(_alignment(t.data_ptr()) for t in (b, a, out))
    if min(align) < 16:
        raise ValueError("cublaslt: every pointer 16-byte aligned")
    return Problem(m=n_rows, n=m_rows, k=k, lda=b.stride(0), ldb=a.stride(0), ldd=out.stride(0),
                   a_type=_FP8_TYPES[b.dtype], b_type=_FP8_TYPES[a.dtype], align=align)


@functools.cache
def _library() -> Optional[ctypes.CDLL]:
    """libcublasLt as torch loaded it, or None. Cached: one library per process."""
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return declare(ctypes.CDLL(name))
        except OSError:
            continue
    return None


def declare(lib):
    """Give the functions of `lib` used here their C signatures (cublasLt.h), so ctypes converts and counts the
    arguments of every call; returns `lib`."""
    void_p, c_int, size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], size_t
    lib.cublasLtGetStatusName.argtypes, lib.cublasLtGetStatusName.restype = [c_int], ctypes.c_char_p
    lib.cublasLtCreate.argtypes = [void_p]
    lib.cublasLtMatmulDescCreate.argtypes = [void_p, c_int, c_int]
    lib.cublasLtMatrixLayoutCreate.argtypes = [void_p, c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [void_p, c_int, void_p, size_t]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [void_p]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [void_p, c_int, void_p, size_t]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [void_p]
    # handle, desc, A, B, C and D layouts, preference, requested count, results, returned count
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [void_p] * 7 + [c_int, ctypes.POINTER(_HeuristicResult),
                                                                  ctypes.POINTER(c_int)]
    # handle, desc, alpha, A, A layout, B, B layout, beta, C, C layout, D, D layout, algo, workspace; its size; stream
    lib.cublasLtMatmul.argtypes = [void_p] * 14 + [size_t, void_p]
    for name in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatrixLayoutCreate",
                 "cublasLtMatmulDescSetAttribute", "cublasLtMatmulPreferenceCreate",
                 "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulPreferenceDestroy",
                 "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"):
        getattr(lib, name).restype = c_int  # cublasStatus_t
    return lib


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None if the fused-accumulation GEMM can run on `device`, else why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cuBLASLt's accumulating FP8 GEMM needs a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "cuBLASLt's 1x128 / 128x128 block-scaled FP8 GEMMs run on SM90 (Hopper) only"
    lib = _library()
    if lib is None:
        return "libcublasLt could not be loaded"
    if lib.cublasLtGetVersion() < _MIN_VERSION:
        return f"cuBLASLt {lib.cublasLtGetVersion()} predates block-scaled FP8 GEMMs (12.9)"
    return None


@functools.cache
def _unavailable_reason_of(device_type: str, index: Optional[int]) -> Optional[str]:
    return unavailable_reason(torch.device(device_type, index))


def cached_unavailable_reason(device: torch.device) -> Optional[str]:
    """`unavailable_reason`, asked once per device (it is asked on every weight gradient)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _unavailable_reason_of(device.type, device.index)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed: {_library().cublasLtGetStatusName(status).decode()}")


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    """One cuBLASLt handle per device, for the life of the process (as torch keeps its own)."""
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "handle creation")
    return handle


def _set(setter, obj: ctypes.c_void_p, attribute: int, value: ctypes._SimpleCData) -> None:
    _check(setter(obj, attribute, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attribute}")


class _Plan:
    """The descriptors and algorithms of one `Problem`, made once and reused; only the scale pointers change between
    calls. The heuristic runs at the first call: it refuses block scaling without scale pointers
    (CUBLAS_STATUS_INVALID_VALUE), so it is given that call's."""

    def __init__(self, p: Problem, device_index: int) -> None:
        lib = _library()
        self.problem, self.device_index = p, device_index
        self.desc, self.a_desc, self.b_desc, self.d_desc = (ctypes.c_void_p() for _ in range(4))
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _CUDA_R_32F), "matmul desc")
        set_desc = lib.cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, _DESC_TRANSA, ctypes.c_int32(_OP_T))
        _set(set_desc, self.desc, _DESC_TRANSB, ctypes.c_int32(_OP_N))
        _set(set_desc, self.desc, _DESC_A_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
        _set(set_desc, self.desc, _DESC_B_SCALE_MODE, ctypes.c_int32(_SCALE_VEC128_32F))
        for layout, dtype, rows, cols, ld in ((self.a_desc, p.a_type, p.k, p.m, p.lda),
                                              (self.b_desc, p.b_type, p.k, p.n, p.ldb),
                                              (self.d_desc, _CUDA_R_32F, p.m, p.n, p.ldd)):
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, ld), "matrix layout")
        self.status: Optional[int] = None  # the heuristic's, once it ran
        self.results: list[_HeuristicResult] = []

    def set_scales(self, a_scale_ptr: int, b_scale_ptr: int) -> None:
        """Point the descriptor at this call's scales (and run the heuristic if this is the first call)."""
        set_desc = _library().cublasLtMatmulDescSetAttribute
        _set(set_desc, self.desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale_ptr))  # cuBLAS's A is b
        _set(set_desc, self.desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale_ptr))
        if self.status is None:
            self.status, self.results = self._heuristic()
            if not self.results:
                warnings.warn(f"cuBLASLt offers no algorithm for {self.problem} (status {self.status}): FP8 weight "
                              f"gradients of this shape take the GEMM and a separate add into main_grad")

    def _heuristic(self, count: int = 8) -> tuple[int, list[_HeuristicResult]]:
        """(status, algorithms): the heuristic's candidates, best first; none, with its status, if it refused."""
        lib, p = _library(), self.problem
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        set_pref = lib.cublasLtMatmulPreferenceSetAttribute
        _set(set_pref, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(_MAX_WORKSPACE))
        for name, align in zip("abcd", (*p.align, p.align[2])):
            _set(set_pref, pref, _PREF_MIN_ALIGNMENT[name], ctypes.c_uint32(align))
        results = (_HeuristicResult * count)()
        returned = ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(_handle(self.device_index), self.desc, self.a_desc, self.b_desc,
                                                    self.d_desc, self.d_desc, pref, count, results,
                                                    ctypes.byref(returned))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0:
            return status, []
        return status, [results[i] for i in range(returned.value) if results[i].state == 0]

    def run(self, a_ptr: int, b_ptr: int, out: torch.Tensor, choice: Optional[int] = None) -> None:
        """The GEMM on torch's current stream, with the scales `set_scales` pointed at."""
        result = self.results[choice or 0]
        workspace = (torch.empty(result.workspace_size, dtype=torch.uint8, device=out.device)
                     if result.workspace_size else None)
        one = ctypes.c_float(1.0)
        d_ptr = ctypes.c_void_p(out.data_ptr())
        stream = torch.cuda.current_stream(out.device).cuda_stream
        _check(_library().cublasLtMatmul(
            _handle(self.device_index), self.desc, ctypes.byref(one), ctypes.c_void_p(b_ptr), self.a_desc,
            ctypes.c_void_p(a_ptr), self.b_desc, ctypes.byref(one), d_ptr, self.d_desc, d_ptr, self.d_desc,
            ctypes.byref(result.algo), ctypes.c_void_p(workspace.data_ptr() if workspace is not None else 0),
            result.workspace_size, ctypes.c_void_p(stream)), "matmul")


class Unsupported(ValueError):
    """cuBLASLt offers no algorithm for this problem (the callers fall back to the GEMM and a separate add)."""


@functools.cache
def _plan(p: Problem, device_index: int) -> _Plan:
    """The plan of `p`, one per process (remembered also when cuBLASLt has no algorithm for it)."""
    return _Plan(p, device_index)


def _ready_plan(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                b_scale: torch.Tensor) -> _Plan:
    """The plan of this call, pointed at its scales; `Unsupported` where cuBLASLt has no algorithm for it."""
    plan = _plan(problem(a, b, out), out.device.index)
    plan.set_scales(a_scale.data_ptr(), b_scale.data_ptr())
    if not plan.results:
        raise Unsupported(f"cuBLASLt has no algorithm for {plan.problem} (status {plan.status})")
    return plan


def gemm_accumulate_(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                     b_scale: torch.Tensor, algorithm: Optional[int] = None) -> torch.Tensor:
    """out (M, N) FP32 += a (M, K) @ b (N, K)^T, dequantized, in cuBLASLt's epilogue; returns out.

    a and b: FP8 in 1x128 tiles along K (a weight gradient's dy^T and x^T, tiled along the tokens), scales
    (M, K/128) and (N, K/128) stored column-major (`mn_major`).
    `algorithm`: the index of one of `algorithm_count` candidates (benchmarks); default the heuristic's first.
    A ValueError (`Unsupported` among them) says why cuBLASLt cannot take it; nothing was written then."""
    assert a_scale.stride(0) == 1 and b_scale.stride(0) == 1, "scales must be column-major"
    _ready_plan(out, a, a_scale, b, b_scale).run(a.data_ptr(), b.data_ptr(), out, algorithm)
    return out


def algorithm_count(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                    b_scale: torch.Tensor) -> int:
    """How many algorithms cuBLASLt's heuristic offers for this problem (for `gemm_accumulate_(algorithm=...)`)."""
    return len(_ready_plan(out, a, a_scale, b, b_scale).results)
