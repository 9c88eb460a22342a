"""Tensor-only loading of a checkpoint directory (full or sharded) into one full-tensor dictionary, verified first,
and the check that saved tensors fit a model's (`check_tensors_match`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megafp8.checkpoint.local import (LATEST_FILE, STATE_FILE, has_checksums, not_a_checkpoint, read_pointer,
                                      verification_problem)
from megafp8.checkpoint.sharded import META_FILE, RESUME_EARLIER, is_sharded_checkpoint, read_full
from megafp8.config import ConfigError
from megafp8.config.errors import torch_load_text


@dataclass(frozen=True)
class LoadAdvice:
    """What a load error tells the user to do when the checkpoint is `missing`, or `damaged`."""

    missing: str
    damaged: str


RESUMING = LoadAdvice(missing="check checkpoint.resume", damaged=RESUME_EARLIER)
CONVERTING = LoadAdvice(missing="check the checkpoint path given to the tool",
                        damaged="convert an earlier checkpoint")


TENSORS = ("all", "weights", "shapes")  # what `load_checkpoint` reads of the tensors


def load_checkpoint(path: Path, verify: bool = True, advice: LoadAdvice = RESUMING,
                    tensors: str = "all") -> dict[str, Any]:
    """Read a checkpoint directory (or its state file) onto the CPU, tensors and plain values only, every tensor at
    its full shape (a sharded checkpoint is consolidated in this process). `verify`: check every file's checksum
    first (a ConfigError naming the first bad file). `advice`: how errors end (training's by default). `tensors`:
    "all"; "weights", the model and the FP32 masters without the AdamW moments (8 of the ~14 bytes a parameter
    of a checkpoint with FP32 moments, which an export never reads); "shapes", every tensor as a meta tensor (names,
    shapes, dtypes: what an inspection lists), so nothing of a large checkpoint is held in memory."""
    if tensors not in TENSORS:
        raise ValueError(f"tensors={tensors!r}: one of {TENSORS}")
    if not path.exists():
        raise ConfigError(f"checkpoint '{path}' not found; {advice.missing}")
    if path.is_dir() and (holder := not_a_checkpoint(path)) is not None:
        raise ConfigError(holder)
    directory = path if path.is_dir() else path.parent
    problem = verification_problem(directory) if verify and (path.is_dir() or has_checksums(directory)) else None
    if problem:
        raise ConfigError(f"{problem}; {advice.damaged}")
    if path.is_dir() and is_sharded_checkpoint(path):
        return _consolidate(path, advice, tensors)
    if path.is_file() and is_sharded_checkpoint(path.parent):
        raise ConfigError(f"{path} is one file of the sharded checkpoint {path.parent}: give that directory")
    file = path / STATE_FILE if path.is_dir() else path
    if path.name == LATEST_FILE and path.is_file():
        named = read_pointer(path)
        raise ConfigError(f"{path} is the pointer to the newest checkpoint (it names {named!r}): give that "
                          f"checkpoint, {path.parent / named}")
    if not file.is_file():
        raise ConfigError(f"checkpoint '{path}' not found (expected {file}); {advice.missing}")
    try:
        state = _torch_load(file, mmap=tensors != "all")
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise ConfigError(f"checkpoint file {file} is corrupt or not a megafp8 checkpoint "
                          f"({torch_load_text(err)})") from None
    if not isinstance(state, dict):
        raise ConfigError(f"checkpoint file {file} holds a {type(state).__name__}, not a megafp8 training checkpoint "
                          "(a dict of model, optimizer, step and loader)")
    missing = [k for k in ("model", "optimizer", "step", "loader") if k not in state]
    if missing:
        raise ConfigError(f"checkpoint file {file} lacks {', '.join(missing)}: not a megafp8 training checkpoint")
    if tensors == "weights":
        state["optimizer"] = {k: v for k, v in state["optimizer"].items() if k not in ("exp_avg", "exp_avg_sq")}
    elif tensors == "shapes":  # the model's and optimizer's tensors (the small state beside them as it is)
        state.update(model=_as_meta(state["model"]), optimizer=_as_meta(state["optimizer"]))
    return state


def _torch_load(file: Path, mmap: bool) -> dict[str, Any]:
    """`torch.load` of a state file, memory-mapped where `mmap` (only part is wanted: the tensors left out are then
    never read); a file torch cannot map (the pre-zipfile format) is read whole instead."""
    if mmap:
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
    return torch.load(file, map_location="cpu", weights_only=True)


def _as_meta(value: Any) -> Any:
    """`value` with every tensor in it replaced by a meta tensor of its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, dict):
        return {k: _as_meta(v) for k, v in value.items()}
    return value


