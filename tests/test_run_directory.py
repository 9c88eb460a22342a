"""One run directory holds one run: relaunches resume, other runs are refused, failed starts leave no trace."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from megafp8.config import ConfigError, load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from megafp8.train.run_history import drop_metrics_after
from tests.conftest import REPO, one_per_key, torchrun_env

SHORT = ["training.steps=4", "training.eval_interval=0", "logging.log_interval=1"]
SAVING = SHORT + ["checkpoint.interval=2", "checkpoint.format=full"]


def make_trainer(overrides, extra=()):
    torch.manual_seed(0)
    return Trainer(load_config("tiny_dense", list(overrides) + list(extra)), ParallelDims.single(),
                   torch.device("cpu"))


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def metric_steps(run_dir: Path, name: str = "metrics.jsonl") -> list[int]:
    lines = [json.loads(x) for x in (run_dir / name).read_text().splitlines()]
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
    assert f"resuming {run_dir} from step 2 " in caplog.text and "dropped 1 metric record(s) after step 2 (kept in " \
        "metrics.dropped.jsonl)" in caplog.text
    again.fit()
    assert metric_steps(run_dir) == [1, 2, 3, 4]  # never spliced
    # the records taken out are kept beside it, in the order they were dropped (they were deleted: the history a run
    # went back from, a loss spike say, was lost)
    assert metric_steps(run_dir, "metrics.dropped.jsonl") == [4, 3]
    # an append killed midway leaves a line without its end: the next one's first record starts a line of its own
    (run_dir / "metrics.dropped.jsonl").write_text('{"kind": "train", "step": 4}\n{"kind": "tr')
    drop_metrics_after(first.metrics_path, 3)
    assert (run_dir / "metrics.dropped.jsonl").read_text().splitlines()[2].startswith('{"kind": "train", "step": 4')


def test_records_a_killed_drop_kept_aside_already_are_not_kept_aside_twice(tmp_path):
    """A drop appends the records to metrics.dropped.jsonl, then rewrites metrics.jsonl: killed between the two, the
    relaunch after found them in both and appended them again, so the records a run went back from read twice."""
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "loss": 5.0 - s}) for s in (1, 2, 3, 4)]
    metrics.write_text("".join(line + "\n" for line in lines))
    assert drop_metrics_after(metrics, 2) == 2
    metrics.write_text("".join(line + "\n" for line in lines))  # as if killed before the rewrite
    assert drop_metrics_after(metrics, 2) == 2
    assert metric_steps(tmp_path) == [1, 2] and metric_steps(tmp_path, "metrics.dropped.jsonl") == [3, 4]
    metrics.write_text("".join(line + "\n" for line in lines[:3]))  # a later launch's own records past step 2
    drop_metrics_after(metrics, 2)
    assert metric_steps(tmp_path, "metrics.dropped.jsonl") == [3, 4, 3]


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
    assert caplog.messages[-1].endswith("nothing to train (raise training.steps to train further)")  # after the
    # start-up lines, where it is read (it came before the model's)


def test_a_longer_relaunch_continues_the_run(tiny_overrides):
    make_trainer(tiny_overrides, SAVING).fit()
    trainer = make_trainer(tiny_overrides, SAVING + ["training.steps=6"])
    assert trainer.step == 4
    trainer.fit()
    assert metric_steps(trainer.run_dir) == [1, 2, 3, 4, 5, 6]


def test_a_relaunch_may_retune_the_gradient_buckets(tiny_overrides):
    """`optimizer.bucket_size_mb` and `optimizer.overlap_grad_reduce` group and schedule the same reductions: a
    relaunch that changes them resumes (it was refused as another run); one that changes the moments' precision,
    which rounds them, is still refused."""
    make_trainer(tiny_overrides, SAVING).fit()
    tuned = make_trainer(tiny_overrides, SAVING + ["training.steps=6", "optimizer.bucket_size_mb=1",
                                                   "optimizer.overlap_grad_reduce=false"])
    assert tuned.step == 4
    with pytest.raises(ConfigError, match=r"holds another run \(optimizer.moment_dtype: fp32 there, bf16 here\)"):
        make_trainer(tiny_overrides, SAVING + ["training.steps=6", "optimizer.moment_dtype=bf16"])


def test_a_relaunch_may_turn_determinism_on(tiny_overrides):
    """`training.deterministic` fixes the order of sums that otherwise varies run to run (the same arithmetic): a run
    whose later steps need repeating can continue under it."""
    make_trainer(tiny_overrides, SAVING).fit()
    assert make_trainer(tiny_overrides, SAVING + ["training.steps=6", "training.deterministic=true"]).step == 4


def test_a_relaunch_of_a_run_started_from_a_checkpoint_continues_from_its_own(tiny_overrides, caplog):
    """A run started from another run's checkpoint (`checkpoint.resume=PATH`, as docs/checkpoints.md starts one from
    an imported checkpoint) and relaunched with the same config (a requeue) went back to PATH: it dropped its
    metrics after PATH's step and retrained, overwriting its own checkpoints."""
    first = make_trainer(tiny_overrides, SAVING + ["run_name=first", "training.steps=2"])
    first.fit()
    stage = SAVING + ["run_name=stage", "training.steps=6", f"checkpoint.resume={first.checkpoint_dir / 'step_00000002'}"]
    run = make_trainer(tiny_overrides, stage)
    assert run.step == 2  # the first launch starts from PATH
    for _ in range(2):
        run.train_step()
    run.save()  # then the job is requeued
    with caplog.at_level(logging.WARNING, logger="megafp8"):
        again = make_trainer(tiny_overrides, stage)
    assert again.step == 4
    assert "this run started from it and has checkpoints of its own since" in caplog.text


