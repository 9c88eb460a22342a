"""`training.deterministic`: repeatable runs. On the CPU a deterministic run trains exactly as a plain one (the CPU is
deterministic already, so this shows the mode changes no numerics and that nothing reads memory it did not write:
the mode fills fresh tensors with NaN); on a GPU two deterministic runs log the same losses bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megafp8.config import ConfigError
from megafp8.train.runtime import DETERMINISM_PARTS, set_determinism
from tests.conftest import REPO, torchrun_env

PRETRAIN = str(REPO / "launch" / "pretrain.py")


def _losses(tiny_overrides, tmp_path, name: str, *extra: str) -> tuple[list[tuple[str, int, float]], str]:
    """(kind, step, loss or validation loss) of a tiny FP8 MoE run in its own process, and its log."""
    cmd = [sys.executable, PRETRAIN, "--config", "tiny_moe_fp8", *tiny_overrides, f"run_name={name}",
           "training.steps=4", "training.eval_interval=4", *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=torchrun_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["kind"], r["step"], r.get("loss", r.get("val_loss"))) for r in records
              if r["kind"] in ("train", "eval")]
    return losses, result.stdout + result.stderr


def test_a_deterministic_run_trains_exactly_as_a_plain_one_on_the_cpu(tiny_overrides, tmp_path):
    # The two runs side by side (each one process of one thread, in its own run directory; the CI machine has two
    # cores): nothing of one reaches the other.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda extra: _losses(tiny_overrides, tmp_path, *extra),
                        [("plain",), ("deterministic", "training.deterministic=true")])
        (plain, _), (deterministic, log) = runs
    assert "deterministic: torch's deterministic algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8" in log, log[-2000:]
    assert len(plain) == 5 and deterministic == plain  # four steps and the evaluation, to the bit


def test_a_cublas_workspace_that_is_not_fixed_is_refused_before_anything_changes(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ConfigError, match="CUBLAS_WORKSPACE_CONFIG=:0:0: unset it"):
        set_determinism(True)
    assert not torch.are_deterministic_algorithms_enabled()
    set_determinism(False)  # off: nothing is read or set
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("part", DETERMINISM_PARTS)
def test_each_part_of_the_mode_sets_its_own_settings_and_no_other(monkeypatch, part):
    """`set_determinism`'s parts (what `determinism.py --only` runs alone to find which one a run needs): each sets
    its own settings and leaves the others as they were; `algorithms` brings the fixed cuBLAS workspace (torch
    refuses cuBLAS matmuls under deterministic algorithms without one)."""
    import torch._inductor.config as inductor_config
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    with inductor_config.patch(deterministic=False):  # (a config module: restored on leaving)
        try:
            set_determinism(True, (part,))
            state = {"cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8",
                     "cudnn": torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark,
                     "inductor": inductor_config.deterministic,
                     "algorithms": torch.are_deterministic_algorithms_enabled()}
        finally:
            torch.use_deterministic_algorithms(False)
    assert {name for name, on in state.items() if on} == {part} | ({"cublas"} if part == "algorithms" else set())
    with pytest.raises(ValueError, match="determinism parts \\['cuda'\\]: choose among cublas, cudnn"):
        set_determinism(True, ("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", ["false", "true"], ids=["eager", "compiled"])
def test_two_deterministic_gpu_runs_log_the_same_losses(tiny_overrides, tmp_path, compiled):
    """At a sequence long enough for attention's backward to split its keys (512)."""
    runs = [_losses(tiny_overrides, tmp_path, f"gpu_{compiled}_{i}", "training.deterministic=true",
                    "data.seq_len=512", f"training.compile={compiled}")[0] for i in range(2)]
    assert runs[0] == runs[1], runs


def test_the_probe_compares_first_gradients_bit_for_bit_by_parameter_group():
    """benchmarks/determinism.py's comparison: a parameter whose gradient differs in one bit counts (0.0 against
    -0.0 too), layer indices fold into groups, differing groups come first; NaNs of the same bits are equal."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from determinism import compare_gradients, first_difference, group_of, index_spans

    assert group_of("layers.12.mlp.experts.gate_up_proj") == "layers.*.mlp.experts.gate_up_proj"
    a = {"embed.weight": torch.tensor([1.0, float("nan")]), "layers.0.attn.w": torch.tensor([2.0, 0.0]),
         "layers.1.attn.w": torch.tensor([4.0, 1.0])}
    b = {"embed.weight": torch.tensor([1.0, float("nan")]), "layers.0.attn.w": torch.tensor([2.0, -0.0]),
         "layers.1.attn.w": torch.tensor([4.0, torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()])}
    rows = compare_gradients(a, b)
    assert [row[:3] for row in rows] == [("layers.*.attn.w", 2, 2), ("embed.weight", 1, 0)]
    assert [row[4] for row in rows] == ["0-1", "-"]
    assert rows[0][3] == pytest.approx(2.0 ** -23 / 4.0)
    with pytest.raises(ValueError, match="other parameters"):
        compare_gradients(a, {"embed.weight": a["embed.weight"]})
    assert first_difference([3.0, 2.0, 1.0], [3.0, 2.5, 1.0]) == 2 and first_difference([1.0], [1.0]) is None
    assert index_spans(["7", "0", "1", "2", "5"]) == "0-2, 5, 7" and index_spans([]) == "-"
    assert index_spans(["3.12", "3.40"]) == "3.12, 3.40"
    assert index_spans([str(i) for i in range(0, 40, 2)], most=3) == "0, 2, 4, ... (17 more)"


@pytest.mark.parametrize("mode, heading", [(["--deterministic"], "### fp8, training.deterministic"),
                                           (["--only", "cudnn", "inductor"],
                                            "### fp8, deterministic parts: cudnn, inductor")], ids=["mode", "parts"])
def test_the_probe_runs_twice_and_reports_on_the_cpu(tmp_path, mode, heading):
    """On the CPU (deterministic already) the two runs agree everywhere; here under `--deterministic`, the mode's
    path through the probe (set for the whole process before anything runs), and under two of its parts alone."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "determinism.py"), "--model", "tiny", "--steps", "2",
           "--data", str(tmp_path / "data"), "training.device=cpu", "--recipes", "fp8", *mode]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=torchrun_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert heading in result.stdout
    assert "- first step's gradients: 0 of 15 parameters differ between the two runs" in result.stdout, result.stdout
    assert "- losses: the same at every one of 2 steps" in result.stdout
    assert "| `layers.*.attn.qkv_proj.weight` | 2 | 0 | 0.00e+00 | - |" in result.stdout
