"""`logging.profile_steps` and `logging.memory_snapshot_steps`: traces of the steps asked for, written per rank where
the run directory says, without changing what the run computes; the allocator history on CUDA
(`tests/test_gpu.py`), said to be unavailable on a CPU."""
from __future__ import annotations

import gzip
import json
import logging

import pytest
import torch

from megafp8.config import ConfigError, load_config
from megafp8.parallel import ParallelDims
from megafp8.train.trainer import Trainer

STEPS = ["training.steps=4", "training.eval_interval=0", "logging.log_interval=1"]


def _fit(overrides: list[str]) -> tuple[Trainer, list[float]]:
    trainer = Trainer(load_config("tiny_dense", overrides + STEPS), ParallelDims.single(), torch.device("cpu"))
    losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
    return trainer, losses


def _step_names(trace_path) -> set[str]:
    events = json.load(gzip.open(trace_path))["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the operators themselves are in it
    return {e["name"] for e in events if e.get("name", "").startswith("megafp8 step ")}


def test_the_steps_asked_for_are_traced_and_the_run_computes_the_same(tiny_overrides, tmp_path):
    trainer, losses = _fit(tiny_overrides + ["logging.profile_steps=[2,3]"])
    where = trainer.run_dir / "profiles" / "steps_2-3"
    assert sorted(p.name for p in where.iterdir()) == ["rank0.top.txt", "rank0.trace.json.gz"]
    assert _step_names(where / "rank0.trace.json.gz") == {"megafp8 step 2", "megafp8 step 3"}
    assert "Self CPU" in (where / "rank0.top.txt").read_text()
    plain = tiny_overrides + [f"logging.output_dir={tmp_path / 'plain'}"]
    assert _fit(plain)[1] == losses


def test_a_trace_that_cannot_be_written_is_said_and_the_run_goes_on(tiny_overrides, caplog):
    trainer = Trainer(load_config("tiny_dense", tiny_overrides + STEPS + ["logging.profile_steps=[1,1]"]),
                      ParallelDims.single(), torch.device("cpu"))
    (trainer.run_dir / "profiles").write_text("a file where the folder would go")
    with caplog.at_level(logging.WARNING, logger="megafp8"):
        records = trainer.fit()
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert "the profile of steps 1-1 could not be written" in caplog.text


def test_a_memory_snapshot_on_a_cpu_run_is_said_to_be_unavailable(tiny_overrides, caplog):
    with caplog.at_level(logging.WARNING, logger="megafp8"):
        trainer, _ = _fit(tiny_overrides + ["logging.memory_snapshot_steps=2"])
    assert "logging.memory_snapshot_steps: the run is on cpu" in caplog.text
    assert not (trainer.run_dir / "profiles").exists()


@pytest.mark.parametrize("setting, message", [
    ("logging.profile_steps=[3,2]", r"logging.profile_steps=\[3, 2\]: give \[first, last\] with 1 <= first <= last "
                                    r"<= training.steps=4"),
    ("logging.profile_steps=[4,5]", r"logging.profile_steps=\[4, 5\]: give \[first, last\]"),
    ("logging.profile_steps=[2]", r"logging.profile_steps=\[2\]: give \[first, last\]"),
    ("logging.memory_snapshot_steps=-1", r"logging.memory_snapshot_steps=-1: give the number of steps to record"),
])
def test_profiling_settings_outside_the_run_are_refused(tiny_overrides, setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_dense", tiny_overrides + STEPS + [setting])
