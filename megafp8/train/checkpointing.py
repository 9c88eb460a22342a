"""Saving and resuming a run's stateful parts, in either on-disk form (`checkpoint.format`).

The checkpointer holds the parts, each of which owns its state: the model (`ModelState`: this rank's weights
and buffers), the optimizer (FP32 master weights, AdamW moments, its step count), the train state (the step),
and small host-side parts under their names (data loader position, loss scaler, RNG), as torchtitan's
CheckpointManager does. It never reaches into the training loop.

- `sharded` (default): every rank writes its own pieces with torch.distributed.checkpoint: the
  weights and buffers of its stages, and the FP32 master weights and AdamW moments of its optimizer
  shard, all by full tensor name and offset (`megafp8/checkpoint/sharded.py`). Nothing is gathered,
  and a checkpoint loads at any TP / PP / EP / DP layout. Rank 0 adds `meta.pt` (step, data position,
  loss scale, RNG, config) and publishes the directory once every rank has written.
- `full`: every tensor is gathered to its full shape (over TP, EP, DP and the pipeline) and rank 0
  writes one `state.pt`.

Before writing, every rank checks that what it would write is finite: no checkpoint holds an inf or nan
(a FloatingPointError names the first such tensor instead). Every file is checksummed as it is written
(`megafp8/checkpoint/integrity.py`).

With `checkpoint.async_save`, the state is first copied to host memory, then written on a background
thread (the sharded form's collectives run on a dedicated gloo group, so they never interleave with
training's); the next save and the end of training wait for it and re-raise its error.

Some of a save's work is one rank's (rank 0 creates a sharded checkpoint's directory and publishes it, and writes a
full checkpoint), and a background write may fail on one rank only. Where any rank's part of a save fails, every
rank raises the same `CheckpointWriteError` at the same point: a rank failing alone would leave its peers waiting in
their next collective (on NCCL until `parallel.timeout_minutes`).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import math
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.stateful import Stateful

from megafp8.checkpoint import check_tensors_match, load_checkpoint, save_checkpoint
from megafp8.checkpoint.local import CARRIED_KEYS, fresh_temporary, publish
from megafp8.checkpoint.sharded import SafeReader, is_sharded_checkpoint, read_sharded, write_sharded
from megafp8.config import CheckpointConfig, ConfigError, OptimizerConfig
from megafp8.config.schema import upgrade_saved_model
from megafp8.data.dataset import DataPositionError
from megafp8.optim import DistributedAdamW, lr_at
from megafp8.parallel import ExpertParallel, ParallelDims, TensorParallel, full_shape, gather_param, tp_shard_of
from megafp8.parallel.sharding import Piece, Placed, placed_param
from megafp8.train.run_history import config_changes
from megafp8.train.state import TrainState

log = logging.getLogger("megafp8")
# Model settings a checkpoint's tensor shapes do not reveal: resumed under other values, the weights compute another
# function (on purpose in a context-extension stage, by mistake otherwise).
_UNSEEN_MODEL_SETTINGS = ("rope_theta", "rope_scaling", "norm_eps", "moe.score_func", "moe.top_k", "moe.n_group",
                          "moe.topk_group", "moe.routed_scaling_factor", "moe.norm_topk_prob")
_MISSING = object()
# The settings the learning-rate schedule reads (`megafp8/optim/lr_schedule.py`); `training.steps` may change between
# launches of one run, and so may the others in a run started from a checkpoint that `checkpoint.resume` names.
_SCHEDULE_SETTINGS = ("optimizer.lr", "optimizer.min_lr", "optimizer.warmup_steps", "optimizer.decay_style",
                      "optimizer.wsd_decay_fraction", "training.steps")
# What a stop on SIGTERM has to save in: torchrun's agent, SLURM (its default KillWait) and `timeout -k 30` kill the
# process 30 s after SIGTERM. A checkpoint that takes longer than _SLOW_SAVE_S leaves too little of it for the steps
# up to the next logging step and the save.
SIGTERM_GRACE_S = 30.0
_SLOW_SAVE_S = 20.0


def slow_save_warning(seconds: float, stops_on_signal: bool) -> Optional[str]:
    """The warning to log once where a checkpoint took `seconds` to write and a signal's stop would save one (None
    where that fits in the 30 s that the usual senders of SIGTERM allow)."""
    if not stops_on_signal or seconds <= _SLOW_SAVE_S:
        return None
    return (f"a checkpoint took {seconds:.0f} s to write, and a stop on SIGTERM (checkpoint.save_on_signal) saves one "
            f"after the signal: torchrun, SLURM (KillWait) and `timeout -k 30` kill the run {SIGTERM_GRACE_S:.0f} s "
            "after SIGTERM, which leaves too little time for the steps up to the next logging step and the save (a "
            "save cut short leaves the checkpoint before as the newest). Give the stop more time: "
            "`sbatch --signal=TERM@<seconds before the limit>` with a KillWait, or `torchrun --shutdown-timeout` "
            "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT), that covers the save; or write checkpoints to a faster disk "
            "(checkpoint.async_save hides interval saves from training time, but a stop still waits for its save)")


def _setting(model: dict[str, Any], dotted: str) -> Any:
    """The value of a dotted model setting in a config's dict form, or _MISSING."""
    for key in dotted.split("."):
        model = model.get(key, _MISSING) if isinstance(model, dict) else _MISSING
    return model


