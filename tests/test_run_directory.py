"""One run directory holds one run: relaunches resume, other runs are refused, failed starts leave no trace."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

from megafp8.config import ConfigError, load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from megafp8.train.run_history import drop_metrics_after

SHORT = ["training.steps=4", "training.eval_interval=0", "logging.log_interval=1"]
SAVING = SHORT + ["checkpoint.interval=2", "checkpoint.format=full"]


def make_trainer(overrides, extra=()):
    torch.manual_seed(0)
    return Trainer(load_config("tiny_dense", list(overrides) + list(extra)), ParallelDims.single(),
                   torch.device("cpu"))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def metric_steps(run_dir: Path) -> list[int]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if r["kind"] == "train"]


def test_a_relaunch_resumes_and_drops_the_metrics_after_the_checkpoint(tiny_overrides, caplog):
    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    run_dir = first.run_dir
    # As if the run was killed after step 3: its metrics reach past its newest checkpoint (step 2 after a prune).
    drop_metrics_after(first.metrics_path, 3)
    (first.checkpoint_dir / "latest").write_text("step_00000002")
    with caplog.at_level(logging.INFO, logger="megafp8"):
        again = make_trainer(tiny_overrides, SAVING)
    assert again.step == 2
    assert f"resuming {run_dir} from step 2 " in caplog.text and "dropped 1 metric record(s) after step 2" in caplog.text
    again.fit()
    assert metric_steps(run_dir) == [1, 2, 3, 4]  # never spliced


def test_a_relaunch_without_a_checkpoint_starts_over(tiny_overrides, caplog):
    make_trainer(tiny_overrides, SHORT).fit()
    with caplog.at_level(logging.INFO, logger="megafp8"):
        trainer = make_trainer(tiny_overrides, SHORT)
    assert "holds an earlier launch of this run without a checkpoint: starting it over from step 0" in caplog.text
    trainer.fit()
    assert metric_steps(trainer.run_dir) == [1, 2, 3, 4]


def test_a_finished_run_relaunched_says_so(tiny_overrides, caplog):
    make_trainer(tiny_overrides, SAVING).fit()
    trainer = make_trainer(tiny_overrides, SAVING)
    with caplog.at_level(logging.INFO, logger="megafp8"):
        trainer.fit()
    assert "finished at step 4 already: nothing to train (raise training.steps to train further)" in caplog.text


def test_a_longer_relaunch_continues_the_run(tiny_overrides):
    make_trainer(tiny_overrides, SAVING).fit()
    trainer = make_trainer(tiny_overrides, SAVING + ["training.steps=6"])
    assert trainer.step == 4
    trainer.fit()
    assert metric_steps(trainer.run_dir) == [1, 2, 3, 4, 5, 6]


def test_another_config_is_refused_and_leaves_the_directory_as_it_was(tiny_overrides):
    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    before = snapshot(first.run_dir)
    with pytest.raises(ConfigError) as err:
        make_trainer(tiny_overrides, SAVING + ["training.seed=99"])
    assert str(err.value) == (f"{first.run_dir} holds another run (training.seed: 1234 there, 99 here): give this run "
                              "another run_name (to continue from that run's newest checkpoint: checkpoint.resume="
                              f"{first.checkpoint_dir / 'step_00000004'}), or set checkpoint.overwrite=true to "
                              "replace that run")
    with pytest.raises(ConfigError) as err:  # another model: the checkpoint would not load
        make_trainer(tiny_overrides, SAVING + ["model.num_layers=1"])
    assert str(err.value).endswith("(model.num_layers: 2 there, 1 here): give this run another run_name, or set "
                                   "checkpoint.overwrite=true to replace that run")
    assert snapshot(first.run_dir) == before


def test_a_run_directory_that_cannot_be_created_is_one_line(tiny_overrides, tmp_path):
    """A logging.output_dir below a file (or without write permission) ended in mkdir's traceback."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError) as err:
        make_trainer(tiny_overrides, SHORT + [f"logging.output_dir={tmp_path / 'a_file' / 'runs'}"])
    assert str(err.value) == (f"cannot write in {tmp_path / 'a_file' / 'runs' / 't'} (Not a directory): point "
                              "logging.output_dir (or checkpoint.dir) at a directory this run may write")



    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    before = snapshot(first.run_dir)
    with pytest.raises(ConfigError, match=r"checkpoint.resume=none, but .*/checkpoints holds this run's checkpoints "
                                          r"\(newest step_00000004\): leave checkpoint.resume=auto"):
        make_trainer(tiny_overrides, SAVING + ["checkpoint.resume=none"])
    assert snapshot(first.run_dir) == before


