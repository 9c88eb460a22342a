"""The training-step benchmark runs end to end on CPU (a smoke test: the GPU figures live in docs/benchmarks.md)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, torchrun_env


def test_train_step_benchmark_prints_one_row_per_recipe(corpus_dir, tmp_path):
    cmd = [sys.executable, "benchmarks/train_step.py", "training.device=cpu", "--model", "tiny", "--steps", "3",
           "--warmup", "1", "--data", str(corpus_dir), "--out", str(tmp_path), "--recipes", "bf16", "fp8"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[2].strip() for row in rows] == ["bf16", "fp8"]
    assert rows[0].split("|")[6].strip() == "1.00x"  # BF16 is the yardstick
    assert all(float(row.split("|")[13]) > 0 for row in rows)  # the planner's prediction beside the measurement


def test_train_step_profile_lists_host_operators(corpus_dir, tmp_path):
    cmd = [sys.executable, "benchmarks/train_step.py", "training.device=cpu", "--model", "tiny", "--steps", "4",
           "--warmup", "1", "--profile", "2", "--data", str(corpus_dir), "--out", str(tmp_path), "--recipes", "fp8"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "### tiny, fp8, 1 rank(s)" in result.stdout
    assert "| `_Fp8LinearFn" in result.stdout  # the FP8 linear's autograd node is among the host's busiest


def test_kernel_breakdown_sorts_kernels_into_categories():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernel_breakdown as kb

    kernels = [
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", 4000.0),
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 2000.0),
        ("_quantize_rows_cols_kernel", 1000.0),
        ("_swiglu_backward_quantize_kernel", 700.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 800.0),
        ("ncclDevKernel_AllGather_RING_LL", 300.0),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 600.0),
        ("triton_poi_fused__to_copy_add_cat_mul_0", 500.0),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 400.0),
        ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", 200.0),
        ("some_unknown_kernel", 100.0),
    ]
    rows = kb.breakdown(kernels, steps=2)
    by_name = {category: ms for category, ms, _ in rows}
    assert by_name == {"GEMM": 3.0, "FP8 quantization, standalone (Triton)": 0.5, "attention (SDPA/flash)": 0.4,
                       "FP8 producers quantizing their output (RMSNorm, SwiGLU)": 0.35,
                       "communication (NCCL)": 0.15, "element-wise (eager)": 0.3, "torch.compile fused kernels": 0.25,
                       "optimizer (AdamW)": 0.2, "copies / casts": 0.1, "other": 0.05}
    assert [ms for _, ms, _ in rows] == sorted((ms for _, ms, _ in rows), reverse=True)
    assert abs(sum(share for _, _, share in rows) - 1.0) < 1e-9
    table = kb.markdown("t", rows, wall_ms=6.0, top=kb.top_kernels(kernels, steps=2, count=2))
    assert "GPU kernel time per step 5.3 ms (88% busy)" in table and "| `_quantize_rows_cols_kernel`" not in table


def test_kernel_breakdown_leaves_out_compiled_graph_ranges():
    """torch.compile wraps each compiled graph's kernels in a device-side `## Call CompiledFxGraph ... ##` range;
    counted as a kernel, it counted those kernels twice (a GPU time above the wall time)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernel_breakdown as kb

    class Event:
        def __init__(self, name, micros, device="DeviceType.CUDA", annotation=False):
            self.name, self.device_time, self.device_type, self.is_user_annotation = name, micros, device, annotation

    class Prof:
        def events(self):
            return [Event("## Call CompiledFxGraph fabc ##", 900.0), Event("triton_poi_fused_add_0", 500.0),
                    Event("nvjet_sm90_tst_256x128", 400.0), Event("my_range", 300.0, annotation=True),
                    Event("aten::mm", 50.0, device="DeviceType.CPU")]

    assert kb.cuda_kernels(Prof()) == [("triton_poi_fused_add_0", 500.0), ("nvjet_sm90_tst_256x128", 400.0)]


