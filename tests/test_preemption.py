"""Stopping on a scheduler's signal (`checkpoint.save_on_signal`, `megafp8/train/preemption.py`): the loop stops at
the next logging step, every rank at the same one, with a checkpoint of it that a relaunch resumes from."""
from __future__ import annotations

import os
import signal

import pytest
import torch

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from megafp8.train.preemption import StopRequest
from tests.distributed import spawn


def _config(overrides, tmp_path, *extra):
    return load_config("tiny_dense", overrides + [
        "training.steps=12", "training.eval_interval=0", "logging.log_interval=2", "optimizer.warmup_steps=1",
        f"checkpoint.dir={tmp_path / 'ckpt'}", *extra])


def _signal_after(trainer: Trainer, step: int, signum: int, when=lambda: True) -> None:
    """Make `trainer` send itself `signum` once its step `step` has run (and `when()` holds)."""
    train_step = trainer.train_step

    def stepping():
        result = train_step()
        if trainer.step == step and when():
            os.kill(os.getpid(), signum)
        return result
    trainer.train_step = stepping


def _steps(ckpt_dir):
    return sorted(p.name for p in ckpt_dir.glob("step_*"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_stops_at_the_next_logging_step_with_a_checkpoint_a_relaunch_resumes(tiny_overrides, tmp_path,
                                                                                     signum):
    cfg = _config(tiny_overrides, tmp_path, "checkpoint.interval=100")
    before = signal.getsignal(signum)
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    _signal_after(trainer, 3, signum)
    records = trainer.fit()
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4]  # step 4: the next logging step
    assert trainer.step == 4 and _steps(tmp_path / "ckpt") == ["step_00000004"]
    assert signal.getsignal(signum) == before  # the handler is taken back with the run

    resumed = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    assert resumed.step == 4
    rest = [r for r in resumed.fit() if r["kind"] == "train"]
    assert [r["step"] for r in rest] == [6, 8, 10, 12]

    # Nothing was lost or changed: the stopped and resumed run logs the uninterrupted run's losses, bit for bit.
    whole = Trainer(_config(tiny_overrides, tmp_path / "whole", "checkpoint.interval=100", "run_name=whole"),
                    ParallelDims.single(), torch.device("cpu"))
    uninterrupted = [r for r in whole.fit() if r["kind"] == "train"]
    assert [r["loss"] for r in uninterrupted[2:]] == [r["loss"] for r in rest]


def test_without_checkpoints_a_signal_still_stops_cleanly(tiny_overrides, tmp_path):
    cfg = _config(tiny_overrides, tmp_path, "checkpoint.interval=0")
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    _signal_after(trainer, 5, signal.SIGTERM)
    records = trainer.fit()
    assert trainer.step == 6 and records[-1]["step"] == 6
    assert _steps(tmp_path / "ckpt") == []


def test_a_step_just_saved_is_not_saved_twice(tiny_overrides, tmp_path, monkeypatch):
    cfg = _config(tiny_overrides, tmp_path, "checkpoint.interval=4")
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    saves = []
    real_save = trainer.save
    monkeypatch.setattr(trainer, "save", lambda: saves.append(trainer.step) or real_save())
    _signal_after(trainer, 3, signal.SIGTERM)
    trainer.fit()
    assert saves == [4] and trainer.step == 4


def test_switched_off_the_signals_keep_their_handlers(tiny_overrides, tmp_path):
    cfg = _config(tiny_overrides, tmp_path, "checkpoint.save_on_signal=false", "training.steps=2")
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    seen = []
    train_step = trainer.train_step
    trainer.train_step = lambda: seen.append(signal.getsignal(signal.SIGTERM)) or train_step()
    trainer.fit()
    assert seen and all(h == signal.getsignal(signal.SIGTERM) for h in seen)
    assert all(not isinstance(getattr(h, "__self__", None), StopRequest) for h in seen)


def test_stop_request_records_the_first_signal_and_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    stop = StopRequest()
    assert stop.install() is None
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGUSR1"
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in before} == before


def _one_rank_signalled(rank, world_size, overrides, ckpt_dir):
    cfg = load_config("tiny_dense", overrides + [
        "training.steps=12", "training.eval_interval=0", "logging.log_interval=2", "optimizer.warmup_steps=1",
        f"checkpoint.dir={ckpt_dir}", "checkpoint.interval=100"])
    trainer = Trainer(cfg, ParallelDims.build(), torch.device("cpu"))
    _signal_after(trainer, 5, signal.SIGTERM, when=lambda: rank == 1)  # only rank 1 is told
    trainer.fit()
    assert trainer.step == 6, (rank, trainer.step)


def test_ranks_stop_together_when_one_of_them_is_signalled(tiny_overrides, tmp_path):
    """Under data parallelism only rank 1 receives SIGTERM (after step 5): both ranks stop at step 6, the next
    logging step, and write one checkpoint of it together."""
    spawn(2, _one_rank_signalled, tiny_overrides, str(tmp_path / "ckpt"))
    assert _steps(tmp_path / "ckpt") == ["step_00000006"]


def test_a_trainer_off_the_main_thread_keeps_the_signals_and_still_trains(tiny_overrides, tmp_path, caplog):
    """Signal handlers belong to the main thread: a run on another thread says so and trains to its end (it would
    still take part in the ranks' agreement, which the config decides)."""
    import threading
    cfg = _config(tiny_overrides, tmp_path, "training.steps=4")
    before = signal.getsignal(signal.SIGTERM)
    result = {}

    def run():
        trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
        result["steps"] = [r["step"] for r in trainer.fit() if r["kind"] == "train"]
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert result["steps"] == [2, 4]
    assert signal.getsignal(signal.SIGTERM) == before
    assert "signal handlers can only be installed by the main thread" in caplog.text
