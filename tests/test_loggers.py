"""Experiment logging backends: the JSON-lines file, TensorBoard event files and an offline W&B run."""
from __future__ import annotations

import json

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from megafp8.train.loggers import flatten


def test_flatten_names_nested_numeric_fields():
    record = {"loss": 1.5, "mfu": None, "note": "x", "layers": {"a.b": {"input": {"snr_db": 31.0}}}, "ok": True}
    assert flatten(record, "fp8_health/") == {"fp8_health/loss": 1.5, "fp8_health/layers/a.b/input/snr_db": 31.0}


def run(tiny_overrides, backends, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config("tiny_dense_fp8", tiny_overrides + [
        "training.steps=3", f"logging.backends=[{', '.join(backends)}]", "logging.fp8_health_interval=2",
        f"logging.output_dir={tmp_path}", "run_name=r"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    return records, [r["loss"] for r in records if r["kind"] == "train"]


def test_tensorboard_event_file_holds_the_scalars(tiny_overrides, monkeypatch, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, losses = run(tiny_overrides, ["jsonl", "tensorboard"], monkeypatch, tmp_path)
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "train/loss" in scalars and "eval/val_loss" in scalars
    assert "fp8_health/layers/layers.0.mlp.down_proj/grad/snr_db" in scalars
    logged = events.Scalars("train/loss")
    assert [e.step for e in logged] == [1, 2, 3]
    assert [e.value for e in logged] == pytest.approx(losses, rel=1e-6)
    assert "run/git_commit/text_summary" in events.Tags()["tensors"]


def test_wandb_runs_offline_without_a_key_and_records_the_metrics(tiny_overrides, monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    records, losses = run(tiny_overrides, ["jsonl", "wandb"], monkeypatch, tmp_path)
    runs = list((tmp_path / "r" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # The run file is W&B's binary record log; metric names and their JSON-encoded values are stored as text.
    raw = runs[0].read_bytes()
    assert b"train/loss" in raw and b"fp8_health/layers/layers.0.attn.qkv_proj/input/underflow" in raw
    assert all(json.dumps(loss).encode() in raw for loss in losses)
    assert records[0]["kind"] == "run" and records[0]["git_commit"].encode()[:12] in raw


def test_a_missing_logging_package_is_a_clear_error(tiny_overrides, monkeypatch, tmp_path):
    import builtins
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    cfg = load_config("tiny_dense", tiny_overrides + ["logging.backends=[wandb]", f"logging.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="'wandb' but the wandb package is missing: pip install wandb"):
        Trainer(cfg, ParallelDims.single(), torch.device("cpu"))


def test_unknown_backend_is_rejected():
    with pytest.raises(ConfigError, match=r"logging.backends\[1\]: 'tensorbord' is not one of .* \(did you mean 'tensorboard'\?\)"):
        load_config("tiny_dense", ["logging.backends=[jsonl, tensorbord]"])


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA GH200 480GB", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0), ("NVIDIA H20", None),
    ("Tesla V100-SXM2-32GB", None)])
def test_mfu_takes_the_peak_of_the_card_named_not_of_a_name_inside_it(name, peak):
    """Matched as substrings, "L4" gave the L40 the L4's peak (its MFU 1.5x too high) and "H100" gave the H100 NVL
    the SXM card's; an unknown card (the H20, a V100) has no MFU rather than another card's."""
    from megafp8.train.metrics import peak_of

    assert peak_of(name) == peak
