"""The training-step benchmark runs end to end on CPU (a smoke test: the GPU figures live in docs/benchmarks.md)."""
from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO, torchrun_env


def test_train_step_benchmark_prints_one_row_per_recipe(corpus_dir, tmp_path):
    cmd = [sys.executable, "benchmarks/train_step.py", "training.device=cpu", "--model", "tiny", "--steps", "3",
           "--warmup", "1", "--data", str(corpus_dir), "--out", str(tmp_path), "--recipes", "bf16", "fp8"]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| tiny |")]
    assert [row.split("|")[2].strip() for row in rows] == ["bf16", "fp8"]
    assert rows[0].split("|")[6].strip() == "1.00x"  # BF16 is the yardstick
