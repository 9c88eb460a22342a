"""The training loop: step, log, evaluate and checkpoint, over parts that each own their state.

One optimizer step = every micro-batch of this rank's share of the global batch, each
backward accumulating FP32 gradients; then the data-parallel all-reduce, global grad-norm
clipping, AdamW on the FP32 masters and the write-back into the BF16 weights. The host waits
on the device only at logging, evaluation and checkpoint steps.

The parts are built by `megafp8/train/build.py`, saved and resumed by `megafp8/train/checkpointing.py`;
metrics records come from `megafp8/train/metrics.py`, and MoE expert balancing runs as an optimizer hook
(`megafp8/train/expert_balance.py`).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from megafp8.config import Config, dump_config, validate_for_world
from megafp8.config.loader import config_to_dict
from megafp8.model import LossTerms, training_flops_per_token
from megafp8.optim import lr_at
from megafp8.parallel import ParallelDims
from megafp8.train.build import build_logger, build_parts, log_run_start
from megafp8.train.checkpointing import Checkpointer, ModelState
from megafp8.train.evaluation import evaluate, replica_mean
from megafp8.train.fp8_health import every_stage, is_sampled
from megafp8.train.loggers import ExperimentLogger
from megafp8.train.metrics import (
    LogWindow,
    StepClock,
    Throughput,
    eval_record,
    format_eval_line,
    format_step_line,
    peak_memory,
    peak_tflops,
    train_record,
)
from megafp8.train.nonfinite import NonFiniteGuard, unscale_or_skip
from megafp8.train.preemption import StopRequest, stop_agreed
from megafp8.train.profiling import StepProfiler
from megafp8.train.resume import checkpoint_to_evaluate
from megafp8.train.run_history import choose_start, record_launch, run_paths
from megafp8.train.run_lock import claim_run_directories, open_run_directories
from megafp8.train.runtime import host_to_device
from megafp8.train.state import RngState, TrainState

log = logging.getLogger("megafp8")


class Trainer:
    """One run on one rank: the loop over the model, optimizer, data and checkpointer built from `cfg`."""

    def __init__(self, cfg: Config, dims: ParallelDims, device: torch.device, evaluate_only: bool = False) -> None:
        """`evaluate_only`: load the checkpoint `checkpoint.resume` names (`auto`: the newest that verifies) for
        `evaluate_checkpoint`, and write nothing (`launch/pretrain.py --evaluate`)."""
        self.dims, self.device = dims, device
        self.tp, self.ep = dims.tensor_parallel, dims.expert_parallel
        self.num_micro_batches = validate_for_world(cfg, dims.world_size)
        self.run_dir, self.checkpoint_dir, self.metrics_path = run_paths(cfg)
        # Nothing is written into the run directory until the config, data and checkpoint are validated; an
        # evaluation writes nothing there, so it takes no lock (it may run beside the training run).
        self.run_lock = None if evaluate_only else claim_run_directories(self.run_dir, self.checkpoint_dir, dims)
        parts = build_parts(cfg, dims, device, self.num_micro_batches, evaluating=evaluate_only)
        self.cfg, self.model_cfg, self.recipe, self.layout = parts.cfg, parts.model_cfg, parts.recipe, parts.layout
        self.model, self.fp8, self.optimizer = parts.model, parts.fp8, parts.optimizer
        self.grad_buckets = parts.optimizer.buckets
        self.loader, self.valid_set, self.loss_scaler = parts.loader, parts.valid_set, parts.loss_scaler
        self.pipeline, self.health, self.expert_balance = parts.pipeline, parts.health, parts.expert_balance
        self.whole_model_meta = parts.whole_model_meta
        self.guard = NonFiniteGuard(self.optimizer, self.cfg.training.max_consecutive_skips, device, dims)
        self.state = TrainState(tokens_per_step=self.cfg.training.global_batch_size * self.cfg.data.seq_len)
        self.checkpointer = Checkpointer(
            ModelState(self.model, self.tp, self.ep, self.whole_model_meta), self.optimizer, self.state,
            parts={"loader": self.loader, "loss_scaler": self.loss_scaler, "rng": RngState(device),
                   "nonfinite": self.guard},
            config=config_to_dict(self.cfg), cfg=self.cfg.checkpoint, directory=self.checkpoint_dir, dims=dims)
        training = self.cfg.training
        self.throughput = Throughput(training.global_batch_size * self.cfg.data.seq_len,
                                     training_flops_per_token(self.model_cfg, self.cfg.data.seq_len), dims.world_size,
                                     peak_tflops(device, self.cfg.logging.peak_tflops))
        self.window = LogWindow(len(LossTerms._fields), device, self._last_lr())  # the steps since the last record
        self.stopped_on: str | None = None  # the signal a run stopped on (`checkpoint.save_on_signal`)
        self.loaded_from: Path | None = None  # the checkpoint this launch resumed or evaluates
        self.metrics = self._open_for_evaluation() if evaluate_only else self._open_run()

    @property
    def step(self) -> int:
        """Optimizer steps taken (applied or skipped) since the run began."""
        return self.state.step

    # ----------------------------------------------------------------------------------- steps
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One training step, added to the logging window. Returns (this rank's mean loss, global grad norm before
        clipping), on device. A step whose gradients hold an inf or nan on any rank is skipped on every rank
        (`megafp8/train/nonfinite.py`); its grad norm is then not finite. The gradients stay in their buffers until
        the next step."""
        if self.fp8.switches_at(self.step):
            log.info("step %d: switching to FP8 | %s", self.step, self.fp8.convert(self.model, self.step).summary())
        self.model.train()
        self.grad_buckets.zero()
        sampled = self.health.arm(self.step)
        # Whether the FP8 health of this step is gathered, the same on every rank (a pipeline stage may hold no FP8
        # layer, and then arms nothing): the stages' reports are joined below.
        health_due = is_sampled(self.step, self.cfg.logging.fp8_health_interval) and self.fp8.runs_fp8_at(self.step)
        micro_batches = self.loader.next_step()
        loss_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        self.model.balance_grad_scale = loss_scale / len(micro_batches)
        with torch.autograd.set_multithreading_enabled(self.cfg.training.backward_on_worker_thread):
            losses = self._forward_backward(micro_batches, loss_scale)
        self.grad_buckets.finish()
        self.state.advance()
        if health_due:
            layers = every_stage(self.health.collect(self.step) if sampled else {}, self.dims.pp_group, self.dims.pp)
            if layers:
                self.metrics.write({"kind": "fp8_health", "step": self.step, "layers": layers})
        grad_norm, lr = self._update(loss_scale)
        self.window.add(losses, grad_norm, lr)
        return losses[0], grad_norm

    def _forward_backward(self, micro_batches: list, loss_scale: float) -> torch.Tensor:
        """Every micro-batch's forward and backward (through the pipeline schedule if there is one); returns the mean
        over them of their loss terms (total, LM, MTP: `LossTerms`)."""
        if self.pipeline is not None:
            self.grad_buckets.prepare_backward(last_micro_batch=False)  # reduce after the pipeline flush
            return self.pipeline.train_step(micro_batches, loss_scale)
        losses = torch.zeros(len(LossTerms._fields), device=self.device)
        for i, (tokens, targets) in enumerate(micro_batches):
            self.grad_buckets.prepare_backward(last_micro_batch=i == len(micro_batches) - 1)
            terms = self.model.loss_terms(host_to_device(tokens, self.device), host_to_device(targets, self.device))
            loss = terms.total / len(micro_batches)
            (loss * loss_scale).backward()
            losses += torch.stack(terms).detach() / len(micro_batches)
        return losses

    def _update(self, loss_scale: float) -> tuple[torch.Tensor, float]:
        """The optimizer step, skipped on the device where the global grad norm is not finite; returns the norm
        (nan for an FP16 step its loss scaler skipped) and the learning rate the update ran at, where applied. The
        optimizer's post-step hooks run either way.

        A step skipped on the device still counts in the optimizer's step count until the next sync point
        (`megafp8/train/nonfinite.py`): until then the schedule runs a step ahead per skip, and this lr with it."""
        lr = lr_at(self.optimizer.step_count, self.cfg.optimizer, self.cfg.training.steps)
        if self.loss_scaler is None:
            grad_norm = self.optimizer.clip_grad_norm()
        else:
            grad_norm = unscale_or_skip(self.optimizer, self.loss_scaler, loss_scale, self.step, self.dims)
            if grad_norm is None:
                self.guard.record(self.step, torch.zeros((), dtype=torch.bool, device=self.device),
                                  counts=self.loss_scaler.scale <= self.loss_scaler.min_scale)
                self.optimizer.skip_step()
                return torch.full((), float("nan"), device=self.device), lr
        applied = torch.isfinite(grad_norm)
        self.optimizer.step(lr, applied)
        self.guard.record(self.step, applied)
        return grad_norm, lr

    def evaluate(self) -> float:
        """Mean language-modelling loss (no MTP term) over the fixed held-out micro-batches (`training.eval_iters` of
        them, split across ranks)."""
        assert self.valid_set is not None
        return evaluate(self.model, self.pipeline, self.valid_set, self.cfg.training, self.dims, self.device)

    def evaluate_checkpoint(self) -> dict[str, Any]:
        """The evaluation record of the checkpoint loaded with `evaluate_only`, logged as training logs its
        evaluations (the same held-out micro-batches, so the same loss as the run's own evaluation at that step)."""
        record = eval_record(self.step, self.evaluate())
        log.info("%s (%s)", format_eval_line(record), self.loaded_from)
        return {**record, "checkpoint": str(self.loaded_from)}

    # ------------------------------------------------------------------------------------ loop
    def fit(self) -> list[dict[str, Any]]:
        """Train to `training.steps`; returns the metrics records (also written to the metrics file)."""
        log_run_start(self.cfg, self.model_cfg, self.recipe, self.whole_model_meta(), self.optimizer, self.loader,
                      self.pipeline, self.dims, self.num_micro_batches, self.step, self.run_dir)
        if self.step >= self.cfg.training.steps:  # said last, where it is read
            log.info("%s finished at step %d already: nothing to train (raise training.steps to train further)",
                     self.run_dir, self.step)
        stop = self._stop_request()
        logging_cfg = self.cfg.logging
        profiler = StepProfiler(logging_cfg.profile_steps, logging_cfg.memory_snapshot_steps, self.run_dir,
                                self.dims.rank, self.device, self.step)
        try:
            records = self._loop(profiler, stop)
            # Every rank is here: a last background write that failed on any rank fails every rank (in `finally`, an
            # exception may be unwinding this rank alone, so the wait there is this rank's own).
            self.checkpointer.wait_agreed()
            return records
        finally:
            try:
                if stop is not None:  # first: a signal during the last wait ends the process as it used to
                    stop.restore()
            finally:
                try:
                    profiler.close(self.step)
                    self.wait_for_save()
                finally:
                    self.metrics.close()
                    if self.run_lock is not None:
                        self.run_lock.release()

    def _stop_request(self) -> StopRequest | None:
        """With `checkpoint.save_on_signal`, SIGTERM and SIGUSR1 stop the loop at an agreed step, checkpointed
        (`megafp8/train/preemption.py`). Where this process cannot handle them it still takes part in the ranks'
        agreement (the config, the same on every rank, decides who does), only never asks to stop itself."""
        if not self.cfg.checkpoint.save_on_signal or self.cfg.checkpoint.interval == 0:
            return None  # without checkpoints a stop would save nothing: the signals keep their default action
        stop = StopRequest()
        why_not = stop.install()
        if why_not is not None:
            log.warning("checkpoint.save_on_signal: %s; SIGTERM and SIGUSR1 keep their default action here", why_not)
        return stop

    def _loop(self, profiler: StepProfiler, stop: StopRequest | None = None) -> list[dict[str, Any]]:
        training, log_interval, save_interval = (self.cfg.training, self.cfg.logging.log_interval,
                                                 self.cfg.checkpoint.interval)
        records: list[dict[str, Any]] = []
        self.window = LogWindow(len(LossTerms._fields), self.device, self._last_lr())
        clock = StepClock(self.step, training.steps)
        while self.step < training.steps:
            profiler.before_step(self.step + 1)
            try:
                self.train_step()
            except torch.OutOfMemoryError:
                profiler.on_out_of_memory()
                raise
            with clock.paused():
                profiler.after_step(self.step)
            last = self.step == training.steps
            logged = self.step % log_interval == 0 or last
            if logged:
                records.append(self._log_window(clock))
            with clock.paused():  # evaluation and checkpoints are not training time
                if training.eval_interval > 0 and (self.step % training.eval_interval == 0 or last):
                    record = eval_record(self.step, self.evaluate())
                    records.append(self._write(record, format_eval_line(record)))
                saved = save_interval > 0 and (self.step % save_interval == 0 or last)
                if saved:
                    self.save()
                # Every rank reaches this logging step; there they agree whether any of them was signalled.
                if logged and not last and stop is not None and stop_agreed(stop.received is not None, self.device):
                    self._stop_on_signal(stop.received, saved)
                    break
        return records

    def _stop_on_signal(self, received: str | None, saved: bool) -> None:
        """Checkpoint this step (unless just done) before the loop stops on a signal; `stopped_on` says which."""
        if not saved:
            self.save()
        self.checkpointer.wait_agreed()  # (collective: every rank stops here) a background write done before "saved"
        self.stopped_on = received or "SIGTERM"
        if self.dims.rank == 0:
            log.warning("step %d of %d: stopping on %s, checkpoint saved; launch again to resume", self.step,
                        self.cfg.training.steps, received or "another rank's signal")

    def _log_window(self, clock: StepClock) -> dict[str, Any]:
        """The metrics record of the logging window's steps (`skipped_steps` of them skipped: not in the mean losses).
        With MTP, `loss` (what backward starts from) is `lm_loss` + model.mtp_loss_weight x `mtp_loss`; without, it is
        `lm_loss`, the loss a run without MTP is compared on."""
        steps = self.window.steps
        mean_losses, skipped, grad_norm, lr = self.window.take()
        # The losses reach the host first: that waits for every step of the window to finish on the device, so the
        # window's time is device time, not just the host's time to launch it.
        loss, lm_loss, mtp_loss = replica_mean(mean_losses, self.dims).tolist()
        window_time = clock.lap(self.step, steps)
        try:
            self.guard.check(self.step)
            stop = None
        except FloatingPointError as err:  # too many skips: the window that shows them is still recorded
            stop = err
        losses = {"loss": loss, "lm_loss": lm_loss, **({"mtp_loss": mtp_loss} if self.model_cfg.mtp_depth else {})}
        record = train_record(self.step, losses, lr.item(), grad_norm.item(), int(skipped), window_time,
                              self.throughput, peak_memory(self.device, self.dims), self.state.consumed_tokens)
        if self.loss_scaler is not None:
            record["loss_scale"] = self.loss_scaler.scale
        if self.expert_balance is not None:
            record.update(self.expert_balance.record(self.throughput.tokens_per_step, self.cfg.data.seq_len))
        self._write(record, format_step_line(record, self.cfg.training.steps))
        if stop is not None:
            raise stop
        return record

    def _last_lr(self) -> float:
        """The learning rate of the last update applied before now, by the optimizer's step count (settled at a sync
        point: a resumed checkpoint, the end of a window)."""
        return lr_at(max(0, self.optimizer.step_count - 1), self.cfg.optimizer, self.cfg.training.steps)

    def _write(self, record: dict[str, Any], line: str) -> dict[str, Any]:
        """Log `line` and write `record` to the metrics backends."""
        log.info(line)
        self.metrics.write(record)
        return record

    # ----------------------------------------------------------------------------- checkpoints
    def save(self) -> None:
        """Checkpoint the current step (collective; see `megafp8/train/checkpointing.py`): not after
        `training.max_consecutive_skips` skipped steps in a row, never with non-finite state."""
        self.guard.check(self.step)
        self.checkpointer.save()

    def wait_for_save(self) -> None:
        """Block until a background checkpoint write is done; re-raises its error."""
        self.checkpointer.wait()

    def load(self, path: Path, named: bool = False, evaluating: bool = False) -> None:
        """Resume from checkpoint `path`, already verified (`megafp8.train.resume.verified_resume_path`); `named`:
        the one `checkpoint.resume` names; `evaluating`: loaded to be evaluated only."""
        self.checkpointer.load(path, named, evaluating)
        self.loaded_from = path
        # From precision.fp8_start_step on, the planned layers run FP8. The run switches at the start of that step,
        # after its evaluation of the step before: an evaluation of step N's checkpoint runs as that one did, in the
        # precision of step N - 1 (BF16 still at N = fp8_start_step).
        self.fp8.convert(self.model, max(self.step - 1, 0) if evaluating else self.step)

    def _open_run(self) -> ExperimentLogger:
        """Judge an earlier launch in the run directory, resume from its checkpoint if any, then (the run validated)
        lock and prepare the directories and open the experiment loggers."""
        resolved = config_to_dict(self.resolved_config())
        replace, resumed_from = choose_start(self.run_dir, self.checkpoint_dir, self.metrics_path, resolved,
                                             self.cfg.checkpoint, self.dims)
        resume = self.cfg.checkpoint.resume
        named = resumed_from is not None and resume not in ("auto", "none") and resumed_from == Path(resume)
        if resumed_from is not None:
            self.load(resumed_from, named=named)
        open_run_directories(self.run_lock, self.run_dir, self.checkpoint_dir, self.dims)
        if self.dims.rank == 0:
            record_launch(self.run_dir, self.checkpoint_dir, self.metrics_path, self.step, replace, resumed_from,
                          dump_config(self.resolved_config()), named=named)
        return build_logger(self.cfg, resolved, self.run_dir, self.metrics_path, self.dims)

    def _open_for_evaluation(self) -> ExperimentLogger:
        """Load the checkpoint to evaluate; the run directory is neither judged nor written (no launch is recorded,
        no metric dropped) and the loggers are off."""
        self.load(checkpoint_to_evaluate(self.cfg.checkpoint.resume, self.checkpoint_dir, self.dims), named=True,
                  evaluating=True)
        return ExperimentLogger([], self.run_dir, self.metrics_path, "", {}, "", enabled=False)

    def resolved_config(self) -> Config:
        """The run's config with the model's vocabulary resolved (what `config.yaml` records)."""
        return dataclasses.replace(self.cfg, model=self.model_cfg)
