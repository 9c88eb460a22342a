"""Saving and resuming a trainer's state, in either on-disk form (`checkpoint.format`).

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
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from megafp8.checkpoint import check_tensors_match, load_checkpoint, save_checkpoint
from megafp8.checkpoint.local import fresh_temporary, publish
from megafp8.checkpoint.sharded import INDEX_FILE, SafeReader, is_sharded_checkpoint, read_sharded, write_sharded
from megafp8.config import ConfigError
from megafp8.config.loader import config_to_dict
from megafp8.parallel import full_shape, gather_param
from megafp8.parallel.sharding import Piece, Placed, placed_param

if TYPE_CHECKING:
    from megafp8.train.trainer import Trainer

log = logging.getLogger("megafp8")
# Model settings a checkpoint's tensor shapes do not reveal: resumed under other values, the weights compute another
# function (on purpose in a context-extension stage, by mistake otherwise).
_UNSEEN_MODEL_SETTINGS = ("rope_theta", "rope_scaling", "norm_eps", "moe_score_func", "moe_top_k", "moe_n_group",
                          "moe_topk_group", "moe_routed_scaling_factor", "moe_norm_topk_prob")


def model_setting_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`model.<key>: <saved> in the checkpoint, <current> in this run` for each unseen setting that differs."""
    return [f"model.{key}: {saved[key]} in the checkpoint, {current[key]} in this run"
            for key in _UNSEEN_MODEL_SETTINGS if key in saved and saved[key] != current[key]]


class _BackgroundWrite:
    """One checkpoint write on a thread; `wait()` joins it and re-raises what it raised."""

    def __init__(self, write: Callable[[], None], step: int) -> None:
        self.error: Optional[BaseException] = None
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


