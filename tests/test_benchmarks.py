"""The training-step benchmark runs end to end on CPU (a smoke test: the GPU figures live in docs/benchmarks.md)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_train_step_benchmark_prints_the_pipeline_schedules_bubble(corpus_dir, tmp_path):
    """Two gloo ranks at PP=2 under DualPipeV with 8 micro-batches: the last column is the bubble the schedule's
    actions imply (what the training loop's start-up line logs). The config's own global batch (16) would give
    DualPipeV too few micro-batches of 8: the layout is checked against `--global-batch` (job AO's ~1B DualPipeV
    run failed on this)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "benchmarks/train_step.py", "training.device=cpu", "parallel.pp=2", "parallel.pp_schedule=dualpipev",
           "model.num_layers=4", "training.micro_batch_size=8", "--model", "tiny", "--steps", "3", "--warmup", "1",
           "--log-interval", "1", "--global-batch", "64", "--data", str(corpus_dir), "--out", str(tmp_path), "--recipes", "bf16"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = re.search(r"pipeline: dualpipev over 2 ranks, 8 micro-batches, bubble (\d+\.\d)%", result.stderr)
    row = next(line for line in result.stdout.splitlines() if line.startswith("| tiny |"))
    assert logged and row.split("|")[-2].strip() == f"{logged.group(1)}%", (logged, row)


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


def test_every_quantizing_kernel_we_write_lands_in_an_fp8_category():
    """Profiles sort kernels by name; a kernel of ours that fell into "other" (as the Gluon row + column kernel did in
    job AJ) would hide from the quantizers' time that issue 18 bounds. Every Triton and Gluon kernel in the
    quantizer and producer modules must land in one of the two FP8 categories, RMSNorm's and SwiGLU's in the
    producers'."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import kernel_breakdown as kb

    kernels = REPO / "megafp8" / "precision" / "kernels"
    names = []
    for module in ("quantize", "producers", "rows_cols_gluon", "swiglu_cols_gluon"):
        names += re.findall(r"^def (_\w+_kernel)\(", (kernels / f"{module}.py").read_text(), re.M)
    assert "_quantize_rows_cols_gluon_kernel" in names and "_rmsnorm_quantize_gluon_kernel" in names
    for name in names:
        category = kb.category_of(name)
        assert category.startswith("FP8"), (name, category)
        if "rmsnorm" in name or "swiglu" in name or "rms_inverse" in name:
            assert category.startswith("FP8 producers"), (name, category)


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
    kernel for print their error in their cell instead of crashing the table, and columns without a kernel for the
    weight gradient added into main_grad say n/a there."""
    cmd = [sys.executable, "benchmarks/grouped_gemm.py", "--device", "cpu", "--backend", "reference", "--shapes",
           "2x128,128,256", "--iters", "1"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith("| 2 x 128, 128, 256 |")]
    assert [row[1] for row in rows] == ["fprop", "dgrad", "wgrad", "wgrad into main_grad"]
    for row in rows:
        bf16_loop, bf16_grouped, rowwise, blockwise, *our_kernels, ours, ratio = row[2:]
        # pointer, TMA, ws 128 and 256 by TMA and register epilogues
        assert our_kernels == ["RuntimeError: our Triton kernels need a CUDA GPU"] * 6, row
        assert min(float(bf16_loop), float(bf16_grouped), float(ours)) > 0, row
        if row[1] == "wgrad into main_grad":
            assert rowwise == blockwise == "n/a", row
        else:
            assert rowwise.startswith("NotImplementedError: ") and "'CPU' backend" in rowwise, row
            assert blockwise.startswith("ConfigError: the cublas backend needs a CUDA GPU"), row
        assert float(ratio.removesuffix("x")) == pytest.approx(float(ours) / float(bf16_grouped), rel=0.05, abs=0.01)


def test_grouped_gemm_benchmark_measures_only_the_columns_asked_for():
    """`--columns` keeps a bounded GPU job to the kernels under study: the other columns print '-', while BF16
    `_grouped_mm` and the backend's default (the ratio's two) always run."""
    cmd = [sys.executable, "benchmarks/grouped_gemm.py", "--device", "cpu", "--backend", "reference", "--shapes",
           "2x128,128,256", "--iters", "1", "--columns", "rowwise"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith("| 2 x 128, 128, 256 |")]
    assert len(rows) == 4
    for row in rows:
        bf16_loop, bf16_grouped, rowwise, *others, ours, ratio = row[2:]
        assert bf16_loop == "-" and set(others) == {"-"}, row
        assert rowwise.startswith("NotImplementedError: ") or rowwise == "n/a", row
        assert float(bf16_grouped) > 0 and float(ours) > 0, row
