"""One run directory holds one run: what an earlier launch left in it, and whether this launch may continue it.

A launch whose config matches the earlier run's (`config.yaml`), apart from the settings that may change between
launches of one run (`RELAUNCH_SETTINGS`: how long, where and how it runs, what it logs), continues that run:
`checkpoint.resume=auto` resumes its newest checkpoint (what a SLURM requeue needs), or starts it over from step 0
where it saved none. Metric records after the step a launch starts from are dropped, so a curve is never spliced.
Another config, or `checkpoint.resume=none` over the run's checkpoints, is refused in one line unless
`checkpoint.overwrite` says to replace the earlier run.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from megafp8.checkpoint.local import LATEST_FILE, list_checkpoints

log = logging.getLogger("megafp8")
CONFIG_FILE = "config.yaml"
RUN_INFO_FILE = "run_info.json"
# Settings (dotted prefixes) that may differ between launches of one run.
RELAUNCH_SETTINGS = ("training.steps", "training.device", "training.compile", "training.recompute",
                     "training.eval_interval", "training.eval_iters", "training.micro_batch_size", "parallel.",
                     "checkpoint.", "logging.", "precision.fp8_backend")
# What a run writes into its run directory besides the checkpoints and the metrics file (removed on overwrite).
_RUN_FILES = (CONFIG_FILE, RUN_INFO_FILE, "tensorboard", "wandb")


@dataclass(frozen=True)
class EarlierRun:
    """What an earlier launch left: its config (None if it left no config.yaml), metrics and checkpoints."""

    config: Optional[dict[str, Any]]
    has_metrics: bool
    checkpoints: list[str]


@dataclass(frozen=True)
class Verdict:
    """How this launch treats the run directory: `refusal` (one line) or `replace` the earlier run."""

    refusal: Optional[str] = None
    replace: bool = False


def read_earlier_run(run_dir: Path, checkpoint_dir: Path, metrics_path: Path) -> Optional[EarlierRun]:
    """What an earlier launch left in `run_dir` (and `checkpoint_dir`, `metrics_path`); None if nothing."""
    config_file = run_dir / CONFIG_FILE
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else None
    checkpoints = [p.name for p in list_checkpoints(checkpoint_dir)]
    has_metrics = metrics_path.is_file() and metrics_path.stat().st_size > 0
    if config is None and not checkpoints and not has_metrics:
        return None
    return EarlierRun(config if isinstance(config, dict) else None, has_metrics, checkpoints)


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: <saved> there, <current> here` for each setting that makes `current` another run than `saved`."""
    old, new = _flat(saved), _flat(current)
    keys = [k for k in dict.fromkeys([*new, *old]) if not k.startswith(RELAUNCH_SETTINGS)]
    return [f"{k}: {old.get(k)} there, {new.get(k)} here" for k in keys if old.get(k) != new.get(k)]


def judge(earlier: Optional[EarlierRun], current: dict[str, Any], resume: str, overwrite: bool, run_dir: Path,
          checkpoint_dir: Path) -> Verdict:
    """Whether this launch (resolved config `current`) may use `run_dir`, given what an earlier launch left."""
    if earlier is None:
        return Verdict()
    changes = config_changes(earlier.config, current) if earlier.config is not None else []
    if changes:
        if overwrite:
            return Verdict(replace=True)
        more = f" and {len(changes) - 1} more setting(s)" if len(changes) > 1 else ""
        return Verdict(refusal=f"{run_dir} holds another run ({changes[0]}{more}): give this run another run_name, "
                               "or set checkpoint.overwrite=true to replace that run")
    if resume == "none" and earlier.checkpoints:
        if overwrite:
            return Verdict(replace=True)
        return Verdict(refusal=f"checkpoint.resume=none, but {checkpoint_dir} holds this run's checkpoints (newest "
                               f"{earlier.checkpoints[-1]}): leave checkpoint.resume=auto to continue it, give this "
                               "run another run_name, or set checkpoint.overwrite=true to start it over")
    return Verdict()


def remove_earlier_run(run_dir: Path, checkpoint_dir: Path, metrics_path: Path) -> None:
    """Delete an earlier run's checkpoints, metrics and run files (`checkpoint.overwrite`); nothing else."""
    for path in list_checkpoints(checkpoint_dir) + [checkpoint_dir / LATEST_FILE, metrics_path] + \
            [run_dir / name for name in _RUN_FILES]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def drop_metrics_after(metrics_path: Path, step: int) -> int:
    """Remove the records after `step` from the metrics file (records without a step stay); returns how many."""
    if not metrics_path.is_file():
        return 0
    lines = metrics_path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and _step_of(line) <= step]
    dropped = len(lines) - len(kept)
    if dropped:
        tmp = metrics_path.with_name(metrics_path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, metrics_path)
    return dropped


def _step_of(line: str) -> int:
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return 2**62  # an unreadable line is dropped
    return int(step) if isinstance(step, (int, float)) else -1