def model_setting_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`model.<key>: <saved> in the checkpoint, <current> in this run` for each unseen setting that differs (a
    checkpoint of an earlier version's flat layout is read in today's)."""
    saved = upgrade_saved_model(saved)
    changes = []
    for key in _UNSEEN_MODEL_SETTINGS:
        before, now = _setting(saved, key), _setting(current, key)
        if before is not _MISSING and before != now:
            changes.append(f"model.{key}: {before} in the checkpoint, {now} in this run")
    return changes


def _schedule_settings(config: dict[str, Any], fallback: dict[str, Any]) -> dict[str, Any]:
    """The schedule's settings in a config's dict form, by dotted name; one it lacks (a checkpoint of an earlier
    version) is taken from `fallback`."""
    settings = {}
    for key in _SCHEDULE_SETTINGS:
        value = _setting(config, key)
        settings[key] = value if value is not _MISSING else _setting(fallback, key)
    return settings


def _scheduled_lr(settings: dict[str, Any], step: int) -> float:
    """The learning rate of optimizer step `step` under the schedule `settings` describe (the defaults for those
    they lack)."""
    optimizer = dataclasses.replace(OptimizerConfig(), **{key.removeprefix("optimizer."): value
                                                          for key, value in settings.items()
                                                          if key.startswith("optimizer.") and value is not _MISSING})
    return lr_at(step, optimizer, settings["training.steps"])


def schedule_change_warning(saved: dict[str, Any], current: dict[str, Any], step: int,
                            optimizer_step: int) -> Optional[str]:
    """The warning to log where a run resumes (at `step`; the optimizer's own count `optimizer_step`) at another
    learning rate than the schedule of its checkpoint's config `saved` gives there (e.g. a finished cosine run
    extended by a larger `training.steps` climbs back from `min_lr`): None where the two agree to 1e-6."""
    before, now = _schedule_settings(saved, current), _schedule_settings(current, current)
    lr_before, lr_now = _scheduled_lr(before, optimizer_step), _scheduled_lr(now, optimizer_step)
    if math.isclose(lr_before, lr_now, rel_tol=1e-6):
        return None
    changes = "; ".join(f"{key}: {before[key]} there, {now[key]} here" for key in before if before[key] != now[key])
    return (f"resuming at step {step}: the learning rate goes from {lr_before:.4g}, the schedule the checkpoint was "
            f"saved with, to {lr_now:.4g} ({changes}): the schedule depends on these settings; meant when extending "
            "a run, otherwise set them as the checkpoint has")


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written, raised on every rank alike (whichever rank's part failed)."""


