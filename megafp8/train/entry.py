"""The entry scripts' run (`launch/pretrain.py`, `tools/plan.py`): the launch and the config checked without torch
(`megafp8.train.command_line.load_run_config`, which also refuses a task of `srun -n N` started without torchrun),
then `megafp8.train.preview` (print, plan, layouts: no trainer, no checkpointing) or `megafp8.train.main` imported
past them, so a typo costs no torch import and `--print-config` none of the trainer's. Neither imports this module
(no import cycle)."""
from __future__ import annotations

import argparse

from megafp8.train.command_line import load_run_config, wants_preview


def run_staged(args: argparse.Namespace) -> int:
    """Load the config `args` name, then print, plan or train it as `args` asks; the exit status."""
    cfg = load_run_config(args)
    if isinstance(cfg, int):
        return cfg
    if wants_preview(args):  # print, plan or list layouts: torch and the planner, not the trainer
        from megafp8.train.preview import preview
        return preview(args, cfg)
    from megafp8.train.main import run_config  # torch, the model and the kernels: past a config that loads
    return run_config(args, cfg)