def test_going_back_to_an_earlier_checkpoint_holds_across_relaunches(tiny_overrides):
    """`checkpoint.resume=PATH` of one of the run's own earlier checkpoints goes back to it; a relaunch of that
    launch continues the new branch once it saved, and goes back to PATH again until then."""
    first = make_trainer(tiny_overrides, SAVING + ["checkpoint.keep_last=0"])
    first.fit()
    back = SAVING + ["checkpoint.keep_last=0", f"checkpoint.resume={first.checkpoint_dir / 'step_00000002'}"]
    assert make_trainer(tiny_overrides, back).step == 2  # killed before it saved
    branch = make_trainer(tiny_overrides, back)
    assert branch.step == 2
    branch.train_step()
    branch.save()  # step 3 of the new branch (the old one's step 4 is still there)
    assert make_trainer(tiny_overrides, back).step == 3


def test_a_checkpoint_saved_under_other_settings_is_not_resumed_without_a_word(tiny_overrides, tmp_path, caplog):
    """Runs sharing a checkpoint.dir: a run of another run_name has no config.yaml to compare, and `auto` resumed
    the other run's newest checkpoint under its own global batch (another data position per step, another
    gradient scale) without a word, then saved and pruned in that run's directory."""
    shared = SAVING + [f"checkpoint.dir={tmp_path / 'shared'}"]
    make_trainer(tiny_overrides, shared).fit()
    before = snapshot(tmp_path / "shared")
    with pytest.raises(ConfigError, match=r"step_00000004 was saved under other settings than this run's "
                                          r"\(training.global_batch_size: 8 there, 16 here\): resume it with the "
                                          r"settings it was saved with"):
        make_trainer(tiny_overrides, shared + ["run_name=other", "training.global_batch_size=16"])
    assert snapshot(tmp_path / "shared") == before and not (tmp_path / "runs" / "other").exists()
    assert make_trainer(tiny_overrides, shared + ["run_name=same_settings"]).step == 4  # same settings: resumes
    # A checkpoint named by checkpoint.resume may start a run of other settings: they are named.
    named = [f"checkpoint.resume={tmp_path / 'shared' / 'step_00000004'}", "run_name=named",
             "training.global_batch_size=16"]
    with caplog.at_level(logging.WARNING, logger="megafp8"):
        assert make_trainer(tiny_overrides, SAVING + named).step == 4
    assert "under settings other than it was saved with (training.global_batch_size: 8 there, 16 here)" in caplog.text


