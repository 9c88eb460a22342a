"""The FP8 sensitivity tool flags a layer made outlier-heavy on purpose and passes the others."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megafp8.config import load_config
from megafp8.train.sensitivity import analyze, format_table, model_and_batches
from tests.conftest import REPO, torchrun_env


def test_outlier_heavy_layer_is_flagged_and_the_rest_pass(tiny_overrides):
    cfg = load_config("tiny_dense", tiny_overrides)
    torch.manual_seed(0)
    model, batches = model_and_batches(cfg, None, 2, torch.device("cpu"))
    # A "massive activation": channel 5 of layers.1's attention input is 1e5x larger than the rest, but the
    # QKV weights ignore it (column zeroed), as models do with such channels. BF16 is unaffected; per-tile FP8
    # scales each 1x128 tile to that channel and flushes its other 127 values.
    with torch.no_grad():
        model.layers[1].attn_norm.weight[5] = 1e5
        model.layers[1].attn.qkv_proj.weight[:, 5] = 0.0
    results = {r.name: r for r in analyze(model, batches)}
    flagged = results.pop("layers.1.attn.qkv_proj")
    assert flagged.verdict == "keep BF16" and flagged.output_snr_db < 22  # measured 20.2 dB; the others ~28.5
    assert all(r.verdict == "FP8" and r.output_snr_db > 25 for r in results.values()), format_table(
        list(results.values()), 25, 0.005)
    assert all(not m.runs_fp8 for m in model.modules() if hasattr(m, "runs_fp8"))  # the model is left in BF16


def test_command_line_writes_table_json_and_plot(tiny_overrides, tmp_path):
    cmd = [sys.executable, "tools/fp8_sensitivity.py", "--config", "tiny_dense", "--batches", "1",
           "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png"), *tiny_overrides]
    result = subprocess.run(cmd, cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| layers.0.attn.qkv_proj |" in result.stdout and "verdict: FP8 if every SNR >= 25 dB" in result.stdout
    rows = json.loads((tmp_path / "s.json").read_text())
    assert len(rows) == 8 and {r["verdict"] for r in rows} <= {"FP8", "keep BF16"}
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--batches", "0"], "argument --batches: 0 must be at least 1"),  # was IndexError's traceback
    (["--json", "{missing}/x.json"], "--json {missing}/x.json: the directory {missing} does not exist"),  # failed
    (["--plot", "{missing}/x.png"], "--plot {missing}/x.png: the directory {missing} does not exist")])  # after it
def test_bad_arguments_are_refused_before_the_analysis(tmp_path, capsys, args, message):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from fp8_sensitivity import main
    finally:
        sys.path.remove(str(REPO / "tools"))
    missing = tmp_path / "missing"
    with pytest.raises(SystemExit):
        main(["--config", "tiny_dense", *(a.format(missing=missing) for a in args)])
    assert message.format(missing=missing) in capsys.readouterr().err