class Checkpointer:
    """Saves and loads one trainer's state (collective: every rank calls `save` and `load`)."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.pending: Optional[_BackgroundWrite] = None
        cfg = trainer.cfg.checkpoint
        self.sharded = cfg.format == "sharded"
        # Background sharded writes run their collectives on a group of their own (gloo: host tensors).
        self.write_group = (dist.new_group(backend="gloo") if self.sharded and cfg.async_save
                            and trainer.dims.is_distributed else None)

    # ------------------------------------------------------------------------------------- save
    def save(self) -> None:
        t = self.trainer
        self.wait()  # one write at a time, in step order
        self._check_finite()
        if self.sharded:
            self._save_sharded()
        else:
            self._save_full()
        if t.dims.is_distributed:
            dist.barrier()

    def wait(self) -> None:
        """Block until a background checkpoint write is done; re-raises its error."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()

    def _check_finite(self) -> None:
        """Raise FloatingPointError (on every rank) if any tensor this checkpoint would hold is inf or nan."""
        t = self.trainer
        pieces = [(name, piece.values) for name, placed in self.placed_state().items() for piece in placed.pieces]
        finite = torch.stack([torch.isfinite(values).all() for _, values in pieces]).tolist() if pieces else []
        bad = [name for (name, _), ok in zip(pieces, finite) if not ok]
        if t.dims.is_distributed:
            every: list[Optional[list[str]]] = [None] * t.dims.world_size
            dist.all_gather_object(every, bad)
            bad = sorted({name for names in every for name in names or []})
        if bad:
            which = f"{bad[0]} and {len(bad) - 1} more tensor(s) hold" if len(bad) > 1 else f"{bad[0]} holds"
            raise FloatingPointError(f"step {t.step}: {which} inf or nan: not saving a checkpoint of it (the newest "
                                     f"checkpoint under {t.checkpoint_dir} stays the newest)")

    def _meta(self) -> dict[str, Any]:
        t = self.trainer
        rng = {"torch": torch.get_rng_state()}
        if t.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(t.device)
        return {"step": t.step, "loader": t.loader.state_dict(),
                "loss_scaler": t.loss_scaler.state_dict() if t.loss_scaler is not None else {},
                "rng": rng, "config": config_to_dict(t.cfg), "optimizer_step": t.optimizer.step_count}

    def _save_full(self) -> None:
        t = self.trainer
        meta = self._meta()
        del meta["optimizer_step"]  # the optimizer's state dict holds it
        model, optimizer = self._merge_stages(self.full_model_state(), t.optimizer.state_dict())
        if t.dims.rank != 0:
            return
        state, root, step, keep = {"model": model, "optimizer": optimizer, **meta}, t.checkpoint_dir, t.step, \
            t.cfg.checkpoint.keep_last

        def write() -> None:
            log.info("saved checkpoint %s", save_checkpoint(root, step, state, keep))
        if t.cfg.checkpoint.async_save:
            self.pending = _BackgroundWrite(write, step)
        else:
            write()

    def _save_sharded(self) -> None:
        t = self.trainer
        root, step, keep, rank0 = t.checkpoint_dir, t.step, t.cfg.checkpoint.keep_last, t.dims.rank == 0
        shared = [fresh_temporary(root, step) if rank0 else None]
        if t.dims.is_distributed:
            dist.broadcast_object_list(shared, src=0)  # rank 0's private directory exists before anyone writes in it
        tmp = shared[0]
        placed, meta = self.placed_state(), (self._meta() if rank0 else None)
        if t.cfg.checkpoint.async_save:  # copy to host now; write later
            placed = {k: Placed(v.shape, [Piece(p.offsets, p.values.detach().to("cpu", copy=True)) for p in v.pieces])
                      for k, v in placed.items()}

        def write() -> None:
            write_sharded(tmp, placed, meta, self.write_group)
            if rank0:  # DCP's coordinator returns once every rank's files and the index are written
                log.info("saved checkpoint %s", publish(root, tmp, step, keep))
        if t.cfg.checkpoint.async_save:
            self.pending = _BackgroundWrite(write, step)
        else:
            write()

    def placed_state(self) -> dict[str, Placed]:
        """This rank's pieces of every tensor a checkpoint holds (views of the live weights and optimizer state)."""
        t = self.trainer
        placed = {f"model/{name}": placed_param(p.detach(), p, t.tp) for name, p in t.model.named_parameters()}
        persistent = t.model.state_dict().keys()
        for name, buffer in t.model.named_buffers():
            if name in persistent:  # the MoE selection biases (not the routers' load counters)
                placed[f"model/{name}"] = Placed(tuple(buffer.shape), [Piece((0,) * buffer.ndim, buffer)])
        placed.update(t.optimizer.placed_state())
        return placed

    def _merge_stages(self, model: dict[str, Any], optimizer: dict[str, Any]) -> tuple[dict, dict]:
        """Under pipeline parallelism, rank 0 gets the union of every stage's weights and optimizer state (other
        ranks keep their own: only rank 0 writes)."""
        dims = self.trainer.dims
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

    def full_model_state(self, meta: bool = False) -> dict[str, torch.Tensor]:
        """Weights and buffers by name at their full shapes, every expert included (tensor-parallel shards and
        expert-parallel slices gathered; collective). `meta`: shapes only, of every pipeline stage."""
        t = self.trainer
        model = t.whole_model_meta() if meta else t.model
        params = dict(model.named_parameters())
        state = {}
        for name, tensor in model.state_dict().items():
            param = params.get(name)
            if meta:
                state[name] = torch.empty(full_shape(param, t.tp.size) if param is not None else tensor.shape,
                                          device="meta")
            elif param is not None:
                state[name] = gather_param(tensor.detach(), param, t.tp, t.ep).to("cpu", copy=True)
            else:  # buffers (MoE selection biases) are replicated
                state[name] = tensor.detach().to("cpu", copy=True)
        return state

    # ------------------------------------------------------------------------------------- load
    def load(self, path: Path) -> None:
        """Resume from a checkpoint of either form, saved at any layout."""
        t = self.trainer
        if is_sharded_checkpoint(path):
            meta = self._load_sharded(path)
        else:
            meta = self._load_full(path)
        if meta["loader"]:  # empty for checkpoints imported from other formats: start the data from the top
            t.loader.load_state_dict(meta["loader"])
        if t.loss_scaler is not None and meta.get("loss_scaler"):
            t.loss_scaler.load_state_dict(meta["loss_scaler"])
        t.step = int(meta["step"])
        changes = model_setting_changes(meta.get("config", {}).get("model", {}), config_to_dict(t.model_cfg))
        if changes:
            log.warning("resuming %s with model settings other than its own (%s): the weights now compute another "
                        "function; set them as the checkpoint has unless this is meant (e.g. a context-extension "
                        "stage)", path, "; ".join(changes))
        torch.set_rng_state(meta["rng"]["torch"])
        if t.device.type == "cuda" and "cuda" in meta["rng"]:
            torch.cuda.set_rng_state(meta["rng"]["cuda"], t.device)

    def _load_full(self, path: Path) -> dict[str, Any]:
        t = self.trainer
        state = load_checkpoint(path, verify=False)  # verified before (megafp8/train/resume.py)
        check_tensors_match(state["model"], self.full_model_state(meta=True), path)
        try:
            t.optimizer.load_state_dict(state["optimizer"])  # writes the master weights into the model
        except (KeyError, ValueError) as err:
            raise ConfigError(f"checkpoint {path} has an unusable optimizer state: {err}") from None
        buffers = dict(t.model.named_buffers())
        with torch.no_grad():
            for name, saved in state["model"].items():  # persistent buffers (MoE selection biases)
                if name in buffers:
                    buffers[name].copy_(saved)
        return state

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        t = self.trainer
        stored = SafeReader(str(path)).read_metadata().state_dict_metadata
        saved_model = {k.removeprefix("model/"): torch.empty(tuple(v.size), device="meta")
                       for k, v in stored.items() if k.startswith("model/")}
        check_tensors_match(saved_model, self.full_model_state(meta=True), path)
        # Masters, moments and buffers are read in place; the BF16 weights are then cast from the masters.
        params = dict(t.model.named_parameters())
        placed = {k: v for k, v in self.placed_state().items() if k.removeprefix("model/") not in params}
        with torch.no_grad():
            meta = read_sharded(path, placed)
        t.optimizer.step_count = int(meta["optimizer_step"])
        t.optimizer.publish()
        return meta


__all__ = ["Checkpointer", "INDEX_FILE"]