def test_a_stage_of_another_batch_counts_the_tokens_its_steps_read(tiny_overrides):
    """A run started from a checkpoint under another global batch (or data.seq_len) logged consumed_tokens as its step
    x its own tokens a step, as if every earlier step had read as many: 5120 at step 5 for 4 x 8 x 64 + 16 x 64."""
    from megafp8.train.state import TrainState

    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    named = SAVING + ["run_name=stage", "training.steps=6", "training.global_batch_size=16",
                      f"checkpoint.resume={first.checkpoint_dir / 'step_00000004'}"]
    stage = make_trainer(tiny_overrides, named)
    stage.fit()
    records = [json.loads(x) for x in stage.metrics_path.read_text().splitlines()]
    assert [(r["step"], r["consumed_tokens"]) for r in records if r["kind"] == "train"] == [(5, 3072), (6, 4096)]
    assert make_trainer(tiny_overrides, named).state.consumed_tokens == 4096  # a relaunch continues the count
    # A checkpoint written before the count was kept: its steps read its own global batch x data.seq_len.
    older = TrainState(tokens_per_step=16 * 64)
    older.load_state_dict({"step": 4, "config": {"training": {"global_batch_size": 8}, "data": {"seq_len": 64}}})
    assert older.consumed_tokens == 4 * 8 * 64
    older.load_state_dict({"step": 0})  # an import: no config, no steps
    assert older.consumed_tokens == 0


def test_a_config_yaml_write_cut_short_leaves_the_earlier_one(tiny_overrides):
    """config.yaml is how a relaunch knows its run: written in place, a write cut short (the disk full, here a
    file-size limit) left a truncated one, so the next launch saw "another run" and was told to overwrite it."""
    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    config = first.run_dir / "config.yaml"
    before = config.read_bytes()
    script = f"""
import resource, signal
from pathlib import Path
from megafp8.train.run_history import record_launch
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))  # no file may grow past 1000 bytes
try:
    record_launch(Path({str(first.run_dir)!r}), Path({str(first.checkpoint_dir)!r}), Path({str(first.metrics_path)!r}),
                  4, False, None, {before.decode()!r} + "# " + "x" * 4000 + "\\n")
except OSError as err:
    print("write failed:", err)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=torchrun_env(),
                            cwd=REPO, timeout=120)
    assert "write failed: [Errno 27] File too large" in result.stdout, result.stdout + result.stderr
    assert config.read_bytes() == before
    assert make_trainer(tiny_overrides, SAVING).step == 4


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
    named = first.checkpoint_dir / "step_00000004"  # a launch naming that checkpoint already: told only what it lacks
    with pytest.raises(ConfigError) as err:
        make_trainer(tiny_overrides, SAVING + ["training.seed=99", f"checkpoint.resume={named}"])
    assert str(err.value).endswith("(training.seed: 1234 there, 99 here): give this run another run_name, or set "
                                   "checkpoint.overwrite=true to replace that run")
    assert snapshot(first.run_dir) == before


def test_a_run_directory_that_cannot_be_created_is_one_line(tiny_overrides, tmp_path):
    """A logging.output_dir below a file (or without write permission) ended in mkdir's traceback."""
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError) as err:
        make_trainer(tiny_overrides, SHORT + [f"logging.output_dir={tmp_path / 'a_file' / 'runs'}"])
    assert str(err.value) == (f"cannot write in {tmp_path / 'a_file' / 'runs' / 't'} (Not a directory): point "
                              "logging.output_dir (or checkpoint.dir) at a directory this run may write")


def test_resume_none_over_checkpoints_is_refused(tiny_overrides):
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
    shutil.copytree(stale, first.checkpoint_dir / "step_00000003.abandoned")  # a branch it went back from
    (first.run_dir / "metrics.dropped.jsonl").write_text('{"kind": "train", "step": 3}\n')
    trainer = make_trainer(tiny_overrides, SAVING + change + ["checkpoint.overwrite=true", "checkpoint.keep_last=0"])
    assert trainer.step == 0 and not stale.exists()
    assert not (first.checkpoint_dir / "step_00000003.abandoned").exists()
    assert not (first.run_dir / "metrics.dropped.jsonl").exists()
    trainer.fit()
    assert metric_steps(trainer.run_dir) == [1, 2, 3, 4]
    assert sorted(p.name for p in trainer.checkpoint_dir.iterdir()) == [".lock", "latest", "step_00000002",
                                                                        "step_00000004"]  # (its own lock)


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
    from megafp8.config import MlaConfig, ModelConfig

    attention, moe = model["attention"], model["moe"]
    flat = {k: v for k, v in model.items() if k not in ("attention", "moe")}
    then = set(ModelConfig.moved)  # the flat keys of that layout (settings added since were in no flat config)
    other = {k: v for k, v in dataclasses.asdict(MlaConfig()).items() if k != "kind" and k in then}
    return {**flat, **other, **{k: v for k, v in attention.items() if k != "kind" and k in then},
            "attention": attention["kind"], **{f"moe_{k}": v for k, v in moe.items() if f"moe_{k}" in then}}


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
    # No warning but the longer schedule's (info lines pass where an earlier test set the logger to INFO)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert again.step == 4 and [w for w in warnings if "the learning rate goes from" not in w] == []
    assert model_config_of(load_checkpoint(newest)) == again.model_cfg
    current = {**config["model"], "moe": {**config["model"]["moe"], "top_k": 4}}
    assert model_setting_changes(state["config"]["model"], current) == [
        "model.moe.top_k: 2 in the checkpoint, 4 in this run"]


