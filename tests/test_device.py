"""`training.device`: the device a rank trains on. `auto` takes CUDA where torch finds it, else the CPU, but never
the CPU of a job that was given GPUs (the environment says so) and finds none: that stops with one line."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.train import runtime
from megafp8.train.runtime import pick_device
from tests.conftest import REPO, one_per_key, side_by_side, torchrun_env


@pytest.fixture
def no_cuda(monkeypatch):
    """torch without CUDA and an environment without GPU variables (each restored afterwards)."""
    for var in (*(var for var, _ in runtime.NO_GPUS), runtime.EXPECTS_GPUS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return monkeypatch


@pytest.mark.parametrize("var, value", [
    ("CUDA_VISIBLE_DEVICES", "0,1"), ("SLURM_GPUS_ON_NODE", "8"), ("SLURM_JOB_GPUS", "0,1,2,3"),
    ("SLURM_STEP_GPUS", "0"), (runtime.EXPECTS_GPUS, "8"),  # launch/slurm/pretrain.sbatch's default of 8
])
def test_auto_refuses_the_cpu_of_a_job_given_gpus(no_cuda, var, value):
    """A GPU job whose torch finds no CUDA device (a CPU build, a driver that does not load) trained on the CPU
    with a log line only: at that size, nothing for days."""
    no_cuda.setenv(var, value)
    with pytest.raises(ConfigError, match=r"training.device=auto found no CUDA device, but this job was given GPUs "
                                          rf"\({var}={value}.*set training.device=cpu to train on the CPU anyway"):
        pick_device(load_config("tiny_dense"), 0)
    assert pick_device(load_config("tiny_dense", ["training.device=cpu"]), 0).type == "cpu"  # asked for: given


@pytest.mark.parametrize("var, value", [
    ("CUDA_VISIBLE_DEVICES", ""), ("CUDA_VISIBLE_DEVICES", "-1"),
    ("CUDA_VISIBLE_DEVICES", "NoDevFiles"),  # what SLURM sets for a job without GPUs on a node that has some
    ("SLURM_GPUS_ON_NODE", "0"), ("SLURM_JOB_GPUS", "(null)"), ("SLURM_STEP_GPUS", ""),
])
def test_auto_trains_on_the_cpu_where_no_gpu_was_given(no_cuda, var, value):
    no_cuda.setenv(var, value)
    assert pick_device(load_config("tiny_dense"), 0).type == "cpu"


def test_the_sbatch_script_says_when_it_assumed_gpus(no_cuda):
    """The message of pretrain.sbatch's assumption says what to submit instead."""
    no_cuda.setenv(runtime.EXPECTS_GPUS, "8")
    with pytest.raises(ConfigError, match="the job having asked for none \\(submit with --gpus-per-node=N, or set "
                                          "GPUS_PER_NODE to a CPU job's processes per node\\)"):
        pick_device(load_config("tiny_dense"), 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA trains on it")
def test_a_gpu_job_without_cuda_stops_with_one_line(tiny_overrides):
    """Launched as a GPU job of SLURM would be (its GPUs in the environment) on a torch without CUDA: one line and
    exit status 2, before any step; training.device=cpu trains there all the same."""
    def launched(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "launch/pretrain.py"), "--config", "tiny_dense",
                               *one_per_key(tiny_overrides, ["training.steps=2", "training.eval_interval=0"],
                                            list(overrides))],
                              capture_output=True, text=True, timeout=120, cwd=REPO,
                              env={**torchrun_env(), "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "2"})

    refused, on_cpu = side_by_side(launched, lambda: launched("training.device=cpu", "run_name=cpu"))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith(
        "error: training.device=auto found no CUDA device, but this job was given GPUs (CUDA_VISIBLE_DEVICES=0,1; "
        f"SLURM_GPUS_ON_NODE=2): torch {torch.__version__} is a CPU build."), refused.stderr
    assert "step 1/2" not in refused.stdout
    assert on_cpu.returncode == 0 and "step 2/2" in on_cpu.stdout + on_cpu.stderr, on_cpu.stderr[-3000:]
