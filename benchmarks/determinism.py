#!/usr/bin/env python
"""Where a training run stops being repeatable on this machine: the same run twice in one process, from the same
seed (so the same weights and batches), its first step's gradients compared parameter by parameter, bit for bit,
then every step's loss.

    PYTHONPATH=. python benchmarks/determinism.py --model moe --steps 10 training.compile=true \\
        training.compile_mode=reduce-overhead --recipes bf16 fp8
    PYTHONPATH=. python benchmarks/determinism.py --model moe --steps 10 --deterministic ...   # the same, under
        # `training.deterministic` (its settings hold for the whole process)
    PYTHONPATH=. python benchmarks/determinism.py --model 8b-layers --steps 6 --only inductor --recipes fp8 ...
        # one part of the mode alone (`megafp8.train.runtime.DETERMINISM_PARTS`): which one the run needs to repeat
    PYTHONPATH=. python benchmarks/determinism.py --model tiny --steps 3 training.device=cpu   # a smoke test

On the GPU two runs of one seed drift apart (the MoE parity model's first logged losses already differed; its
four BF16 runs ended 0.85% apart, `docs/benchmarks.md`, jobs IP-IR and IV; on the 3.2B MoE step this found 61 of
72 BF16 parameters' first gradients differing and 2 of FP8's, and none of either under `--deterministic`, jobs
IT-IU). A gradient that differs after the first
backward names the layers whose kernels sum in a varying order (attention's backward, atomic adds, ...); a first
step whose loss differs says whether the forward is repeatable. The models are `benchmarks/train_step.py`'s, on the
same data. One table per recipe, printed as Markdown: the parameter groups (layer indices replaced by `*`) with
how many of their parameters' first gradients differ and by how much (the largest difference over the largest
magnitude), and the first step whose loss differs. The first run's gradients are kept on the host while the second
runs (the 3.2B MoE model's: ~13 GB).
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from megafp8.train.runtime import (  # noqa: E402
    DETERMINISM_PARTS, init_distributed, seed_everything, set_determinism, shutdown)
from megafp8.train.trainer import Trainer  # noqa: E402

import train_step  # noqa: E402  (benchmarks/, beside this file: its models, data and run settings)


def group_of(name: str) -> str:
    """A parameter's group: its name with layer and expert indices as `*` (`layers.3.attn.qkv_proj.weight` ->
    `layers.*.attn.qkv_proj.weight`)."""
    return re.sub(r"\.\d+\.", ".*.", name)


def one_run(cfg, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """(the first step's gradient of every parameter, on the host; every step's loss) of a fresh run of `cfg` (in a
    run directory of its own)."""
    dims, device = init_distributed(cfg)
    seed_everything(cfg.training.seed)
    torch._dynamo.reset()  # each run compiles as the first did (as train_step.py's runs do)
    trainer = Trainer(cfg, dims, device)
    grads: dict[str, torch.Tensor] = {}
    losses = []
    for step in range(steps):
        loss, _ = trainer.train_step()
        if step == 0:  # the gradients stay in their buffers until the next step
            grads = {name: p.main_grad.detach().to("cpu", copy=True) for name, p in trainer.model.named_parameters()
                     if getattr(p, "main_grad", None) is not None}
        losses.append(loss.item())
    trainer.metrics.close()
    trainer.run_lock.release()
    del trainer
    train_step.release_memory(device)
    return grads, losses


def compare_gradients(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> list[tuple[str, int, int,
                                                                                                      float, str]]:
    """Per parameter group: (group, parameters, how many differ bit for bit, the largest difference over the largest
    magnitude among those that differ, which of them differ by their indices: `index_spans`), groups with a
    difference first, then by name. Which layers differ says where a difference entered the backward: it reaches
    every layer below the one it entered."""
    if first.keys() != second.keys():
        raise ValueError(f"the runs have other parameters: {sorted(first.keys() ^ second.keys())[:5]}")
    groups: dict[str, list] = {}
    for name, a in first.items():
        b = second[name]
        entry = groups.setdefault(group_of(name), [0, 0, 0.0, []])
        entry[0] += 1
        if not torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b):  # bits, NaN included
            entry[1] += 1
            scale = max(a.abs().max().item(), b.abs().max().item()) or 1.0
            entry[2] = max(entry[2], (a - b).abs().max().item() / scale)
            entry[3].append(".".join(re.findall(r"\.(\d+)(?=\.)", name)))
    rows = [(group, int(n), int(differ), float(rel), index_spans(which))
            for group, (n, differ, rel, which) in groups.items()]
    return sorted(rows, key=lambda row: (row[2] == 0, row[0]))


def index_spans(indices: list[str], most: int = 16) -> str:
    """Differing members' indices, compact: single integers as sorted runs (`0-3, 6`), others (`layer.expert`) as
    they are, at most `most` of them; `-` for none or a group without indices."""
    if not any(indices):
        return "-"
    if all(i.isdigit() for i in indices):
        values, runs = sorted(int(i) for i in indices), []
        for value in values:
            if runs and value == runs[-1][1] + 1:
                runs[-1][1] = value
            else:
                runs.append([value, value])
        parts = [str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs]
    else:
        parts = indices
    return ", ".join(parts[:most]) + (f", ... ({len(parts) - most} more)" if len(parts) > most else "")


def first_difference(first: list[float], second: list[float]) -> int | None:
    """The first step (1-based) whose loss differs between the runs, None if none does."""
    return next((i + 1 for i, (a, b) in enumerate(zip(first, second)) if a != b), None)


def report(recipe: str, rows: list[tuple[str, int, int, float, str]], losses: tuple[list[float], list[float]],
           mode: str = "") -> str:
    """One recipe's Markdown section; `mode` ("training.deterministic", "deterministic parts: inductor", or "" for
    plain) goes into its heading."""
    differ = sum(row[2] for row in rows)
    total = sum(row[1] for row in rows)
    step = first_difference(*losses)
    lines = [f"### {recipe}{', ' + mode if mode else ''}", "",
             f"- first step's gradients: {differ} of {total} parameters differ between the two runs",
             f"- losses: {'the same at every one of' if step is None else f'first differ at step {step} of'} "
             f"{len(losses[0])} steps ({losses[0][-1]!r} and {losses[1][-1]!r} at the last)", "",
             "| parameters | count | differ | largest difference / largest magnitude | which differ |",
             "|---|---|---|---|---|"]
    lines += [f"| `{group}` | {n} | {d} | {rel:.2e} | {which} |" for group, n, d, rel, which in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(train_step.MODELS), default="moe")
    parser.add_argument("--config", default="tiny_dense", help="the config the runs start from (as train_step.py)")
    parser.add_argument("--recipes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                        help="(put `section.key=value` overrides before this option)")
    parser.add_argument("--steps", type=int, default=10)
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--deterministic", action="store_true", help="run both under `training.deterministic`")
    modes.add_argument("--only", nargs="+", choices=DETERMINISM_PARTS, metavar="PART",
                       help="run both under these parts of `training.deterministic` alone (`algorithms` brings "
                            "`cublas`), for the whole process (put overrides before this option)")
    parser.add_argument("--data", type=Path, default=Path("/tmp/megafp8-bench-data"))
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    # train_step.run_config's settings: the same runs as the step benchmark, logged every step
    args.log_interval, args.global_batch = 1, None
    args.overrides = args.overrides + [f"training.deterministic={str(args.deterministic).lower()}"]
    # before the first CUDA matmul, for the whole process
    set_determinism(args.deterministic or bool(args.only), args.only or DETERMINISM_PARTS)
    mode = ("training.deterministic" if args.deterministic
            else f"deterministic parts: {', '.join(args.only)}" if args.only else "")
    sections, clean = [], False
    try:
        data = train_step.corpus(args.data)
        for recipe in args.recipes:
            runs = []
            for _ in range(2):  # the same settings, each run in a directory of its own, removed after it
                with tempfile.TemporaryDirectory(prefix="megafp8-determinism-") as out:
                    args.out = Path(out)
                    runs.append(one_run(train_step.run_config(args.model, recipe, args, data), args.steps))
            (grads_a, losses_a), (grads_b, losses_b) = runs
            sections.append(report(recipe, compare_gradients(grads_a, grads_b), (losses_a, losses_b), mode))
        clean = True
    finally:
        shutdown(clean)
    print("\n\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