def _consolidate(path: Path, advice: LoadAdvice, tensors: str = "all") -> dict[str, Any]:
    """A sharded checkpoint as the full-checkpoint dictionary (of the `tensors` `load_checkpoint` names)."""
    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {path} lacks {META_FILE}: not a complete megafp8 checkpoint") from None
    except Exception as err:
        raise ConfigError(f"checkpoint file {path / META_FILE} is corrupt or not a megafp8 checkpoint "
                          f"({torch_load_text(err)})") from None
    kinds = ("masters",) if tensors == "weights" else ("masters", "exp_avg", "exp_avg_sq")
    wanted = ("model/", *(f"optim/{kind}/" for kind in kinds))
    read = read_full(path, advice.damaged, keep=lambda name: name.startswith(wanted), shapes_only=tensors == "shapes")
    state = {key: value for key, value in meta.items() if key != "optimizer_step"}
    state["model"] = {name.removeprefix("model/"): t for name, t in read.items() if name.startswith("model/")}
    state["optimizer"] = {"step": meta["optimizer_step"]}
    for kind in kinds:
        prefix = f"optim/{kind}/"
        found = {name.removeprefix(prefix): t for name, t in read.items() if name.startswith(prefix)}
        if found or kind == "masters":  # an imported checkpoint's fresh optimizer stores no moments
            state["optimizer"][kind] = found
    return state


_VOCAB_ROWS = ("embed.weight", "lm_head.weight")  # tensors whose first dimension is the (padded) vocabulary


def check_tensors_match(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: Path) -> None:
    """One error naming the first missing, unexpected or differently shaped tensor (and how many more), with the
    setting that makes them match."""
    problems = [f"tensor '{k}' is missing from the checkpoint" for k in expected if k not in saved]
    problems += [f"tensor '{k}' is in the checkpoint but not in the model" for k in saved if k not in expected]
    reshaped = [k for k, v in expected.items() if k in saved and tuple(saved[k].shape) != tuple(v.shape)]
    problems += [f"tensor '{k}' has shape {tuple(saved[k].shape)} in the checkpoint but {tuple(expected[k].shape)} "
                 "in the model" for k in reshaped]
    if not problems:
        return
    more = f" ({len(problems) - 1} more mismatches)" if len(problems) > 1 else ""
    rows = {int(saved[k].shape[0]) for k in reshaped}
    if len(problems) == len(reshaped) and set(reshaped) <= set(_VOCAB_ROWS) and len(rows) == 1:
        saved_rows, model_rows = rows.pop(), int(expected[reshaped[0]].shape[0])
        advice = (f"the checkpoint's vocabulary has {saved_rows} rows (padded for the layout it was saved at): set "
                  "model.vocab_size to that")
        if saved_rows < model_rows:  # the model's rows may come from the data's tokenizer, which the setting cannot
            advice += (f", unless this model's {model_rows} rows come from the data's tokenizer (model.vocab_size "
                       "unset): then data.path was tokenized by another tokenizer than the checkpoint's, and needs "
                       "preprocessing with the checkpoint's")
    else:
        advice = ("resume with the model settings it was saved with (`python tools/convert_checkpoint.py inspect "
                  f"{source}` lists them; the parallel layout may differ)")
    raise ConfigError(f"checkpoint {source} does not match this model: {problems[0]}{more}. To resume from it, "
                      f"{advice}; or set checkpoint.resume=none (or another checkpoint.dir) to start fresh")