@pytest.mark.parametrize("change", [["training.seed=99"], ["checkpoint.resume=none"]])
def test_overwrite_replaces_the_earlier_run(tiny_overrides, change):
    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    stale = first.checkpoint_dir / "step_00000002"
    trainer = make_trainer(tiny_overrides, SAVING + change + ["checkpoint.overwrite=true", "checkpoint.keep_last=0"])
    assert trainer.step == 0 and not stale.exists()
    trainer.fit()
    assert metric_steps(trainer.run_dir) == [1, 2, 3, 4]
    assert sorted(p.name for p in trainer.checkpoint_dir.iterdir()) == ["latest", "step_00000002", "step_00000004"]


def test_a_corrupt_checkpoint_resume_leaves_the_directory_byte_identical(tiny_overrides):
    first = make_trainer(tiny_overrides, SAVING + ["checkpoint.keep_last=1"])
    first.fit()
    state = first.checkpoint_dir / "step_00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # truncated
    before = snapshot(first.run_dir)
    with pytest.raises(ConfigError, match="step_00000004"):
        make_trainer(tiny_overrides, SAVING + ["checkpoint.keep_last=1"])
    assert snapshot(first.run_dir) == before


def test_a_failed_start_in_a_new_run_directory_leaves_nothing(tiny_overrides, tmp_path):
    bad_checkpoint = tmp_path / "elsewhere" / "step_00000001"
    bad_checkpoint.mkdir(parents=True)
    (bad_checkpoint / "state.pt").write_bytes(b"truncated")
    with pytest.raises(ConfigError):
        make_trainer(tiny_overrides, SHORT + ["run_name=bad_resume", f"checkpoint.resume={bad_checkpoint}"])
    with pytest.raises(ConfigError):
        make_trainer(tiny_overrides, SHORT + ["run_name=bad_data", f"data.path={tmp_path / 'missing'}"])
    assert not (tmp_path / "runs").exists()


def _flat_model(model: dict) -> dict:
    """A model section as megafp8 saved it before `attention` and `moe` were sections: every key flat, the other
    attention kind's at their defaults."""
    from megafp8.config import MlaConfig

    attention, moe = model["attention"], model["moe"]
    flat = {k: v for k, v in model.items() if k not in ("attention", "moe")}
    other = {k: v for k, v in dataclasses.asdict(MlaConfig()).items() if k != "kind"}
    return {**flat, **other, **{k: v for k, v in attention.items() if k != "kind"}, "attention": attention["kind"],
            **{f"moe_{k}": v for k, v in moe.items()}}


def test_a_run_saved_before_the_model_sections_relaunches_and_resumes(tiny_overrides, caplog):
    """A run directory and checkpoint of the flat model layout (config.yaml, the checkpoint's config) continue under
    today's: the relaunch is the same run, the resume compares the model settings the tensors do not show, and the
    conversion tools read the model config."""
    from megafp8.checkpoint import load_checkpoint
    from megafp8.checkpoint.convert import model_config_of
    from megafp8.checkpoint.local import find_latest, save_checkpoint
    from megafp8.train.checkpointing import model_setting_changes

    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    config = yaml.safe_load((first.run_dir / "config.yaml").read_text())
    (first.run_dir / "config.yaml").write_text(yaml.safe_dump({**config, "model": _flat_model(config["model"])}))
    newest = find_latest(first.checkpoint_dir)
    state = load_checkpoint(newest)
    state["config"]["model"] = _flat_model(state["config"]["model"])
    save_checkpoint(first.checkpoint_dir, state["step"], state, keep_last=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megafp8"):
        again = make_trainer(tiny_overrides, SAVING + ["training.steps=6"])
    # No warning (info lines pass where an earlier test set the logger to INFO)
    assert again.step == 4 and [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert model_config_of(load_checkpoint(newest)) == again.model_cfg
    current = {**config["model"], "moe": {**config["model"]["moe"], "top_k": 4}}
    assert model_setting_changes(state["config"]["model"], current) == [
        "model.moe.top_k: 2 in the checkpoint, 4 in this run"]
