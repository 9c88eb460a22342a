"""The `deepgemm` backend (`megafp8.precision.backends.deepgemm_backend`) on the CPU, with a stand-in for
DeepGEMM: the operands and scale layouts it hands `deep_gemm.fp8_gemm_nt`, that `auto` prefers it where it runs, and the
reason it gives where it cannot run. Its GEMMs against the reference run with the GPU conformance tests
(`tests/test_fp8_backends.py`, `deepgemm-cuda`) where DeepGEMM is installed."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import pytest
import torch

from megafp8.precision import E4M3
from megafp8.precision import quantize as ref
from megafp8.precision.backends import REGISTERED, Fp8Backend, passed_over, select_backend
from megafp8.precision.backends import deepgemm_backend
from megafp8.precision.backends.cublas_backend import CublasBackend
from megafp8.precision.backends.deepgemm_backend import DeepGemmBackend
from megafp8.precision.backends.hopper_backend import HopperBackend
from megafp8.precision.backends.triton_backend import TritonBackend


@pytest.fixture(autouse=True)
def no_triton_kernels(monkeypatch):
    """The backends' constructors import their Triton kernels, which a CPU-only install lacks; nothing here runs
    them."""
    monkeypatch.setattr(TritonBackend, "__init__", lambda self: None)


def _stand_in(calls: list):
    """A `deep_gemm` module whose `fp8_gemm_nt` checks DeepGEMM's SM90 layout rules and writes the product of the
    dequantized operands."""
    def fp8_gemm_nt(a_pair, b_pair, out, c=None, recipe=None):
        (a, a_scale), (b, b_scale) = a_pair, b_pair
        m, k = a.shape
        assert a_scale.shape == (m, k // 128) and a_scale.stride() == (1, m), "A's scales: MN-major"
        # its rule for B's block scales (`check_sf_layout`'s SM90 check): strides exactly (K/128, 1), or transposed
        assert b_scale.shape == (b.shape[0] // 128, k // 128), "B's scales: (N/128, K/128)"
        assert b_scale.stride() in ((k // 128, 1), (1, b.shape[0] // 128)), f"B's scales' strides {b_scale.stride()}"
        assert out.dtype == torch.bfloat16 and c is None and recipe is None
        calls.append(tuple(b_scale.shape))
        out.copy_(ref.dequantize_1x128(a, a_scale) @ ref.dequantize_128x128(b, b_scale).t())
    return types.SimpleNamespace(fp8_gemm_nt=fp8_gemm_nt)


@pytest.mark.parametrize("m, n, k", [(260, 384, 640), (1, 128, 256), (5, 128, 384)])
def test_deepgemm_backend_hands_deepgemm_the_layouts_it_reads(monkeypatch, m, n, k):
    """K = 640 (five 128-wide blocks): the cublas weight layout pads K/128 to eight, which DeepGEMM must not see;
    N = 128 (one block row): torch calls the padded view contiguous, DeepGEMM does not (job GW's two failures); one
    or five rows. The result is the reference GEMM's (the stand-in computes it the reference's way)."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in(calls))
    backend = DeepGemmBackend()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    a, a_scale = ref.quantize_1x128(x, E4M3)
    weight = backend.empty_weight(w.shape, E4M3, torch.device("cpu"))
    q, s = ref.quantize_128x128(w, E4M3)
    weight.w_fp8.copy_(q)
    backend.block_scales_nk(weight.w_scale)[:, :k // 128].copy_(s)
    assert backend.block_scales_nk(weight.w_scale).shape == (n // 128, -(-k // 512) * 4)  # the padded cublas layout
    got = backend.gemm_1x128_128x128(a, a_scale, weight.w_fp8, weight.w_scale, torch.bfloat16)
    want = Fp8Backend().gemm_1x128_128x128(a, a_scale, q, s, torch.bfloat16)
    assert calls == [(n // 128, k // 128)]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_deepgemm_backend_leaves_other_output_types_to_the_hopper_kernel(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", _stand_in(calls))
    monkeypatch.setattr(HopperBackend, "gemm_1x128_128x128", lambda self, *args: "hopper")
    a = torch.zeros(128, 128, dtype=E4M3.dtype)
    assert DeepGemmBackend().gemm_1x128_128x128(a, torch.ones(128, 1), a, torch.ones(1, 1), torch.float32) == "hopper"
    assert calls == []


def test_auto_picks_the_deepgemm_backend_where_it_runs_and_says_why_not_where_it_does_not(monkeypatch):
    """`auto` prefers `deepgemm` to `hopper` (its parity run passed, and it is faster); where DeepGEMM is missing or
    fails its check, `auto` runs `hopper` and `passed_over` gives the reason the start-up log prints."""
    for cls in REGISTERED:
        monkeypatch.setattr(cls, "unavailable_reason", classmethod(lambda cls, device: None))
    cpu = torch.device("cpu")
    assert type(select_backend("auto", cpu)) is DeepGemmBackend
    assert passed_over(select_backend("auto", cpu), cpu) == []
    monkeypatch.setattr(DeepGemmBackend, "unavailable_reason", classmethod(lambda cls, device: "DeepGEMM crashed"))
    chosen = select_backend("auto", cpu)
    assert type(chosen) is HopperBackend
    assert passed_over(chosen, cpu) == [("deepgemm", "DeepGEMM crashed")]
    monkeypatch.setattr(HopperBackend, "unavailable_reason", classmethod(lambda cls, device: "no Gluon"))
    chosen = select_backend("auto", cpu)  # deepgemm's reason is hopper's: only the nearest is told
    assert type(chosen) is CublasBackend and passed_over(chosen, cpu) == [("hopper", "no Gluon")]
    with pytest.raises(Exception, match="DeepGEMM crashed: set precision.fp8_backend=auto"):
        select_backend("deepgemm", cpu)


def test_deepgemm_backend_says_why_it_cannot_run():
    reason = DeepGemmBackend.unavailable_reason(torch.device("cpu"))
    assert reason is not None and "deepgemm backend" in reason
    with pytest.raises(Exception, match="deepgemm backend"):
        select_backend("deepgemm", torch.device("cpu"))


@pytest.mark.parametrize("returncode, stderr, says", [
    (0, "", None),
    (-11, "", "SIGSEGV"),
    (1, "Traceback ...\nRuntimeError: DeepGEMM's 1x128 x 128x128 GEMM is wrong here", "is wrong here")])
def test_deepgemm_backend_runs_deepgemm_once_in_a_child_before_it_is_used(monkeypatch, returncode, stderr, says):
    """Where DeepGEMM imports, the backend's availability is its smoke test in a child process, asked once per
    process: a crash there (the libstdc++ mismatch seen on the H200 machine) becomes a reason that says what to try,
    not a training process killed at its first GEMM; a wrong result says which GEMM."""
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace())
    monkeypatch.setattr(HopperBackend, "unavailable_reason", classmethod(lambda cls, device: None))
    runs = []

    def run(command, **kwargs):
        runs.append(command)
        return subprocess.CompletedProcess(command, returncode, "", stderr)
    monkeypatch.setattr(deepgemm_backend.subprocess, "run", run)
    runtimes = []
    monkeypatch.setattr(deepgemm_backend, "create_runtime", runtimes.append)
    deepgemm_backend.ready_failure.cache_clear()
    try:
        for _ in range(3):
            reason = DeepGemmBackend.unavailable_reason(torch.device("cuda", 0))
    finally:
        deepgemm_backend.ready_failure.cache_clear()
    assert len(runs) == 1 and runs[0][0] == sys.executable and "smoke_test(0)" in runs[0][-1]
    if says is None:
        assert reason is None and runtimes == [0]  # DeepGEMM's runtime made once, in this process, after the child
    else:
        assert says in reason, reason
        assert runtimes == []
    if returncode < 0:
        assert "LD_PRELOAD=$(c++ -print-file-name=libstdc++.so.6)" in reason and "fp8_backend=hopper" in reason


def test_deepgemm_backend_makes_deepgemms_runtime_eagerly_on_its_gpu(monkeypatch):
    """`create_runtime` touches DeepGEMM's runtime object (which makes it, and its workspace, at first use) on the
    GPU the backend will run on, so that its first GEMM, maybe inside a CUDA graph's warm-up, allocates nothing to
    keep (job GZ: "Detected 1 tensor(s) in the cudagraph pool not tracked as outputs")."""
    events = []
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(get_num_sms=lambda: events.append("runtime")))

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            events.append(("device", self.index))

        def __exit__(self, *exc):
            events.append("left")
    monkeypatch.setattr(deepgemm_backend.torch.cuda, "device", Device)
    deepgemm_backend.create_runtime(3)
    assert events == [("device", 3), "runtime", "left"]


def _ranks_choose_differently_worker(rank, world):
    import logging

    from megafp8.config import ParallelConfig
    from megafp8.parallel import ParallelDims
    from megafp8.precision import PrecisionRecipe
    from megafp8.train import build

    TritonBackend.__init__ = lambda self: None  # (the fixture's patch does not reach a forked rank)
    # Rank 1's DeepGEMM failed its check; rank 0's passed.
    crashed = "DeepGEMM crashed a test process (SIGSEGV)"
    DeepGemmBackend.unavailable_reason = classmethod(lambda cls, device: crashed if rank == 1 else None)
    for cls in (TritonBackend, CublasBackend, HopperBackend):
        cls.unavailable_reason = classmethod(lambda cls, device: None)
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("megafp8").addHandler(handler)
    dims = ParallelDims.from_config(ParallelConfig())
    recipe = build.agree_on_fp8_backend(PrecisionRecipe.from_name("fp8"), torch.device("cpu"), dims)
    assert recipe.fp8.backend == "hopper", recipe  # on both ranks: the best that both run
    if rank == 0:
        assert any("every rank runs hopper" in s and f"rank 1 runs hopper: deepgemm: {crashed}" in s
                   for s in said), said
    named = dataclasses.replace(PrecisionRecipe.from_name("fp8"), fp8=dataclasses.replace(
        PrecisionRecipe.from_name("fp8").fp8, backend="cublas"))
    assert build.agree_on_fp8_backend(named, torch.device("cpu"), dims) is named  # a named backend is left alone


def test_auto_resolves_to_one_backend_that_every_rank_runs():
    """`auto` asks each rank's machine: where DeepGEMM passes its check on one rank and not on another, every rank
    runs `hopper` (not one rank alone on slower kernels, that every collective waits for), and rank 0 says which rank
    fell short and why."""
    from tests.distributed import spawn

    spawn(2, _ranks_choose_differently_worker)


def test_common_choice_is_the_lowest_of_the_ranks_choices():
    from megafp8.precision.backends import common_choice

    assert common_choice(["deepgemm", "hopper", "deepgemm"]) == "hopper"
    assert common_choice(["deepgemm"]) == "deepgemm"
    assert common_choice(["hopper", "reference"]) == "reference"