def test_reference_model_benchmark_runs_on_cpu():
    """The plain-PyTorch yardstick (benchmarks/reference_model.py) runs end to end; a recipe that cannot run here
    (torchao's float8 needs a GPU or the package) is a table row saying why, not a crash."""
    cmd = [sys.executable, "benchmarks/reference_model.py", "--device", "cpu", "--layers", "2", "--hidden", "128",
           "--ffn", "256", "--heads", "2", "--vocab", "256", "--seq", "64", "--batch", "2", "--steps", "2",
           "--warmup", "1", "--recipes", "bf16", "torchao-blockwise"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split("|") for line in result.stdout.splitlines() if line.startswith("| plain PyTorch")]
    assert rows[0][2].strip() == "bf16" and float(rows[0][4].replace(",", "")) > 0
    assert rows[1][2].strip() == "torchao-blockwise" and "failed:" in rows[1][3]


def test_grouped_gemm_benchmark_prints_every_column_or_why_not():
    """benchmarks/grouped_gemm.py runs its table on CPU (`--device cpu`, the reference backend as ours): a row per
    GEMM; the BF16 columns and ours are timed after matching the BF16 loop's output; the FP8 columns CPU has no
    kernel for print their error in their cell instead of crashing the table."""
    cmd = [sys.executable, "benchmarks/grouped_gemm.py", "--device", "cpu", "--backend", "reference", "--shapes",
           "2x128,128,256", "--iters", "1"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith("| 2 x 128, 128, 256 |")]
    assert [row[1] for row in rows] == ["fprop", "dgrad", "wgrad"]
    for row in rows:
        bf16_loop, bf16_grouped, rowwise, blockwise, *our_kernels, ours, ratio = row[2:]
        assert our_kernels == ["RuntimeError: our Triton kernels need a CUDA GPU"] * 4, row  # pointer, TMA, ws x2
        assert min(float(bf16_loop), float(bf16_grouped), float(ours)) > 0, row
        assert rowwise.startswith("NotImplementedError: ") and "'CPU' backend" in rowwise, row
        assert blockwise.startswith("ConfigError: the cublas backend needs a CUDA GPU"), row
        assert float(ratio.removesuffix("x")) == pytest.approx(float(ours) / float(bf16_grouped), rel=0.05, abs=0.01)


def test_grouped_gemm_benchmark_helpers():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import grouped_gemm as gg

    assert [gg.parse_shape(s) for s in gg.SHAPES] == [(64, 2048, 2048, 2048), (64, 2048, 1024, 2048),
                                                       (8, 4096, 7168, 4096), (8, 4096, 2048, 7168)]
    for bad in ("64x2048,2048", "64x2000,2048,2048", "8x4096,7168,4100", "0x128,128,128"):
        with pytest.raises(ValueError, match="shape"):
            gg.parse_shape(bad)
    cell = gg.error_cell(RuntimeError("No gemm implementation was found | really\nsecond line"))
    assert cell == "RuntimeError: No gemm implementation was found / really"
    assert len(gg.error_cell(RuntimeError("x" * 500))) == 160
    assert gg.ratio_cell(1000.0, 647.0) == "1.55x" and gg.ratio_cell(None, 647.0) == "—"
    table = gg.markdown([("8 x 4096, 7168, 4096", "fprop", ["688", "662", "1171", "1002", "556"], "0.84x")], "cublas")
    assert table.splitlines()[2] == "| 8 x 4096, 7168, 4096 | fprop | 688 | 662 | 1171 | 1002 | 556 | 0.84x |"
    assert "megafp8 grouped (cublas)" in table.splitlines()[0]


def test_integrity_benchmark_prints_its_two_tables(tmp_path):
    cmd = [sys.executable, "benchmarks/integrity.py", "--gib", "0.01", "--dir", str(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| save_checkpoint: hashed while written, manifest, fsyncs, rename |" in result.stdout
    assert "| fused AdamW step with the skip flag (found_inf) |" in result.stdout
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself
