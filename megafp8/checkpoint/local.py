"""Checkpoint directories: atomic publish, keep-last-K, tensor-only loading, for both on-disk forms.

A *full* checkpoint is one file that rank 0 writes after gathering every tensor at its full shape:

    DIR/step_00000100/state.pt   model, optimizer (FP32 masters + AdamW), step, loader position, RNG, config
    DIR/latest                   the name of the newest complete checkpoint

A *sharded* checkpoint (`checkpoint.format: sharded`, the default) has every rank write its own pieces
with torch.distributed.checkpoint (`megafp8/checkpoint/sharded.py`); `load_checkpoint` reads either
form into the same full-tensor dictionary (for tools and tests).

A checkpoint is written under a temporary name and renamed when complete, and `latest` is
replaced atomically after that, so a save killed midway leaves the previous checkpoint intact.
Loading uses `torch.load(weights_only=True)`: nothing in the file can execute code.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from megafp8.checkpoint.sharded import META_FILE, is_sharded_checkpoint, read_full
from megafp8.config import ConfigError

STATE_FILE = "state.pt"
LATEST_FILE = "latest"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(root: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write `state` as checkpoint `step` under `root` (call on one rank only); returns its directory."""
    tmp = fresh_temporary(root, step)
    torch.save(state, tmp / STATE_FILE)
    return publish(root, step, keep_last)


def fresh_temporary(root: Path, step: int) -> Path:
    """The empty directory checkpoint `step` is written into before `publish` (call on one rank)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (step_dir_name(step) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(root: Path, step: int, keep_last: int) -> Path:
    """Make the complete temporary directory of checkpoint `step` visible: rename it, then point `latest` at it
    (atomically), then prune to the newest `keep_last` (call on one rank, after every rank has written)."""
    final = root / step_dir_name(step)
    tmp = root / (final.name + ".tmp")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    latest_tmp = root / (LATEST_FILE + ".tmp")
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, root / LATEST_FILE)
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and _complete(p)]
    return sorted(found, key=lambda p: p.name)


def _complete(directory: Path) -> bool:
    """A full checkpoint's file, or a sharded checkpoint's index and meta.pt (rank 0 writes the latter last)."""
    if (directory / STATE_FILE).is_file():
        return True
    return is_sharded_checkpoint(directory) and (directory / META_FILE).is_file()


def find_latest(root: Path) -> Optional[Path]:
    pointer = root / LATEST_FILE
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if _complete(candidate):
            return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint directory (or its state file) onto the CPU, tensors and plain values only, every tensor at
    its full shape (a sharded checkpoint is consolidated in this process)."""
    if path.is_dir() and is_sharded_checkpoint(path):
        return _consolidate(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"checkpoint '{path}' not found (expected {file}); check checkpoint.resume")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise ConfigError(f"checkpoint file {file} is corrupt or not a megafp8 checkpoint: {err}") from None
    missing = [k for k in ("model", "optimizer", "step", "loader") if k not in state]
    if missing:
        raise ConfigError(f"checkpoint file {file} lacks {', '.join(missing)}: not a megafp8 training checkpoint")
    return state


def _consolidate(path: Path) -> dict[str, Any]:
    """A sharded checkpoint as the full-checkpoint dictionary."""
    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {path} lacks {META_FILE}: not a complete megafp8 checkpoint") from None
    except Exception as err:
        raise ConfigError(f"checkpoint file {path / META_FILE} is corrupt: {err}") from None
    tensors = read_full(path)
    state = {key: value for key, value in meta.items() if key != "optimizer_step"}
    state["model"] = {name.removeprefix("model/"): t for name, t in tensors.items() if name.startswith("model/")}
    state["optimizer"] = {"step": meta["optimizer_step"]}
    for kind in ("masters", "exp_avg", "exp_avg_sq"):
        prefix = f"optim/{kind}/"
        state["optimizer"][kind] = {name.removeprefix(prefix): t for name, t in tensors.items()
                                    if name.startswith(prefix)}
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
        advice = (f"the checkpoint's vocabulary has {rows.pop()} rows (padded for the layout it was saved at): set "
                  "model.vocab_size to that")
    else:
        advice = ("resume with the model settings it was saved with (`python tools/convert_checkpoint.py inspect "
                  f"{source}` lists them; the parallel layout may differ)")
    raise ConfigError(f"checkpoint {source} does not match this model: {problems[0]}{more}. To resume from it, "
                      f"{advice}; or set checkpoint.resume=none (or another checkpoint.dir) to start fresh")
