"""The benchmarks run end to end on CPU as smoke tests (the GPU figures live in docs/benchmarks.md): the training
step and its profile's kernel categories, the plain-PyTorch yardstick, the GEMM tables and the integrity costs. The
interleaved A/B of two trees is tested in test_ab_steps.py, the GPU shell scripts in test_gpu_scripts.py and
test_gpu_e2e_script.py."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, side_by_side, torchrun_env


def run_side_by_side(*cmds: list[str]) -> list[subprocess.CompletedProcess]:
    """Each command's result, as `subprocess.run(cmd, cwd=REPO, env=torchrun_env(), ...)` gives it, the commands run
    two at a time (`side_by_side`): each is one single-threaded process (OMP_NUM_THREADS=1), most of a refused one's
    time spent importing torch."""
    return side_by_side(*(lambda cmd=cmd: subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True,
                                                         text=True, timeout=300) for cmd in cmds))


def test_train_step_benchmark_prints_one_row_per_recipe(corpus_dir, tmp_path):
    cmd = [sys.executable, "benchmarks/train_step.py", "training.device=cpu", "--model", "tiny", "--steps", "3",
           "--warmup", "1", "--data", str(corpus_dir), "--out", str(tmp_path), "--recipes", "bf16", "fp8"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[2].strip() for row in rows] == ["bf16", "fp8"]
    assert rows[0].split("|")[6].strip() == "1.00x"  # BF16 is the yardstick
    assert all(float(row.split("|")[13]) > 0 for row in rows)  # the planner's prediction beside the measurement


def test_train_step_benchmark_leaves_every_warmup_step_out_of_the_timing(corpus_dir, tmp_path):
    """`--warmup` steps are all left out, however few steps that leaves to time: cut to `--steps` less one
    `--log-interval`, `--steps 3 --warmup 1` (log interval 5) had no warm-up at all, its first step (compilation on a
    GPU) timed. A `--warmup` that leaves no step to time is one clear error, before any run."""
    common = [sys.executable, "benchmarks/train_step.py", "training.device=cpu", "--model", "tiny", "--data",
              str(corpus_dir), "--recipes", "bf16"]
    timed, refused = run_side_by_side(common + ["--steps", "3", "--warmup", "1", "--out", str(tmp_path / "a")],
                                      common + ["--steps", "4", "--warmup", "4", "--out", str(tmp_path / "b")])
    assert timed.returncode == 0, timed.stderr[-3000:]
    assert "3 steps from step 1" in timed.stderr  # the timed loop starts after the one warm-up step
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].endswith(
        "error: --warmup 4 leaves none of --steps 4 to time: give more --steps")


def test_train_step_benchmark_counts_the_timed_steps_skipped(corpus_dir, tmp_path):
    """A timed step skipped for non-finite gradients is no training step (an FP16 step its loss scaler skips leaves
    out the optimizer), yet its row read as any other: FP16 from a loss scale of 1e12, every step skipped, printed a
    tokens/s with nothing beside it. The row's last column counts them, and a warning names the run."""
    cmd = [sys.executable, "benchmarks/train_step.py", "training.device=cpu", "precision.loss_scale_initial=1e12",
           "--model", "tiny", "--steps", "3", "--warmup", "1", "--log-interval", "1", "--data", str(corpus_dir),
           "--out", str(tmp_path), "--recipes", "fp16"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    header = next(line for line in result.stdout.splitlines() if line.startswith("| model |"))
    row = next(line for line in result.stdout.splitlines() if line.startswith("| tiny |"))
    cells = dict(zip(header.split("|"), row.split("|")))
    assert cells[" skipped steps, timed "].strip() == "2", row  # steps 2 and 3
    assert "warning: 2 of the fp16 run's timed steps skipped" in result.stderr


def test_train_step_benchmark_prints_the_pipeline_schedules_bubble(corpus_dir, tmp_path):
    """Two gloo ranks at PP=2 under DualPipeV with 8 micro-batches: the column before the last is the bubble the
    schedule's actions imply (what the training loop's start-up line logs). The config's own global batch (16) would
    give DualPipeV too few micro-batches of 8: the layout is checked against `--global-batch` (job AO's ~1B DualPipeV
    run failed on this)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "benchmarks/train_step.py", "training.device=cpu", "parallel.pp=2", "parallel.pp_schedule=dualpipev",
           "model.num_layers=4", "training.micro_batch_size=8", "--model", "tiny", "--steps", "3", "--warmup", "1",
           "--log-interval", "1", "--global-batch", "64", "--data", str(corpus_dir), "--out", str(tmp_path), "--recipes", "bf16"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = re.search(r"pipeline: dualpipev over 2 ranks, 8 micro-batches, bubble (\d+\.\d)%", result.stderr)
    row = next(line for line in result.stdout.splitlines() if line.startswith("| tiny |"))
    assert logged and row.split("|")[-3].strip() == f"{logged.group(1)}%", (logged, row)


def test_train_step_benchmark_runs_context_parallel_ranks(corpus_dir, tmp_path):
    """Two gloo ranks sharing each sequence (`parallel.cp=2`, `gpu_e2e.sh cp_2gpu`'s layout): the table's row, with
    the planner's memory for a rank's share."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "benchmarks/train_step.py", "training.device=cpu", "parallel.cp=2", "--model", "tiny", "--steps", "3",
           "--warmup", "1", "--log-interval", "1", "--global-batch", "4", "--data", str(corpus_dir), "--out",
           str(tmp_path), "--recipes", "bf16"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cp 2" in result.stderr
    assert any(line.startswith("| tiny |") for line in result.stdout.splitlines()), result.stdout


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
        ("adamw_update_kernel", 60.0),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
         "TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, 2, float, float>>", 80.0),
        ("_combine_kernel", 30.0), ("_combine_backward_kernel", 20.0), ("_gather_sum_kernel", 10.0),
        ("void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel<...>", 4.0),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", 6.0),
        ("_row_stats_kernel", 14.0), ("_logits_grad_kernel", 26.0),  # megafp8.parallel.cross_entropy's
    ]
    rows = kb.breakdown(kernels, steps=2)
    by_name = {category: ms for category, ms, _ in rows}
    assert by_name == pytest.approx({
        "GEMM": 3.0, "FP8 quantization, standalone (Triton)": 0.5, "attention (SDPA/flash)": 0.4,
        "FP8 producers quantizing their output (RMSNorm, SwiGLU)": 0.35, "communication (NCCL)": 0.15,
        "element-wise (eager)": 0.3, "torch.compile fused kernels": 0.25, "optimizer (AdamW)": 0.23,
        "gradient norm and clipping (foreach)": 0.04, "MoE routing and permutation": 0.035, "copies / casts": 0.1,
        "cross-entropy / softmax": 0.02, "other": 0.05})
    assert [ms for _, ms, _ in rows] == sorted((ms for _, ms, _ in rows), reverse=True)
    assert abs(sum(share for _, _, share in rows) - 1.0) < 1e-9
    table = kb.markdown("t", rows, wall_ms=6.0, top=kb.top_kernels(kernels, steps=2, count=2))
    assert "GPU kernel time per step 5.4 ms (90% busy)" in table and "| `_quantize_rows_cols_kernel`" not in table


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
    assert [row[1] for row in rows] == ["fprop", "dgrad", "wgrad", "wgrad into main_grad", "wgrad, FP32 out"]
    for row in rows:
        bf16_loop, bf16_grouped, rowwise, blockwise, *our_kernels, x_blocks, peer, ours, ratio = row[2:]
        # pointer, TMA, ws 128 and 256 by TMA and register epilogues, ws 256 with interleaved FFMAs
        assert our_kernels == ["RuntimeError: our Triton kernels need a CUDA GPU"] * 7, row
        # the wgrads with x^T in 128x128 blocks: a column of the wgrad rows only
        assert x_blocks == ("n/a" if row[1] in ("fprop", "dgrad") else our_kernels[0]), row
        # DeepGEMM, a peer: no BF16-out or written-over wgrad; elsewhere it says why it cannot run without DeepGEMM
        if row[1] in ("wgrad", "wgrad, FP32 out"):
            assert peer == "n/a", row
        else:
            assert peer.startswith("ImportError: DeepGEMM is not importable here"), row
        assert min(float(bf16_loop), float(bf16_grouped), float(ours)) > 0, row
        if row[1] in ("wgrad into main_grad", "wgrad, FP32 out"):
            assert rowwise == blockwise == "n/a", row
        else:
            assert rowwise.startswith("NotImplementedError: ") and "'CPU' backend" in rowwise, row
            assert blockwise.startswith("ConfigError: the cublas backend needs a CUDA GPU"), row
        assert float(ratio.removesuffix("x")) == pytest.approx(float(ours) / float(bf16_grouped), rel=0.05, abs=0.01)


