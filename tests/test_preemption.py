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


@pytest.fixture(scope="module")
def uninterrupted_losses(corpus_dir, tmp_path_factory) -> list[float]:
    """The losses an uninterrupted run of `_stopped_and_resumed`'s config logs (one run for both signals)."""
    from tests.conftest import TINY_OVERRIDES
    root = tmp_path_factory.mktemp("whole")
    overrides = TINY_OVERRIDES + [f"data.path={corpus_dir}", f"logging.output_dir={root / 'runs'}", "run_name=whole"]
    whole = Trainer(_config(overrides, root, *STOPPED_AND_RESUMED), ParallelDims.single(), torch.device("cpu"))
    return [r["loss"] for r in whole.fit() if r["kind"] == "train"]


# 8 steps: stopped at 4, resumed for two more logging steps (6 and 8) to compare bit for bit.
STOPPED_AND_RESUMED = ("checkpoint.interval=100", "training.steps=8")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_stops_at_the_next_logging_step_with_a_checkpoint_a_relaunch_resumes(tiny_overrides, tmp_path,
                                                                                     signum, uninterrupted_losses):
    cfg = _config(tiny_overrides, tmp_path, *STOPPED_AND_RESUMED)
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
    assert [r["step"] for r in rest] == [6, 8]

    # Nothing was lost or changed: the stopped and resumed run logs the uninterrupted run's losses, bit for bit.
    assert len(uninterrupted_losses) == 4
    assert uninterrupted_losses[2:] == [r["loss"] for r in rest]


def _handlers_during_steps(cfg) -> list:
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    seen = []
    train_step = trainer.train_step
    trainer.train_step = lambda: seen.append(signal.getsignal(signal.SIGTERM)) or train_step()
    trainer.fit()
    return seen


@pytest.mark.parametrize("setting", ["checkpoint.save_on_signal=false", "checkpoint.interval=0"])
def test_switched_off_or_without_checkpoints_the_signals_keep_their_handlers(tiny_overrides, tmp_path, setting):
    """Off, or with checkpoints off (a stop would save nothing), SIGTERM and SIGUSR1 keep their actions."""
    cfg = _config(tiny_overrides, tmp_path, setting, "training.steps=2")
    seen = _handlers_during_steps(cfg)
    assert seen and all(h == signal.getsignal(signal.SIGTERM) for h in seen)
    assert all(not isinstance(getattr(h, "__self__", None), StopRequest) for h in seen)


def test_a_step_just_saved_is_not_saved_twice(tiny_overrides, tmp_path, monkeypatch):
    cfg = _config(tiny_overrides, tmp_path, "checkpoint.interval=4")
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    saves = []
    real_save = trainer.save
    monkeypatch.setattr(trainer, "save", lambda: saves.append(trainer.step) or real_save())
    _signal_after(trainer, 3, signal.SIGTERM)
    trainer.fit()
    assert saves == [4] and trainer.step == 4


def test_stop_request_records_the_first_signal_and_a_second_gets_the_earlier_action():
    """The first signal is recorded; a second one, past the repeat window, gets the action installed before (here a
    recording stand-in for the default action, which would end the test), and every handler is put back."""
    from megafp8.train import preemption
    now = [1000.0]
    seen = []
    previous = {s: signal.signal(s, lambda signum, frame: seen.append(signum)) for s in (signal.SIGTERM,
                                                                                       signal.SIGUSR1)}
    try:
        before = {s: signal.getsignal(s) for s in previous}
        stop = StopRequest(clock=lambda: now[0])
        assert stop.install() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == "SIGUSR1" and seen == []
        now[0] += preemption.REPEAT_WINDOW_S + 1
        os.kill(os.getpid(), signal.SIGTERM)  # the second: passed on, handlers restored
        assert stop.received == "SIGUSR1" and seen == [signal.SIGTERM]
        assert {s: signal.getsignal(s) for s in before} == before
        stop.restore()  # again: nothing left to restore
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _recording_handlers(seen: list) -> dict:
    """Recording stand-ins for SIGTERM's and SIGUSR1's default action (which would end the test); the handlers they
    replace, to put back."""
    return {s: signal.signal(s, lambda signum, frame: seen.append(signum)) for s in (signal.SIGTERM, signal.SIGUSR1)}


