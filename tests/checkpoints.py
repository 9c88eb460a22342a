"""Shared by the checkpoint tests: a one-rank trainer of the tiny model, saved checkpoints to copy, a flipped byte."""
from __future__ import annotations

from pathlib import Path

import torch

from megafp8.config import load_config
from megafp8.parallel import ParallelDims
from megafp8.train import Trainer
from tests.conftest import TINY_OVERRIDES


def one_rank_trainer(overrides: list[str]) -> Trainer:
    return Trainer(load_config("tiny_dense", overrides), ParallelDims.single(), torch.device("cpu"))


def saved_checkpoints(corpus_dir: Path, base: Path) -> dict[str, Path]:
    """Checkpoints of steps 1 and 2 in both forms under `base`: {form: checkpoint root}. Tests copy them before
    changing anything."""
    roots = {}
    for form in ("sharded", "full"):
        out = base / form
        trainer = one_rank_trainer(TINY_OVERRIDES + [f"data.path={corpus_dir}", f"logging.output_dir={out}",
                                                     "run_name=t", f"checkpoint.dir={out / 'ck'}",
                                                     f"checkpoint.format={form}", "checkpoint.keep_last=0"])
        for _ in range(2):
            trainer.train_step()
            trainer.save()
        trainer.run_lock.release()
        roots[form] = out / "ck"
    return roots


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x10
    path.write_bytes(bytes(data))