def test_dense_gemm_benchmark_prints_each_gemm_of_each_linear_or_why_not():
    """benchmarks/dense_gemm.py runs its table on CPU (`--device cpu`, the reference backend's GEMMs): fprop, dgrad
    and wgrad per linear, each output checked before it is timed; the warp-specialized columns say why they cannot
    run, and the ratio columns compare the best FP8 column with the backend's and with BF16."""
    cmd = [sys.executable, "benchmarks/dense_gemm.py", "--device", "cpu", "--backend", "reference", "--tokens", "128",
           "--shapes", "256,384", "--iters", "1"]
    scripts = ("dense_gemm.py", "grouped_gemm.py")  # CUDA graphs need the GPU
    result, bad_shapes, *no_graphs = run_side_by_side(
        cmd, [*cmd[:-4], "--shapes", "256x384"],
        *([sys.executable, f"benchmarks/{script}", "--device", "cpu", "--cuda-graphs"] for script in scripts))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "| BF16 | reference backend | ws 128 | ws 256 | ws 256, registers | ws 256, interleaved FFMA | ws 256, " \
        "interleaved FFMA, GROUP_M 16 | ws 256, interleaved FFMA, GROUP_M 32 | ws 256, x in 128x128 blocks | " \
        "DeepGEMM |" in lines[2]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line.startswith("| --shapes |")]
    assert [row[1:4] for row in rows] == [["linear (256 x 384)", "128", gemm] for gemm in ("fprop", "dgrad", "wgrad")]
    for row in rows:
        bf16, ours, *ws, x_blocks, peer, vs_backend, vs_bf16 = row[4:]
        assert ws == ["RuntimeError: the warp-specialized kernel needs an SM90 GPU"] * 6, row
        assert x_blocks == ("n/a" if row[3] != "wgrad" else ws[0]), row  # the wgrad with x^T in 128x128 blocks
        assert peer.startswith("ImportError: DeepGEMM is not importable here"), row  # a peer, left out of the ratios
        ms_bf16, ms_ours = (float(cell.split("(")[1].rstrip(")")) for cell in (bf16, ours))
        assert vs_backend == "1.00x", row
        assert float(vs_bf16.removesuffix("x")) == pytest.approx(ms_bf16 / ms_ours, rel=0.05, abs=0.01), row
    assert bad_shapes.returncode == 2 and "--shapes takes N,K pairs" in bad_shapes.stderr
    for script, bad in zip(scripts, no_graphs):
        assert bad.returncode == 2 and "--cuda-graphs needs --device cuda" in bad.stderr, (script, bad.stderr)