def test_the_same_stop_delivered_twice_is_one_request():
    """SLURM signals every process of a job step (slurmstepd's proctrack), and torchrun passes on the SIGTERM it got:
    each rank receives the one stop twice, milliseconds apart. A repeat within REPEAT_WINDOW_S of the first is that
    same request; only a later one gets the earlier action."""
    from megafp8.train import preemption
    now = [1000.0]
    seen = []
    previous = _recording_handlers(seen)
    try:
        stop = StopRequest(clock=lambda: now[0])
        assert stop.install() is None
        os.kill(os.getpid(), signal.SIGTERM)  # from slurmstepd
        now[0] += 0.01
        os.kill(os.getpid(), signal.SIGTERM)  # the same, passed on by torchrun
        now[0] += preemption.REPEAT_WINDOW_S - 1
        os.kill(os.getpid(), signal.SIGTERM)  # SLURM's time limit or a second scancel: still within the window
        assert stop.received == "SIGTERM" and seen == []
        assert isinstance(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), StopRequest)
        now[0] += 2
        os.kill(os.getpid(), signal.SIGTERM)  # past the window: a sender that will not wait
        assert seen == [signal.SIGTERM]
        assert not isinstance(getattr(signal.getsignal(signal.SIGTERM), "__self__", None), StopRequest)
    finally:
        stop.restore()
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_run_signalled_twice_at_once_still_stops_with_a_checkpoint(tiny_overrides, tmp_path):
    """The run that SLURM's SIGTERM and torchrun's copy of it reach together stops at the next logging step with a
    checkpoint, as after one signal (it used to take the copy for a second signal and end at once, losing the work
    since the last checkpoint)."""
    cfg = _config(tiny_overrides, tmp_path, "checkpoint.interval=100")
    seen = []
    previous = _recording_handlers(seen)
    try:
        trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
        train_step = trainer.train_step

        def stepping():
            result = train_step()
            if trainer.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
            return result
        trainer.train_step = stepping
        trainer.fit()
        assert seen == [] and trainer.stopped_on == "SIGTERM"
        assert trainer.step == 4 and _steps(tmp_path / "ckpt") == ["step_00000004"]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_stopped_run_exits_with_the_signals_status(tiny_overrides, tmp_path, monkeypatch):
    """`launch/pretrain.py` reports a run stopped on a signal as 128 + the signal's number, not 0: checkpointed,
    not finished (a wrapper, or Kubernetes, must not take it for a finished run)."""
    from megafp8.train import main as main_module
    from megafp8.train.preemption import exit_status
    assert (exit_status("SIGTERM"), exit_status("SIGUSR1"), exit_status(None)) == (143, 138, 143)
    real_fit = Trainer.fit

    def fit_signalled(self):
        _signal_after(self, 3, signal.SIGUSR1)
        return real_fit(self)
    monkeypatch.setattr(Trainer, "fit", fit_signalled)
    args = tiny_overrides + ["training.steps=12", "training.eval_interval=0", "logging.log_interval=2",
                             "optimizer.warmup_steps=1", f"checkpoint.dir={tmp_path / 'ckpt'}",
                             "checkpoint.interval=100", "training.device=cpu"]
    assert main_module.main(["--config", "tiny_dense", *args]) == 138
    assert _steps(tmp_path / "ckpt") == ["step_00000004"]


def test_an_interrupt_saves_nothing_and_says_where_a_relaunch_resumes(tiny_overrides, tmp_path, monkeypatch, capsys):
    """Ctrl-C (SIGINT) stops at once without a checkpoint, as documented; it printed only "interrupted"."""
    from megafp8.train import main as main_module
    real_fit = Trainer.fit

    def fit_interrupted(self):
        real_fit(self)  # to the end, its last checkpoint at step 2
        raise KeyboardInterrupt
    monkeypatch.setattr(Trainer, "fit", fit_interrupted)
    args = tiny_overrides + ["training.steps=2", "training.eval_interval=0", "optimizer.warmup_steps=1",
                             f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.interval=2", "training.device=cpu"]
    assert main_module.main(["--config", "tiny_dense", *args]) == 130
    assert ("interrupted (SIGINT: nothing saved; SIGTERM or SIGUSR1 stop with a checkpoint): a relaunch resumes from "
            f"{tmp_path / 'ckpt' / 'step_00000002'}") in capsys.readouterr().err


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
    cfg = _config(tiny_overrides, tmp_path, "training.steps=4", "checkpoint.interval=100")
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


def test_a_signal_during_background_saving_still_leaves_a_complete_checkpoint(tiny_overrides, tmp_path):
    """With `checkpoint.async_save` the stop step's checkpoint is written in the background; `fit` waits for it, so
    the run ends with it complete and a relaunch resumes from it."""
    cfg = _config(tiny_overrides, tmp_path, "checkpoint.interval=100", "checkpoint.async_save=true")
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    _signal_after(trainer, 3, signal.SIGTERM)
    trainer.fit()
    assert trainer.stopped_on == "SIGTERM" and _steps(tmp_path / "ckpt") == ["step_00000004"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000004"
    assert Trainer(cfg, ParallelDims.single(), torch.device("cpu")).step == 4


@pytest.mark.parametrize("async_save", [False, True], ids=["in_step", "background"])
def test_a_save_too_slow_for_the_signal_grace_is_reported_once(tiny_overrides, tmp_path, monkeypatch, caplog,
                                                               async_save):
    """Each save logs how long it took (a background save too, from its start to its files written); one that
    leaves too little of the 30 s that torchrun, SLURM and `timeout -k 30` allow after SIGTERM gets one warning per
    run saying what to change (here every save counts as slow), and none where save_on_signal is off."""
    import logging

    from megafp8.train import checkpointing
    assert checkpointing.slow_save_warning(19.0, True) is None
    assert checkpointing.slow_save_warning(34.0, False) is None
    assert "34 s" in checkpointing.slow_save_warning(34.0, True)
    monkeypatch.setattr(checkpointing, "_SLOW_SAVE_S", -1.0)
    for save_on_signal, warnings in (("true", 1), ("false", 0)):
        caplog.clear()
        cfg = _config(tiny_overrides, tmp_path / save_on_signal, "training.steps=4", "checkpoint.interval=2",
                      f"checkpoint.save_on_signal={save_on_signal}", f"checkpoint.async_save={async_save}",
                      f"run_name=save_on_signal_{save_on_signal}")  # two runs, not a relaunch with checkpoint.dir moved
        trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
        with caplog.at_level(logging.INFO, logger="megafp8"):
            trainer.fit()
        saved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("saved checkpoint")]
        # steps 2 and 4 (the last): two saves, so one warning per run is not one per save
        assert len(saved) == 2 and all(m.endswith(" s") and " in " in m for m in saved), saved
        slow = [r for r in caplog.records if "to write, and a stop on SIGTERM" in r.getMessage()]
        assert len(slow) == warnings and all(r.levelno == logging.WARNING for r in slow), slow
        assert trainer.checkpointer.last_save_seconds is not None and trainer.checkpointer.last_save_seconds >= 0
