"""GPU checks (skipped without CUDA): the loop on one GPU; NCCL data, tensor, expert and pipeline parallelism
on two."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from tests.conftest import REPO, steps_never_wait_for_the_gpu, torchrun_env

pytestmark = pytest.mark.gpu


def test_training_on_cuda_learns(tiny_overrides):
    cfg = load_config("tiny_dense", tiny_overrides + ["training.device=auto", "training.steps=12"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0))
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert all(shard.master.dtype == torch.float32 and shard.master.is_cuda for shard in trainer.optimizer.shards)
    losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 1.0, losses


def test_a_profiled_cuda_run_traces_kernels_and_writes_the_allocator_history(tiny_overrides):
    """`logging.profile_steps` on CUDA: the trace holds the steps' kernels and the own-time table is by device time;
    `logging.memory_snapshot_steps`: the allocator's history of the first steps, a snapshot memory_viz reads (its
    segments and the allocations' trace, with Python frames)."""
    import gzip
    import pickle

    cfg = load_config("tiny_dense", tiny_overrides + ["training.steps=4", "training.eval_interval=0",
                                                      "logging.profile_steps=[3,4]", "logging.memory_snapshot_steps=2"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0))
    trainer.fit()
    traced = trainer.run_dir / "profiles" / "steps_3-4"
    events = json.load(gzip.open(traced / "rank0.trace.json.gz"))["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert {e["name"] for e in events if e.get("name", "").startswith("megafp8 step")} == {"megafp8 step 3",
                                                                                          "megafp8 step 4"}
    assert "Self CUDA" in (traced / "rank0.top.txt").read_text()
    snapshot = pickle.loads((trainer.run_dir / "profiles" / "memory_rank0.pickle").read_bytes())
    assert snapshot["segments"] and snapshot["device_traces"][0]
    assert any(entry.get("frames") for entry in snapshot["device_traces"][0])


@pytest.mark.parametrize("worker_thread", [False, True])
def test_backward_runs_on_the_training_loops_thread_unless_configured(tiny_overrides, worker_thread):
    """On CUDA, autograd runs backward on its device worker thread unless told otherwise: the training step tells it
    to stay on the loop's own thread (`training.backward_on_worker_thread: false`, the default)."""
    import threading
    cfg = load_config("tiny_dense", tiny_overrides + [
        "training.steps=1", "optimizer.warmup_steps=1", "training.eval_interval=0",
        f"training.backward_on_worker_thread={str(worker_thread).lower()}"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0))
    threads = []
    trainer.model.layers[0].mlp_norm.weight.register_hook(lambda g: threads.append(threading.get_ident()))
    trainer.train_step()
    assert threads and all((t != threading.get_ident()) == worker_thread for t in threads), threads


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_dense_fp8_training_step_never_makes_the_host_wait(tiny_overrides, compiled):
    """No host synchronization inside a dense FP8 step (four micro-batches: batch copies, FP8 linears, gradient
    buffers, clipping, the optimizer): the loss and grad norm reach the host only when the loop logs them."""
    cfg = load_config("tiny_dense_fp8", tiny_overrides + ["training.device=auto", f"training.compile={compiled}"])
    # Step 0 (FP8 health is sampled: blocks run uncompiled) autotunes kernels, step 1 compiles.
    steps_never_wait_for_the_gpu(Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0)))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_use_nccl_and_match_one_gpu(tiny_overrides, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "launch" / "pretrain.py"), "--config", "tiny_dense", *tiny_overrides, "training.device=cuda"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=torchrun_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "initialized nccl with 2 ranks on cuda" in result.stdout + result.stderr
    lines = (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
    two = [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]
    cfg = load_config("tiny_dense", tiny_overrides + [f"logging.output_dir={tmp_path / 'one'}"])
    one = [r["loss"] for r in Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0)).fit() if r["kind"] == "train"]
    assert two[0] == pytest.approx(one[0], rel=1e-3)
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=5e-3, atol=0)