def test_a_run_of_a_version_before_a_new_setting_relaunches_as_the_same_run(tiny_overrides):
    """A setting added since a run was launched is absent from its config.yaml; it counts as its default (the
    behaviour that version had). Compared as `None there`, every run directory of the earlier version was
    "another run" after an upgrade (model.attention.qk_norm: None there, False here)."""
    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    config = yaml.safe_load((first.run_dir / "config.yaml").read_text())
    del config["model"]["attention"]["qk_norm"]
    (first.run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    assert make_trainer(tiny_overrides, SAVING + ["training.steps=6"]).step == 4
    with pytest.raises(ConfigError, match=r"holds another run \(model.attention.qk_norm: False there, True here\)"):
        make_trainer(tiny_overrides, SAVING + ["model.attention.qk_norm=true"])


def test_a_relaunch_whose_checkpoint_dir_moved_without_its_checkpoints_is_refused(tiny_overrides, tmp_path):
    """checkpoint.dir may change between launches, but a relaunch pointed at a new one that holds no checkpoint,
    while the earlier launch's still holds the run's, started the run over from step 0 with an info line and
    dropped every metric record after step 0."""
    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    before, moved = snapshot(first.run_dir), tmp_path / "moved"
    with pytest.raises(ConfigError, match=rf"checkpoint.dir is {moved}, which holds no checkpoint, but this run's "
                                          rf"earlier launch saved them in {first.checkpoint_dir} \(newest "
                                          r"step_00000004\): set checkpoint.dir back to it"):
        make_trainer(tiny_overrides, SAVING + [f"checkpoint.dir={moved}"])
    assert snapshot(first.run_dir) == before and not any(moved.glob("step_*"))
    over = make_trainer(tiny_overrides, SAVING + [f"checkpoint.dir={moved}", "checkpoint.overwrite=true"])
    assert over.step == 0 and (first.checkpoint_dir / "step_00000004").is_dir()  # left where it was
    named = f"checkpoint.resume={first.checkpoint_dir / 'step_00000004'}"
    assert make_trainer(tiny_overrides, SAVING + [f"checkpoint.dir={moved}", named]).step == 4


def test_a_relaunch_whose_checkpoint_dir_vanished_is_refused_not_started_over(tiny_overrides, tmp_path):
    """The checkpoint directory gone or empty (a file system not mounted, the directory moved or deleted) after the
    run logged steps it saved checkpoints at: the relaunch started the run over from step 0 with an info line and
    dropped every metric record after step 0. A run whose saves failed leaves the directory and its lock file: that
    run still starts over."""
    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    first.checkpoint_dir.rename(tmp_path / "elsewhere")
    before = snapshot(first.run_dir)
    with pytest.raises(ConfigError, match=rf"the earlier launch of this run logged up to step 4, saving a checkpoint "
                                          rf"every 2 steps, but its checkpoint directory {first.checkpoint_dir} is "
                                          r"gone or empty \(a file system not mounted, or the directory moved or "
                                          r"deleted\?\): bring it back"):
        make_trainer(tiny_overrides, SAVING)
    assert snapshot(first.run_dir) == before and metric_steps(first.run_dir) == [1, 2, 3, 4]
    first.checkpoint_dir.mkdir()  # an empty mount point, the file system not mounted on it
    with pytest.raises(ConfigError, match="is gone or empty"):
        make_trainer(tiny_overrides, SAVING)
    first.checkpoint_dir.rmdir()
    (tmp_path / "elsewhere").rename(first.checkpoint_dir)
    assert make_trainer(tiny_overrides, SAVING).step == 4
    for checkpoint in first.checkpoint_dir.glob("step_*"):  # as a run whose saves all failed leaves it
        checkpoint.rename(tmp_path / checkpoint.name)
    assert make_trainer(tiny_overrides, SAVING).step == 0
    (tmp_path / "gone").mkdir()
    first.checkpoint_dir.rename(tmp_path / "gone" / "checkpoints")
    assert make_trainer(tiny_overrides, SAVING + ["checkpoint.overwrite=true"]).step == 0


def test_a_relaunch_whose_checkpoints_moved_with_their_dir_resumes(tiny_overrides, tmp_path):
    first = make_trainer(tiny_overrides, SAVING)
    first.fit()
    moved = tmp_path / "moved"
    first.checkpoint_dir.rename(moved)
    relaunch = make_trainer(tiny_overrides, SAVING + [f"checkpoint.dir={moved}", "training.steps=6"])
    assert relaunch.step == 4
    relaunch.fit()
    # The next relaunch compares with the moved dir (recorded in config.yaml), given relative to the working directory.
    again = make_trainer(tiny_overrides, SAVING + [f"checkpoint.dir={os.path.relpath(moved)}", "training.steps=6"])
    assert again.step == 6 and metric_steps(relaunch.run_dir) == [1, 2, 3, 4, 5, 6]


def test_a_longer_relaunch_says_where_the_learning_rate_changes(tiny_overrides, caplog):
    """training.steps may change between launches, but the cosine, linear and WSD schedules depend on it: a finished
    cosine run extended from 4 to 6 steps resumed at a learning rate back up from min_lr without a word."""
    from megafp8.optim import lr_at

    make_trainer(tiny_overrides, SAVING).fit()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megafp8"):
        longer = make_trainer(tiny_overrides, SAVING + ["training.steps=6"])
    before, now = lr_at(4, longer.cfg.optimizer, 4), lr_at(4, longer.cfg.optimizer, 6)
    assert now > 2 * before  # min_lr at the end of the 4-step schedule
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and (f"step 4: the learning rate goes from {before:.4g}, the schedule the checkpoint was "
                                   f"saved with, to {now:.4g} (training.steps: 4 there, 6 here)") in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megafp8"):  # the same schedule: no word
        assert make_trainer(tiny_overrides, SAVING).step == 4
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_schedule_change_is_told_only_where_it_moves_the_resumed_learning_rate():
    from megafp8.train.checkpointing import schedule_change_warning

    def config(steps: int, **optimizer) -> dict:
        return {"optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "decay_style": "wsd", **optimizer},
                "training": {"steps": steps}}
    assert schedule_change_warning(config(100), config(200), 10, 10) is None  # WSD's stable phase in both
    assert "training.steps: 100 there, 200 here" in schedule_change_warning(config(100), config(200), 90, 90)
    assert "optimizer.decay_style: wsd there, cosine here" in schedule_change_warning(
        config(100), config(100, decay_style="cosine"), 10, 10)
    assert schedule_change_warning({"training": {"steps": 100}}, config(100), 90, 90) is None  # saved lacks them


# ------------------------------------------------------------------------------ --evaluate


def _evaluate(overrides, capsys, *options: str) -> tuple[int, str, str]:
    from megafp8.train.main import main
    status = main(["--config", "tiny_dense", "--evaluate", *options, *one_per_key(overrides)])
    out, err = capsys.readouterr()
    return status, out, err


def test_evaluate_gives_a_checkpoints_validation_loss_and_writes_nothing(tiny_overrides, capsys):
    """`--evaluate` loads the run's newest checkpoint (or the one checkpoint.resume names) and gives the loss the run
    logged at that step, on the same held-out micro-batches; the run directory is left byte for byte as it was (no
    launch recorded, no metric dropped, no lock file), even where the run evaluates nowhere itself."""
    evaluating = SAVING + ["training.eval_interval=2", "training.eval_iters=2"]
    trainer = make_trainer(tiny_overrides, evaluating)
    trainer.fit()
    logged = {r["step"]: r["val_loss"] for r in map(json.loads, trainer.metrics_path.read_text().splitlines())
              if r["kind"] == "eval"}
    before = snapshot(trainer.run_dir)
    for extra, step in ((["training.eval_interval=0"], 4), ([f"checkpoint.resume={trainer.checkpoint_dir}/step_00000002"], 2)):
        status, out, _ = _evaluate(tiny_overrides + SAVING + ["training.eval_iters=2"] + extra, capsys)
        assert status == 0
        record = json.loads(out.strip().splitlines()[-1])
        assert record["step"] == step and record["checkpoint"].endswith(f"step_0000000{step}")
        assert record["val_loss"] == pytest.approx(logged[step], rel=1e-6)
    assert snapshot(trainer.run_dir) == before


def test_evaluate_at_the_fp8_start_step_runs_as_the_runs_own_evaluation_there(tiny_overrides, capsys):
    """With `precision.fp8_start_step: N`, the run evaluates step N before its switch to FP8 (at the start of step
    N + 1), in BF16; `--evaluate` of step N's checkpoint converted the model to FP8 as a resume does, and gave
    another loss than the one logged. Each checkpoint's evaluation now gives the logged loss, before and after."""
    fp8 = ["precision.recipe=fp8", "precision.fp8_backend=reference", "precision.fp8_start_step=2",
           "training.eval_iters=2"]
    trainer = make_trainer(tiny_overrides, SAVING + fp8 + ["training.eval_interval=2"])
    trainer.fit()
    logged = {r["step"]: r["val_loss"] for r in map(json.loads, trainer.metrics_path.read_text().splitlines())
              if r["kind"] == "eval"}
    assert logged.keys() == {2, 4}
    for step in (2, 4):
        status, out, _ = _evaluate(tiny_overrides + SAVING + fp8 +
                                   [f"checkpoint.resume={trainer.checkpoint_dir}/step_{step:08d}"], capsys)
        assert status == 0
        assert json.loads(out.strip().splitlines()[-1])["val_loss"] == pytest.approx(logged[step], rel=1e-6), step


def test_a_dry_run_of_evaluate_names_the_checkpoint_and_checks_it_without_reading_it(tiny_overrides, tmp_path,
                                                                                     monkeypatch, capsys):
    """`--dry-run --evaluate` printed the training plan alone: not which checkpoint the evaluation would load, nor
    that there was none to load. It finds the one `--evaluate` would, checks it complete from its manifest (no file
    hashed, no tensor read), and refuses where `--evaluate` would, in its one line, with nothing printed before."""
    import megafp8.train.resume as resume

    trainer = make_trainer(tiny_overrides, SAVING)
    trainer.fit()
    step2 = trainer.checkpoint_dir / "step_00000002"
    (step2 / "state.pt").unlink()  # a checkpoint that lost a file
    before = snapshot(tmp_path)
    monkeypatch.setattr(resume, "first_problem", lambda *args: pytest.fail("the dry run verified a checkpoint"))
    evaluating = tiny_overrides + SAVING + ["training.eval_iters=2"]
    status, out, _ = _evaluate(evaluating, capsys, "--dry-run")
    assert status == 0 and "| part | parameters |" in out, out  # the plan, then what the evaluation would do
    assert out.endswith(f"\n\n--evaluate: would load {trainer.checkpoint_dir / 'step_00000004'} (complete; its "
                        "checksums are verified as it loads) and evaluate it on training.eval_iters=2 held-out "
                        "micro-batches of data.valid_split 'valid', writing nothing\n"), out
    for extra, said in (([f"checkpoint.resume={step2}"], f"checkpoint file {step2 / 'state.pt'} is missing"),
                        (["run_name=other"], "holds no checkpoint: name one with checkpoint.resume=PATH"),
                        (["checkpoint.resume=none"], "checkpoint.resume=none names none")):
        status, out, err = _evaluate(evaluating + extra, capsys, "--dry-run")
        assert status == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, (extra, out, err)
        assert said in err, err
    assert snapshot(tmp_path) == before  # nothing written, nothing read into being


def test_evaluate_without_a_checkpoint_says_what_to_name(tiny_overrides, tmp_path, capsys):
    status, _, err = _evaluate(tiny_overrides + SHORT, capsys)
    assert status == 2 and "--evaluate: " in err and "holds no checkpoint: name one with checkpoint.resume=PATH" in err
    status, _, err = _evaluate(tiny_overrides + SHORT + ["checkpoint.resume=none"], capsys)
    assert status == 2 and "checkpoint.resume=none names none" in err
    for options in ((), ("--dry-run",)):  # no micro-batch: the loss was NaN, with exit status 0
        status, out, err = _evaluate(tiny_overrides + SHORT + ["training.eval_iters=0"], capsys, *options)
        assert (status, out) == (2, "") and err == ("error: --evaluate with training.eval_iters=0 evaluates no "
                                                    "micro-batch: give training.eval_iters=N (N held-out micro-batches) "
                                                    "or -1 (the whole validation split)\n"), err
    assert not (tmp_path / "runs").exists()  # nothing was written