def write_failure_text(error: BaseException, directory: Path) -> str:
    """A failed checkpoint write in one line, with the file system's fill where that is the likely cause: torch's
    writers report a full disk as "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"."""
    text = f"{type(error).__name__}: {error}"
    try:
        usage = shutil.disk_usage(directory if directory.exists() else directory.parent)
    except OSError:
        return text
    chain, cause = [], error
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    full = any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain)
    if full or usage.free < max(usage.total // 100, 64 * 2**20):
        text += (f" (the file system of {directory} has {usage.free / 2**20:.0f} MiB free of "
                 f"{usage.total / 2**30:.1f} GiB: it is full, or nearly; free space, or point checkpoint.dir "
                 "elsewhere)")
    return text


def _attempt(action: Callable[[], object]) -> Optional[Exception]:
    """Run `action`; what it raised (an Exception), or None."""
    try:
        action()
    except Exception as err:
        return err
    return None


class _BackgroundWrite:
    """One checkpoint write on a thread; `wait()` joins it and re-raises what it raised."""

    def __init__(self, write: Callable[[], None], step: int) -> None:
        self.error: Optional[BaseException] = None
        self.step = step
        self.thread = threading.Thread(target=self._run, args=(write,), name=f"checkpoint-step-{step}", daemon=True)
        self.thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as err:  # surfaced by wait() on the training thread
            self.error = err

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


_CHECKSUM_CHUNK = 1 << 24  # elements widened to int64 at a time (a replicated expert weight may be gigabytes)
_BITS_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def replica_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums of `t`'s bit patterns, plain and weighted by position: the same bits give the same sums on any
    rank and in any order of addition (integers), different bits other sums but by a coincidence."""
    bits = t.detach().reshape(-1).view(_BITS_OF_SIZE[t.element_size()])
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, bits.numel(), _CHECKSUM_CHUNK):
        chunk = bits[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=t.device) % 65521 + 1
        total[0] += chunk.sum()
        total[1] += (chunk * position).sum()
    return total


class ModelState:
    """The model as a checkpoint sees it: this rank's weights and persistent buffers (the MoE selection biases,
    not the routers' load counters), and the names and full shapes of the whole model's."""

    def __init__(self, model: nn.Module, tp: TensorParallel, ep: ExpertParallel,
                 whole_model_meta: Callable[[], nn.Module]) -> None:
        self.model, self.tp, self.ep = model, tp, ep
        self.whole_model_meta = whole_model_meta  # every pipeline stage on the meta device (built when asked)

    def placed_state(self) -> dict[str, Placed]:
        """This rank's pieces of every weight and buffer (views of the live tensors), by full name and offset."""
        weights = {f"model/{name}": placed_param(p.detach(), p, self.tp) for name, p in self.model.named_parameters()}
        return {**weights, **self.placed_buffers()}

    def placed_buffers(self) -> dict[str, Placed]:
        """The persistent buffers (replicated: whole on every rank)."""
        persistent = self.model.state_dict().keys()
        return {f"model/{name}": Placed(tuple(buffer.shape), [Piece((0,) * buffer.ndim, buffer)])
                for name, buffer in self.model.named_buffers() if name in persistent}

    def full_state(self, meta: bool = False) -> dict[str, torch.Tensor]:
        """Weights and buffers by name at their full shapes, every expert included (tensor-parallel shards and
        expert-parallel slices gathered; collective). `meta`: shapes only, of every pipeline stage."""
        model = self.whole_model_meta() if meta else self.model
        params = dict(model.named_parameters())
        state = {}
        for name, tensor in model.state_dict().items():
            param = params.get(name)
            if meta:
                state[name] = torch.empty(full_shape(param) if param is not None else tensor.shape,
                                          device="meta")
            elif param is not None:
                state[name] = gather_param(tensor.detach(), param, self.tp, self.ep).to("cpu", copy=True)
            else:  # buffers (MoE selection biases) are replicated
                state[name] = tensor.detach().to("cpu", copy=True)
        return state

    @torch.no_grad()
    def tp_replica_differences(self) -> list[str]:
        """The weights and persistent buffers replicated over the tensor-parallel group (norms, routers, routed
        experts, the MoE selection biases) whose copies differ between its ranks, by name (collective over the TP
        group; [] without TP). Compared by their bits' checksums (`replica_checksum`), not moved."""
        if not self.tp.enabled:
            return []
        persistent = self.model.state_dict().keys()
        replicated = [(name, p) for name, p in self.model.named_parameters() if tp_shard_of(p) is None]
        replicated += [(name, b) for name, b in self.model.named_buffers() if name in persistent]
        if not replicated:
            return []
        low = torch.stack([replica_checksum(t) for _, t in replicated])
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.tp.group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.tp.group)
        return [name for (name, _), differ in zip(replicated, (low != high).any(dim=1).tolist()) if differ]

    @torch.no_grad()
    def load_buffers(self, saved: dict[str, torch.Tensor]) -> None:
        """Copy the persistent buffers of a full state in (the weights come from the optimizer's masters)."""
        buffers = dict(self.model.named_buffers())
        for name, tensor in saved.items():
            if name in buffers:
                buffers[name].copy_(tensor)