def _two_gpus_match_one(config: str, tiny_overrides: list[str], model: list[str], layout: list[str], tmp_path,
                        expect_log: str = "") -> None:
    """A 2-GPU NCCL run of `config` with the `layout` overrides against the same run on one GPU: per-step losses
    to 5e-3 and gradient norms to 3e-2 relative."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "launch" / "pretrain.py"), "--config", config, *tiny_overrides, *model, *layout]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=torchrun_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert expect_log in result.stdout + result.stderr
    lines = (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
    two = [(r["loss"], r["grad_norm"]) for r in map(json.loads, lines) if r["kind"] == "train"]
    cfg = load_config(config, tiny_overrides + model + [f"logging.output_dir={tmp_path / 'one'}"])
    one = [(r["loss"], r["grad_norm"]) for r in Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0)).fit()
           if r["kind"] == "train"]
    assert len(two) == len(one) > 0
    torch.testing.assert_close(torch.tensor(two)[:, 0], torch.tensor(one)[:, 0], rtol=5e-3, atol=0)
    torch.testing.assert_close(torch.tensor(two)[:, 1], torch.tensor(one)[:, 1], rtol=3e-2, atol=0)


WIDE_HEADS = ["model.num_heads=2", "model.attention.num_kv_heads=2", "model.attention.head_dim=128",
              "model.vocab_size=512", "training.device=cuda"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("recipe, compiled", [("bf16", False), ("fp8", False), ("fp8", True)],
                         ids=["bf16", "fp8", "fp8_compiled"])
def test_tensor_parallel_on_two_gpus_matches_one_gpu(tiny_overrides, tmp_path, recipe, compiled):
    """TP=2 with sequence parallelism over NCCL (FP8: FP8-byte all-gathers, cuBLAS GEMMs) against TP=1 (eager);
    compiled, the FP8 layers' collectives are traced into the blocks' graphs."""
    _two_gpus_match_one("tiny_dense", tiny_overrides, WIDE_HEADS + ["model.ffn_hidden_size=512",
                                                                    f"precision.recipe={recipe}"],
                        ["parallel.tp=2", "parallel.sequence_parallel=true"]
                        + (["training.compile=true"] if compiled else []), tmp_path, "tp 2 x dp 1")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "dualpipev"])
def test_pipeline_on_two_gpus_matches_one_gpu(tiny_overrides, tmp_path, schedule):
    """PP=2 over NCCL, FP8 (cuBLAS/Triton; deferred FP8 weight gradients under the zero-bubble schedules)."""
    _two_gpus_match_one("tiny_dense", tiny_overrides, WIDE_HEADS + ["model.num_layers=4", "precision.recipe=fp8"],
                        ["parallel.pp=2", f"parallel.pp_schedule={schedule}"], tmp_path, "pipeline: " + schedule)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("recipe, compiled", [("bf16", False), ("fp8", True)], ids=["bf16", "fp8_compiled"])
def test_context_parallel_on_two_gpus_matches_one_gpu(tiny_overrides, tmp_path, recipe, compiled):
    """CP=2 over NCCL: each GPU half of each sequence, the keys and values gathered, FlashAttention-2 from the
    bottom right (compiled: the gather and the kernels inside the blocks' graphs) against one GPU."""
    _two_gpus_match_one("tiny_dense", tiny_overrides, WIDE_HEADS + [f"precision.recipe={recipe}"],
                        ["parallel.cp=2"] + (["training.compile=true"] if compiled else []), tmp_path, "cp 2")


def test_moe_layer_on_cuda_matches_the_cpu_reference():
    """FP8 MoE layer (cuBLAS expert GEMMs, Triton quantizers) against the same layer on CPU (reference backend)."""
    from megafp8.config import ModelConfig, MoeConfig
    from megafp8.model import init_weights
    from megafp8.model.moe import MoE
    from megafp8.parallel import ExpertParallel, TensorParallel
    from megafp8.precision import PrecisionRecipe

    cfg = ModelConfig(hidden_size=256, num_heads=2, moe=MoeConfig(num_experts=8, top_k=2, ffn_hidden_size=256,
                                                                  num_shared_experts=1, first_dense_layers=0))
    outputs = {}
    for device in ("cpu", "cuda"):
        moe = MoE(cfg.moe, cfg.hidden_size, PrecisionRecipe.from_name("fp8"), TensorParallel.single(),
                  ExpertParallel.single(), device=device)
        init_weights(moe, cfg, seed=0)
        x = torch.randn(300, 256, generator=torch.Generator().manual_seed(1)).bfloat16().to(device).requires_grad_()
        y, _ = moe(x, batch=3, seq_len=100)
        y.float().square().sum().backward()
        outputs[device] = (y.float().cpu(), x.grad.float().cpu(), moe.experts.down_proj.weight.grad.float().cpu())
    (y_cpu, dx_cpu, dw_cpu), (y_gpu, dx_gpu, dw_gpu) = outputs["cpu"], outputs["cuda"]
    for cpu, gpu in ((y_cpu, y_gpu), (dx_cpu, dx_gpu)):
        assert (cpu - gpu).abs().max() <= 2**-5 * cpu.abs().max()
    # The weight gradient sums FP8-quantized dy over tokens: GEMM summation order on the two devices can flip an
    # FP8 rounding of dy (one E4M3 step is 6%), so compare it as a whole rather than element by element.
    assert (dw_cpu - dw_gpu).norm() <= 2**-5 * dw_cpu.norm()  # we see 1.8%


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_expert_parallel_on_two_gpus_matches_one_gpu(tiny_overrides, tmp_path):
    """EP=2 over NCCL (uneven all-to-all, FP8 dispatch) against one GPU, on the tiny MoE config."""
    _two_gpus_match_one("tiny_moe_fp8", tiny_overrides, WIDE_HEADS + ["model.moe.ffn_hidden_size=128",
                                                                      "parallel.ep_dispatch_fp8=true"],
                        ["parallel.ep=2"], tmp_path)


def test_mla_moe_mtp_model_trains_on_cuda(tiny_overrides):
    """configs/tiny_mla_moe_mtp_fp8.yaml (made smaller) on one GPU: cuBLAS/Triton FP8 projections, grouped FP8
    experts, the BF16 kv_a of MLA, one MTP depth."""
    gqa_free = [o for o in tiny_overrides if not o.startswith("model.attention.")]  # the tiny model's kv heads
    cfg = load_config("tiny_mla_moe_mtp_fp8", gqa_free + ["training.device=cuda", "training.steps=12",
                                                           "training.eval_interval=0", "optimizer.warmup_steps=2"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0))
    losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_sharded_checkpoint_from_two_gpus_resumes_on_one(tiny_overrides, tmp_path):
    """PP=2 x NCCL writes a sharded checkpoint in the background (its collectives on a gloo group); one GPU resumes
    it and continues the run as the two-GPU run did."""
    model = WIDE_HEADS + ["model.num_layers=4", "precision.recipe=bf16", f"checkpoint.dir={tmp_path / 'ck'}",
                          "checkpoint.interval=3", "checkpoint.async_save=true", "training.eval_interval=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "launch" / "pretrain.py"), "--config", "tiny_dense", *tiny_overrides, *model, "parallel.pp=2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=torchrun_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
    two = [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]
    assert sorted(p.name for p in (tmp_path / "ck" / "step_00000006").glob("*.distcp")) == ["__0_0.distcp",
                                                                                            "__1_0.distcp"]
    import shutil

    shutil.rmtree(tmp_path / "ck" / "step_00000006")
    (tmp_path / "ck" / "latest").write_text("step_00000003\n")
    cfg = load_config("tiny_dense", tiny_overrides + model + [f"logging.output_dir={tmp_path / 'one'}"])
    resumed = Trainer(cfg, ParallelDims.single(), torch.device("cuda", 0))
    assert resumed.step == 3
    one = [r["loss"] for r in resumed.fit() if r["kind"] == "train"]
    torch.testing.assert_close(torch.tensor(one), torch.tensor(two[3:]), rtol=5e-3, atol=0)
