"""Experiment logging on rank 0: the JSON-lines metrics file, TensorBoard, and Weights & Biases.

`logging.backends` chooses them. Every record is written to each backend: numeric fields become
scalars named `<kind>/<field>` (nested ones, such as FP8 health, `<kind>/<layer>/<tensor>/<stat>`)
at the record's step. W&B runs offline unless an API key is configured (`WANDB_API_KEY`) or
`WANDB_MODE` says otherwise, so it never needs the network. The resolved config and the git
commit of the code are recorded with each run.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Any, Optional

import torch

from megafp8.config import ConfigError
from megafp8.train.metrics import MetricsFile

REPO = Path(__file__).resolve().parents[2]


def git_commit() -> str:
    """The commit of the code that runs (with `+dirty` if it has local changes), or `unknown`."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a nested record as {"a/b/c": value}."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value is not None:
            out[name] = float(value)
    return out


class ExperimentLogger:
    """Writes run info and metric records to the configured backends; a no-op on ranks other than 0."""

    def __init__(self, backends: list[str], run_dir: Path, metrics_path: Path, run_name: str,
                 config: dict[str, Any], wandb_project: str, enabled: bool) -> None:
        self.enabled = enabled
        self.jsonl = MetricsFile(metrics_path, enabled=enabled and "jsonl" in backends)
        self.tensorboard: Optional[Any] = None
        self.wandb_run: Optional[Any] = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        info = {"kind": "run", "run_name": run_name, "git_commit": git_commit(), "torch": torch.__version__,
                "host": socket.gethostname(), "config": config}
        (run_dir / "run_info.json").write_text(json.dumps(info, indent=1))
        self.jsonl.write(info)
        if "tensorboard" in backends:
            self.tensorboard = self._open_tensorboard(run_dir, info)
        if "wandb" in backends:
            self.wandb_run = self._open_wandb(run_dir, run_name, wandb_project, info)

    @staticmethod
    def _open_tensorboard(run_dir: Path, info: dict[str, Any]) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("logging.backends has 'tensorboard' but the tensorboard package is missing: "
                              "pip install tensorboard (or pip install -e '.[logging]')") from None
        writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        writer.add_text("run/git_commit", info["git_commit"])
        writer.add_text("run/config", "```\n" + json.dumps(info["config"], indent=1) + "\n```")
        return writer

    @staticmethod
    def _open_wandb(run_dir: Path, run_name: str, project: str, info: dict[str, Any]) -> Any:
        try:
            import wandb
        except ImportError:
            raise ConfigError("logging.backends has 'wandb' but the wandb package is missing: "
                              "pip install wandb (or pip install -e '.[logging]')") from None
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        return wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode,
                          config={**info["config"], "git_commit": info["git_commit"]})

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.jsonl.write(record)
        kind, step = record.get("kind", "train"), int(record.get("step", 0))
        scalars = flatten({k: v for k, v in record.items() if k not in ("kind", "step")}, prefix=f"{kind}/")
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