def test_dense_gemm_benchmark_refuses_a_shape_that_is_not_two_numbers():
    """`--shapes 256` (N without K) printed the table's header, then a traceback (a tuple unpacked into three); now
    it is one clear parser error, as a word was."""
    cmd = [sys.executable, "benchmarks/dense_gemm.py", "--device", "cpu", "--backend", "reference", "--shapes"]
    for shape in run_side_by_side(cmd + ["256"], cmd + ["256,256,256"]):
        assert shape.returncode == 2 and "Traceback" not in shape.stderr, shape.stderr[-2000:]
        assert "error: --shapes takes N,K pairs of integers" in shape.stderr.strip().splitlines()[-1]


def test_wgrad_scaling_study_compares_the_two_scalings_of_x_on_each_distribution():
    """benchmarks/wgrad_scaling.py (the accuracy study behind `precision.fp8_wgrad_input_blocks`): a row per
    distribution with each scaling's dW error against FP64; on i.i.d. Gaussian x the blocks cost (almost) nothing,
    on x with token outliers they cost more than on any other row; sizes that are not whole tiles are refused."""
    cmd = [sys.executable, "benchmarks/wgrad_scaling.py", "--tokens", "1024", "--features", "256", "--outputs", "256"]
    result, bad = run_side_by_side(cmd, cmd[:2] + ["--tokens", "1000"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {cells[0]: cells[1:] for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line
            for cells in [[c.strip() for c in line.split("|")[1:-1]]] if cells[0] != "x"}
    assert len(rows) == 5
    ratios = {name: float(cells[2].removesuffix("x")) for name, cells in rows.items()}
    for name, (recipe, blocks, _, tensorwise) in rows.items():
        assert 0.01 < float(recipe) < 0.06 and 0.01 < float(blocks) < 0.06 and float(tensorwise) > 0.01, name
    assert ratios["gaussian"] == pytest.approx(1.0, abs=0.05)
    assert max(ratios, key=ratios.get).startswith("token outliers"), ratios
    assert bad.returncode == 2 and "--tokens must be a multiple of 128" in bad.stderr


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


def test_grouped_gemm_benchmark_measures_only_the_columns_asked_for():
    """`--columns` keeps a bounded GPU job to the kernels under study: the other columns print '-', while BF16
    `_grouped_mm` and the backend's default (the ratio's two) always run; `--gemms` keeps it to the rows asked for."""
    cmd = [sys.executable, "benchmarks/grouped_gemm.py", "--device", "cpu", "--backend", "reference", "--shapes",
           "2x128,128,256", "--iters", "1", "--gemms", "fp32", "fprop", "--columns", "rowwise"]
    result, unknown_column = run_side_by_side(cmd, cmd[:-1] + ["ROWWISE", "nosuch"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines()
            if line.startswith("| 2 x 128, 128, 256 |")]
    assert [row[1] for row in rows] == ["fprop", "wgrad, FP32 out"]
    for row in rows:
        bf16_loop, bf16_grouped, rowwise, *others, ours, ratio = row[2:]
        assert bf16_loop == "-" and set(others) == {"-"}, row
        assert rowwise.startswith("NotImplementedError: ") or rowwise == "n/a", row
        assert float(bf16_grouped) > 0 and float(ours) > 0, row
    assert unknown_column.returncode == 2 and "--columns nosuch: no column's label contains it" in unknown_column.stderr


def test_launch_cost_times_each_piece_in_windows_and_reports_the_median_and_the_lowest():
    """`fp8_launch_cost.per_call_us`: a warm-up, then `windows` windows of calls / windows calls each, each ended by a
    sync; the median window and the lowest, per call (a stand-in fn whose calls take 1 ms in one window only)."""
    import importlib.util
    import time
    spec = importlib.util.spec_from_file_location("fp8_launch_cost", REPO / "benchmarks" / "fp8_launch_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls, syncs = [], []

    def fn():
        calls.append(len(syncs))
        if len(syncs) == 3:  # the third window (after the warm-up's sync and two windows' syncs)
            time.sleep(0.001)
    median, lowest = module.per_call_us(fn, calls=40, windows=4, sync=lambda: syncs.append(1))
    assert len(calls) == 50 + 40 and len(syncs) == 1 + 4
    assert lowest <= median < 500 and lowest < 100  # the slow window neither the median nor the lowest


def test_grouped_replay_names_each_call_keeps_copies_and_counts_its_flops():
    """`benchmarks/grouped_replay.py`'s recorder (the GPU part needs CUDA and Triton): around a stand-in kernels
    module it passes each call through, names calls per kind and shape in call order (numbering afresh each step),
    keeps copies only while asked (the replay must not see the step's later writes), and restores the module."""
    import types

    import torch
    sys.path.insert(0, str(REPO / "benchmarks"))
    import grouped_replay

    calls = []
    kernels = types.SimpleNamespace(grouped_wgrad=lambda *args, **kwargs: calls.append(("wgrad", args, kwargs)),
                                    grouped_gemm=lambda *args, **kwargs: calls.append(("gemm", args, kwargs)))
    original = (kernels.grouped_wgrad, kernels.grouped_gemm)
    recorder = grouped_replay.Recorder(kernels)
    recorder.install()
    at, bt = torch.zeros(256, 512), torch.zeros(128, 512)  # (N, Mp), (K, Mp): 2 experts, 4 tiles of 128 rows
    start, count = torch.tensor([0, 2]), torch.tensor([3, 1])
    main_grad = torch.zeros(2, 256, 128)
    x, w, tile_expert = torch.zeros(512, 256), torch.zeros(2, 384, 256), torch.tensor([0, 1, 1, -1])
    for step in range(2):
        recorder.start_step()
        recorder.keeping = step == 1
        kernels.grouped_wgrad(at, torch.ones(256, 4), bt, torch.ones(128, 4), start, count, torch.float32,
                              accumulate=main_grad)
        kernels.grouped_gemm(x, torch.ones(512, 2), w, torch.ones(2, 3, 2), tile_expert, torch.bfloat16, kernel="ws")
        kernels.grouped_gemm(x, torch.ones(512, 2), w, torch.ones(2, 3, 2), tile_expert, torch.bfloat16, kernel="ws")
    recorder.uninstall()
    assert (kernels.grouped_wgrad, kernels.grouped_gemm) == original and len(calls) == 6
    assert calls[0][2]["accumulate"] is main_grad  # the step's own call adds into the real main_grad
    names = [name for name, _, _ in recorder.kept]
    assert names == ["replay:wgrad 2x256x128 #1", "replay:fprop/dgrad 2x512x256x384 #1",
                     "replay:fprop/dgrad 2x512x256x384 #2"]
    _, kind, (function, args, kwargs) = recorder.kept[0]
    assert function is original[0] and kind == "wgrad"
    assert kwargs["accumulate"] is not main_grad and torch.equal(kwargs["accumulate"], main_grad)
    assert args[0] is not at and args[5] is not count and args[5].tolist() == [3, 1]
    main_grad.add_(1.0)  # the step goes on writing: the kept copies do not follow
    assert not kwargs["accumulate"].any()
    assert grouped_replay.flops("wgrad", args) == 2.0 * 4 * 128 * 256 * 128
    assert grouped_replay.flops("fprop/dgrad", recorder.kept[1][2][1]) == 2.0 * 3 * 128 * 256 * 384


def test_health_cost_times_sampled_steps_against_plain_ones(corpus_dir, tmp_path):
    """`benchmarks/health_cost.py` on the tiny model (CPU, uncompiled): steps are logged one by one, the sampled ones
    (0-based steps that are multiples of the interval: records 4 and 7 of 2 + 6 timed steps at interval 3) are told
    from the plain ones, and the table gives both medians and the share a sample adds at the default interval."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import health_cost
    assert [s for s in range(1, 11) if health_cost.sampled(s, 3)] == [1, 4, 7, 10]
    records = [{"step": s, "step_time_s": 0.5 if health_cost.sampled(s, 3) else 0.1} for s in range(3, 9)]
    table = health_cost.step_table(records, 3)
    assert "| 100.0 (4 steps) | 500.0 (2 steps) | 400.0 | 4.00% |" in table
    with pytest.raises(SystemExit, match="no sampled step"):
        health_cost.step_table(records[2:3], 3)
    cmd = [sys.executable, "benchmarks/health_cost.py", "--model", "tiny", "--interval", "3", "--steps", "8",
           "--warmup", "2", "--data", str(corpus_dir), "training.device=cpu", "training.compile=false"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    row = result.stdout.strip().splitlines()[-1]
    assert re.search(r"\(4 steps\) \| [\d.]+ \(2 steps\)", row), result.stdout


def test_train_step_refuses_srun_tasks_without_torchrun_as_pretrain_does(monkeypatch, capsys):
    """`srun -n 2 python benchmarks/train_step.py` would start two lone rank-0 runs; like launch/pretrain.py, the
    benchmark stops first (status 2, one line from the step's first task) and starts no process group."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import train_step

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PTY_PORT"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
                       "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(train_step, "init_distributed", lambda cfg: pytest.fail("a process group was started"))
    assert train_step.main(["training.device=cpu", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: srun started this process as one of 2 tasks") and err.count("\n") == 1, err


def test_train_step_s_rates_all_come_from_the_one_median_step_time():
    """Four windows (an even count): tokens/s, TFLOP/s and MFU are each the work of a step over the median step time
    (0.25 s here), so they stand in one ratio; the median of the records' own rates put TFLOP/s 4% above it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import train_step

    records = [{"step_time_s": t, "tflops_per_device": 100.0 / t, "mfu": 0.1 / t} for t in (0.1, 0.2, 0.3, 0.4)]
    columns = train_step.timing_columns(records, tokens_per_step=1000)
    assert columns["step_s"] == pytest.approx(0.25) and columns["tokens_per_s"] == pytest.approx(4000)
    assert columns["tflops"] == pytest.approx(400) and columns["mfu"] == pytest.approx(0.4)
    assert train_step.timing_columns([{**r, "mfu": None} for r in records], 1000)["mfu"] is None


def test_train_step_names_the_health_samples_its_memory_columns_would_count():
    """A health-sampled step (every `logging.fp8_health_interval`-th, eager) in the timed window, or as the last
    warm-up step (after which the held memory is measured), sets FP8's memory columns: `sampled_steps` finds them.
    The MoE balanced part's 210 warm-up steps keep step 200's sample out; 200 did not (jobs FV-FW)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import train_step
    assert train_step.sampled_steps(199, 230, 100) == [200]
    assert train_step.sampled_steps(209, 240, 100) == []
    assert train_step.sampled_steps(0, 30, 100) == [0]
    assert train_step.sampled_steps(9, 30, 0) == []


def test_the_gather_l2_model_reads_the_source_once_walking_token_blocks_first():
    """benchmarks/gather_l2_model.py on a small expert layout (512 tokens x 1,024 BF16, top-2 of 8 experts): walking
    the token blocks first, an L2 half the source's size still reads each source line from HBM once; walking each
    block's features first reads nearly all of it twice (once per expert); with L2 larger than everything both read
    the source once. (`expert_layout_index`: every token in top_k rows, experts padded to 128, the layout at its
    bound.)"""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gather_l2_model as model
    index = model.expert_layout_index(512, 8, 2)
    assert index.numel() == (512 * 2 + 8 * 127) // 128 * 128
    assert sorted(index[index >= 0].tolist()) == sorted(list(range(512)) * 2)
    source = 512 * 1024 * 2
    small, large = source // 2, 64 * source
    assert model.source_bytes_from_hbm(index, 1024, True, small) == source
    assert model.source_bytes_from_hbm(index, 1024, False, small) > 1.5 * source
    assert model.source_bytes_from_hbm(index, 1024, False, large) == source


def test_the_gemm_l2_model_walks_every_tile_once_and_reads_operands_once_when_they_fit():
    """`gather_l2_model.py --gemms`: the tile order of `ws_tiles.tile_coords` (groups of GROUP_M row tiles, a
    partial last group) visits every output tile once; with L2 holding both operands each is read from HBM once,
    and with a small L2 larger groups reread the wide operand less."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gather_l2_model as model
    for group_m in (1, 3, 8):
        tiles = list(model.gemm_tile_order(10, 7, group_m))
        assert sorted(tiles) == [(m, n) for m in range(10) for n in range(7)]
        assert [m for m, _ in tiles[:group_m]] == list(range(min(group_m, 10)))  # row tiles fastest in a group
    m, n, k = 128 * 16, 256 * 12, 512
    assert model.gemm_bytes_from_hbm(m, n, k, 8, 1 << 30, programs=8) == (m + n) * k
    small = 8 * 256 * k
    assert model.gemm_bytes_from_hbm(m, n, k, 16, small, programs=8) < model.gemm_bytes_from_hbm(m, n, k, 2, small,
                                                                                                 programs=8)


def test_the_grouped_wgrad_walk_model_deals_every_busy_tile_once_and_evens_out_a_collapsed_router():
    """benchmarks/grouped_wgrad_walk.py's model of the grouped wgrad's persistent programs: both walks give the
    programs every busy expert's K steps once; with every expert busy they are the same walk; with 13 of 64 busy
    (the MoE step's collapsed router) and 64 tiles an expert, expert order leaves the busiest program well above the
    mean and the compact walk nearly even; and the routing it draws has the step's rows, busy experts and heaviest
    expert."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import grouped_wgrad_walk as walk
    counts = walk.collapsed_counts(13, seed=3)
    assert int(counts.sum()) == walk.ROWS and int((counts > 0).sum()) == 13 and int(counts.max()) == walk.HEAVY_ROWS
    steps = sum(-(-int(c) // 128) for c in counts)
    for compact in (False, True):
        assert sum(walk.program_steps(counts, 64, 132, compact)) == 64 * steps
    even = walk.torch.full((64,), 2048, dtype=walk.torch.long)
    assert walk.program_steps(even, 64, 132, True) == walk.program_steps(even, 64, 132, False)
    spread = walk.imbalance(walk.program_steps(counts, 64, 132, False))
    compact = walk.imbalance(walk.program_steps(counts, 64, 132, True))
    assert spread > 1.15 and compact < 1.17 and compact < spread, (spread, compact)
    walk.main(["--model-only"])  # the table prints without a GPU


def test_reference_moe_matches_each_token_through_its_chosen_experts():
    """The MoE yardstick's permutation into padded expert groups, grouped GEMMs and weighted combine equal a loop
    over each token's chosen experts; its group-limited routing picks experts of the best groups only."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import reference_model as rm
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    moe = rm.MoE(hidden=32, experts=8, top_k=2, ffn=16, shared=1, groups=4, topk_groups=2)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe.align = 8
    y = torch.randn(3, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the benchmark runs it (the shared expert's linears)
        out = moe(y).float()
        shared = moe.shared(y.reshape(-1, 32).to(torch.bfloat16)).float()
    x = y.reshape(-1, 32).to(torch.bfloat16)
    chosen, weights = moe.route(x)
    e = moe.experts
    expected = torch.zeros(15, 32)
    for t in range(15):
        for j in range(2):
            i = int(chosen[t, j])
            w1, w3, w2 = (w[i].to(torch.bfloat16) for w in (e.w1, e.w3, e.w2))
            h = torch.nn.functional.silu(x[t] @ w1.T) * (x[t] @ w3.T)
            expected[t] += (h @ w2.T).float() * float(weights[t, j].to(torch.bfloat16))
    expected += shared
    error = (out.reshape(15, 32) - expected).abs().max()
    assert error < 0.05 * expected.abs().max(), error
    groups = chosen // 2  # 4 groups of 2 experts: a token's two experts come from at most 2 groups
    assert all(len(set(g.tolist())) <= 2 for g in groups)
    assert int(moe.load.sum()) == 30 and moe.load.shape == (8,)