class Checkpointer:
    """Saves and loads a run's parts (collective: every rank calls `save` and `load`).

    `parts` are the small host-side parts by the name their state has in a checkpoint (`loader`, `loss_scaler`,
    `rng`); a part the run lacks (None: the loss scaler outside FP16) saves an empty state. The train state's
    fields are the checkpoint's top-level keys (the step), and `config` (the run's config as a dict) is recorded
    with it."""

    def __init__(self, model: ModelState, optimizer: DistributedAdamW, train_state: TrainState,
                 parts: dict[str, Optional[Stateful]], config: dict[str, Any], cfg: CheckpointConfig,
                 directory: Path, dims: ParallelDims) -> None:
        self.model, self.optimizer, self.train_state, self.parts = model, optimizer, train_state, parts
        self.config, self.cfg, self.directory, self.dims = config, cfg, directory, dims
        self.carried: dict[str, Any] = {}  # checkpoint keys kept from the checkpoint resumed (CARRIED_KEYS)
        self.pending: Optional[_BackgroundWrite] = None
        self.last_save_seconds: Optional[float] = None  # rank 0: the newest checkpoint's, from save() to written
        self._save_started = 0.0
        self._warned_slow_save = False
        self.sharded = cfg.format == "sharded"
        # Background sharded writes run their collectives on a group of their own (gloo: host tensors).
        self.write_group = (dist.new_group(backend="gloo", timeout=dims.timeout)
                            if self.sharded and cfg.async_save and dims.is_distributed else None)

    # ------------------------------------------------------------------------------------- save
    def save(self) -> None:
        """Checkpoint the train state's step (a background write when `checkpoint.async_save`). Where any rank's
        part fails (or that of the background write before), every rank raises CheckpointWriteError."""
        self.wait_agreed()  # one write at a time, in step order
        self._save_started = time.perf_counter()
        self._check_finite()
        self._warn_of_tp_replica_differences()
        # Only the file work is agreed on: an exception in the collective part before it (gathering, copying to the
        # host) raises as itself, as it would anywhere in training. The agreement also serves as the barrier: no rank
        # goes on before the checkpoint is written (or, async, copied to host memory).
        self._agree(self._save_sharded() if self.sharded else self._save_full(), self.train_state.step)

    def wait(self) -> None:
        """Block until a background checkpoint write is done; re-raises its error (this rank's only: where an
        exception unwinds this rank alone, nothing collective may run)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()

    def wait_agreed(self) -> None:
        """`wait`, collectively: where the background write failed on any rank, CheckpointWriteError on every
        rank. Every rank calls it at the same point."""
        step = self.pending.step if self.pending is not None else self.train_state.step
        self._agree(_attempt(self.wait), step)

    def _agree(self, error: Optional[Exception], step: int) -> None:
        """Raise CheckpointWriteError on every rank where `error` (this rank's failure in writing the checkpoint of
        `step`, or None) or another rank's is not None (collective)."""
        message = None if error is None else write_failure_text(error, self.directory)
        messages = [message]
        if self.dims.is_distributed:
            messages = [None] * self.dims.world_size
            dist.all_gather_object(messages, message)
        failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
        if failed:
            rank, first = failed[0]
            raise CheckpointWriteError(f"checkpoint of step {step} not saved: rank {rank} failed writing it under "
                                       f"{self.directory}: {first}") from error

    def _check_finite(self) -> None:
        """Raise FloatingPointError (on every rank) if any tensor this checkpoint would hold is inf or nan."""
        pieces = [(name, piece.values) for name, placed in self.placed_state().items() for piece in placed.pieces]
        finite = torch.stack([torch.isfinite(values).all() for _, values in pieces]).tolist() if pieces else []
        bad = [name for (name, _), ok in zip(pieces, finite) if not ok]
        if self.dims.is_distributed:
            every: list[Optional[list[str]]] = [None] * self.dims.world_size
            dist.all_gather_object(every, bad)
            bad = sorted({name for names in every for name in names or []})
        if bad:
            which = f"{bad[0]} and {len(bad) - 1} more tensor(s) hold" if len(bad) > 1 else f"{bad[0]} holds"
            raise FloatingPointError(f"step {self.train_state.step}: {which} inf or nan: not saving a checkpoint of "
                                     f"it (the newest checkpoint under {self.directory} stays the newest)")

    def _warn_of_tp_replica_differences(self) -> None:
        """Warn (rank 0) where tensor-parallel ranks hold different copies of a replicated weight (collective)."""
        if not self.dims.tensor_parallel.enabled:
            return
        differ = self.model.tp_replica_differences()
        every: list[Optional[list[str]]] = [None] * self.dims.world_size
        dist.all_gather_object(every, differ)  # (other pipeline stages', other TP groups')
        differ = sorted({name for names in every for name in names or []})
        if differ and self.dims.rank == 0:
            which = f"{differ[0]} and {len(differ) - 1} more" if len(differ) > 1 else differ[0]
            why = ("with parallel.sequence_parallel their gradients are summed over TP, so this is a fault: please "
                   "report it" if self.dims.tensor_parallel.sp else
                   "without parallel.sequence_parallel their gradients are never reduced over TP, so the copies stay "
                   "equal only where every TP rank's kernels give the same bits; set parallel.sequence_parallel=true "
                   "(their gradients are then summed over TP) or training.deterministic=true")
            log.warning("step %d: the tensor-parallel ranks' copies of %s differ (replicated weights, one copy on "
                        "each TP rank; the checkpoint holds one of them): %s", self.train_state.step, which, why)

    def _meta(self) -> dict[str, Any]:
        """What a checkpoint holds besides tensors: the train state, every part's state, the config and (for the
        sharded form, whose tensors carry no step) the optimizer's step count."""
        parts = {name: part.state_dict() if part is not None else {} for name, part in self.parts.items()}
        return {**self.train_state.state_dict(), **parts, "config": self.config,
                "optimizer_step": self.optimizer.step_count, **self.carried}

    def _save_full(self) -> Optional[Exception]:
        """Gather the full state on rank 0 (collective), which writes it; returns what this rank's write raised."""
        meta = self._meta()
        del meta["optimizer_step"]  # the optimizer's state dict holds it
        model, optimizer = self._merge_stages(self.model.full_state(), self.optimizer.state_dict())
        if self.dims.rank != 0:
            return None
        state, root, step = {"model": model, "optimizer": optimizer, **meta}, self.directory, self.train_state.step

        def write() -> Path:
            return save_checkpoint(root, step, state, self.cfg.keep_last)
        return self._run(write, step)

    def _save_sharded(self) -> Optional[Exception]:
        """Every rank writes its pieces into rank 0's fresh directory (collective), which rank 0 then publishes;
        returns what this rank's part of the write raised."""
        root, step, rank0 = self.directory, self.train_state.step, self.dims.rank == 0
        shared: list[Any] = [None]
        if rank0:
            try:
                shared = [fresh_temporary(root, step)]
            except OSError as err:  # sent instead: every rank fails here, none waits in DCP's first collective
                shared = [f"{type(err).__name__}: {err}"]
        if self.dims.is_distributed:
            dist.broadcast_object_list(shared, src=0)  # rank 0's private directory exists before anyone writes in it
        tmp = shared[0]
        if isinstance(tmp, str):
            return OSError(f"rank 0 could not create the checkpoint's directory: {tmp}")
        placed, meta = self.placed_state(), (self._meta() if rank0 else None)
        if self.cfg.async_save:  # copy to host now; write later
            placed = {k: Placed(v.shape, [Piece(p.offsets, p.values.detach().to("cpu", copy=True)) for p in v.pieces])
                      for k, v in placed.items()}

        def write() -> Optional[Path]:
            write_sharded(tmp, placed, meta, self.write_group)
            # DCP's coordinator returns once every rank's files and the index are written
            return publish(root, tmp, step, self.cfg.keep_last) if rank0 else None
        return self._run(write, step)

    def _run(self, write: Callable[[], Optional[Path]], step: int) -> Optional[Exception]:
        """Write now, returning what it raised (an Exception, or None), or on a background thread under
        `checkpoint.async_save` (its error surfaces in `wait`); rank 0 (whose `write` returns the checkpoint's path)
        reports it and how long it took."""
        def write_and_report() -> None:
            path = write()
            if path is not None:
                self._report_save(path, time.perf_counter() - self._save_started)

        if self.cfg.async_save:
            self.pending = _BackgroundWrite(write_and_report, step)
            return None
        return _attempt(write_and_report)

    def _report_save(self, path: Path, seconds: float) -> None:
        self.last_save_seconds = seconds
        log.info("saved checkpoint %s in %.1f s", path, seconds)
        warning = slow_save_warning(seconds, self.cfg.save_on_signal and self.cfg.interval > 0)
        if warning is not None and not self._warned_slow_save:
            self._warned_slow_save = True
            log.warning(warning)

    def placed_state(self) -> dict[str, Placed]:
        """This rank's pieces of every tensor a checkpoint holds (views of the live weights and optimizer state)."""
        return {**self.model.placed_state(), **self.optimizer.placed_state()}

    def _merge_stages(self, model: dict[str, Any], optimizer: dict[str, Any]) -> tuple[dict, dict]:
        """Under pipeline parallelism, rank 0 gets the union of every stage's weights and optimizer state (other
        ranks keep their own: only rank 0 writes)."""
        dims = self.dims
        if dims.pp_group is None or dims.rank % (dims.tp * dims.dp) != 0:  # not rank 0's pipeline
            return model, optimizer
        stages: Optional[list[Any]] = [None] * dims.pp if dims.rank == 0 else None
        dist.gather_object((model, optimizer), stages, dst=0, group=dims.pp_group)
        if dims.rank != 0:
            return model, optimizer
        merged_model, merged_opt = {}, {**optimizer, "masters": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for stage_model, stage_opt in stages:
            merged_model.update(stage_model)
            for key in ("masters", "exp_avg", "exp_avg_sq"):
                merged_opt[key].update(stage_opt[key])
        return merged_model, merged_opt

    # ------------------------------------------------------------------------------------- load
    def load(self, path: Path, named: bool = False, evaluating: bool = False) -> None:
        """Resume every part from a checkpoint of either form, saved at any layout. A part whose saved state is
        empty keeps its own (checkpoints imported from other formats hold no data position). `named`: the
        checkpoint is the one `checkpoint.resume` names, which may start a run of other settings; `evaluating`:
        loaded only to be evaluated (`--evaluate`), so its data position, which an evaluation never reads, may not
        fit this run's data."""
        meta = self._load_sharded(path) if is_sharded_checkpoint(path) else self._load_full(path)
        # What an import kept of its source (config.json's max_position_embeddings) goes on into this run's
        # checkpoints, so that their export still says what the imported model was built for.
        self.carried = {key: meta[key] for key in CARRIED_KEYS if meta.get(key)}
        self._check_run_settings(path, meta.get("config"), named)
        self.train_state.load_state_dict(meta)
        for name, part in self.parts.items():
            if part is not None and meta.get(name):
                try:
                    part.load_state_dict(meta[name])
                except DataPositionError as err:
                    if evaluating:
                        continue
                    if not named:
                        raise
                    # A run of its own from this checkpoint (a new stage: other data, a longer context): its
                    # position in another sample order means nothing here. Said once, by rank 0 (every rank has it).
                    if self.dims.rank == 0:
                        log.warning("the data position of %s (%s samples consumed) does not fit this run's data: "
                                    "%s: this run reads its data from the first sample of its own order", path,
                                    meta[name].get("consumed_samples"), err.mismatch)
        changes = model_setting_changes(meta.get("config", {}).get("model", {}), self.config["model"])
        if changes and self.dims.rank == 0:  # the same on every rank: said once
            log.warning("resuming %s with model settings other than its own (%s): the weights now compute another "
                        "function; set them as the checkpoint has unless this is meant (e.g. a context-extension "
                        "stage)", path, "; ".join(changes))
        self._warn_of_schedule_change(meta.get("config"))

    def _warn_of_schedule_change(self, saved: Any) -> None:
        """On rank 0, one warning where the learning rate of the resumed step differs from the one the checkpoint's
        schedule gives there (not refused: extending a run by a larger `training.steps` is often meant)."""
        if self.dims.rank != 0 or not isinstance(saved, dict):
            return  # imported from another format: no schedule
        warning = schedule_change_warning(saved, self.config, self.train_state.step, self.optimizer.step_count)
        if warning is not None:
            log.warning(warning)

    def _check_run_settings(self, path: Path, saved: Any, named: bool) -> None:
        """The settings of this run that differ from those `path` was saved with, beyond what may change between
        launches of one run: a ConfigError for a checkpoint found in the checkpoint directory (another run's, where
        runs share checkpoint.dir), a warning for one `checkpoint.resume` names (a run of its own starting from it).
        The run's name may differ: runs of the same settings may share a checkpoint directory."""
        if not isinstance(saved, dict):
            return  # imported from another format: no run settings
        if isinstance(saved.get("model"), dict):
            saved = {**saved, "model": upgrade_saved_model(saved["model"])}
        changes = [c for c in config_changes(saved, self.config, shared_only=True) if not c.startswith("run_name:")]
        if named:  # model settings: their shapes are checked, and those unseen are warned about after this
            changes = [c for c in changes if not c.startswith("model.")]
        if not changes:
            return
        if named:
            if self.dims.rank == 0:  # the same on every rank: said once
                log.warning("resuming %s under settings other than it was saved with (%s): this run continues its "
                            "weights (and its data position, where its data is the same) under them", path,
                            "; ".join(changes))
            return
        more = f" and {len(changes) - 1} more setting(s)" if len(changes) > 1 else ""
        raise ConfigError(f"checkpoint {path} was saved under other settings than this run's ({changes[0]}{more}): "
                          "resume it with the settings it was saved with; or, to start a run of these settings from "
                          f"it, name it (checkpoint.resume={path}) and give this run its own checkpoint.dir")

    def _load_full(self, path: Path) -> dict[str, Any]:
        state = load_checkpoint(path, verify=False)  # verified before (megafp8/train/resume.py)
        check_tensors_match(state["model"], self.model.full_state(meta=True), path)
        try:
            self.optimizer.load_state_dict(state["optimizer"])  # writes the master weights into the model
        except (KeyError, ValueError) as err:
            raise ConfigError(f"checkpoint {path} has an unusable optimizer state: {err}") from None
        self.model.load_buffers(state["model"])
        return state

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        stored = SafeReader(str(path)).read_metadata().state_dict_metadata
        saved_model = {k.removeprefix("model/"): torch.empty(tuple(v.size), device="meta")
                       for k, v in stored.items() if k.startswith("model/")}
        check_tensors_match(saved_model, self.model.full_state(meta=True), path)
        # Masters, moments and buffers are read in place; the BF16 weights are then cast from the masters. An
        # imported checkpoint (step 0, a fresh optimizer) may hold no moments: they start at zero.
        moments = any(k.startswith("optim/exp_avg/") for k in stored)
        placed = {**self.model.placed_buffers(), **self.optimizer.placed_state(moments)}
        with torch.no_grad():
            meta = read_sharded(path, placed)
        if not moments:
            if int(meta["optimizer_step"]) != 0:
                raise ConfigError(f"checkpoint {path} holds no AdamW moments but was saved at optimizer step "
                                  f"{meta['optimizer_step']}: it is incomplete; resume from another checkpoint")
            self.optimizer.zero_moments()
        self.optimizer.finish_placed_load(int(meta["optimizer_step"]))
        return meta


__all__ = ["CheckpointWriteError", "Checkpointer", "ModelState"]
