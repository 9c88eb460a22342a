"""What the launcher does with a config short of training it: print it (`--print-config`), plan it (`--dry-run`,
`tools/plan.py`) or list its layouts (`--layouts`), after the checks every run makes first (`checked`).

Imports torch, the backends and the planner, not the trainer or checkpointing (whose torch.distributed.checkpoint
brings DTensor: ~1.1 s of a 2-core machine's start-up): the entry scripts come here without importing
`megafp8.train.main` (`megafp8.train.entry`), and `--print-config` starts ~1.7 s sooner there."""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from megafp8.config import Config, ConfigError, dump_config, ignored_settings
from megafp8.config.arguments import print_warnings
from megafp8.precision import check_backend_name
from megafp8.train.command_line import H200_GIB, env_rank, error_status
from megafp8.train.layouts import lighter_settings, render_layouts, search_layouts
from megafp8.train.plan import GIB, dry_run, vocab_note

LONG_SEQUENCE = 8192  # tokens a sequence from which the layout search's advice names context parallelism


def layouts_main(cfg: Config, world_size: int, gpu_gib: float | None, max_tp: int,
                 max_cp: int | None = None) -> str:
    """`tools/plan.py --layouts`: the layout search's table for `cfg` on `world_size` GPUs."""
    max_cp = cfg.parallel.cp if max_cp is None else max_cp
    if world_size < 1 or max_tp < 1 or max_cp < 1:  # --gpu-gib is checked as it is parsed (`positive_number`)
        raise ConfigError(f"--layouts needs --world-size, --max-tp and --max-cp above 0 (got {world_size}, {max_tp}, "
                          f"{max_cp})")
    if gpu_gib is None:
        gpu_gib = (torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available()
                   else H200_GIB)
    gpu_bytes = gpu_gib * GIB
    lighter = lighter_settings(cfg)
    if max_cp == 1 and cfg.data.seq_len >= LONG_SEQUENCE:  # activations per sequence: context parallelism splits them
        lighter.append("try context parallelism (--max-cp 8)")
    return render_layouts(search_layouts(cfg, world_size, gpu_bytes, max_tp, max_cp=max_cp), world_size,
                          gpu_bytes, lighter)


def evaluation_plan(cfg: Config) -> str:
    """`--dry-run --evaluate`: the checkpoint the evaluation would load, found as it finds it and checked complete
    (every file its manifest lists there, at its size) without reading it; a ConfigError where there is none."""
    from megafp8.parallel import ParallelDims
    from megafp8.train.resume import checkpoint_to_evaluate  # checkpointing's modules: only for `--evaluate`
    from megafp8.train.run_history import run_paths

    checkpoint = checkpoint_to_evaluate(cfg.checkpoint.resume, run_paths(cfg)[1], ParallelDims.single(), verify=False)
    iters = cfg.training.eval_iters
    batches = "the whole held-out split" if iters == -1 else f"training.eval_iters={iters} held-out micro-batches"
    return (f"--evaluate: would load {checkpoint} (complete; its checksums are verified as it loads) and evaluate it "
            f"on {batches} of data.valid_split '{cfg.data.valid_split}', writing nothing")


def checked(cfg: Config) -> Optional[int]:
    """What every run checks past its config: the FP8 backend's name (the backends register in `precision`, above
    the config), and rank 0 warns of settings this run ignores; the error's exit status, or None."""
    try:
        check_backend_name(cfg.precision.fp8_backend)
    except ConfigError as err:
        return error_status(str(err))
    if env_rank()[0] == 0:
        print_warnings(ignored_settings(cfg))
    return None


def preview(args: argparse.Namespace, cfg: Config) -> int:
    """`--print-config`, `--layouts` or `--dry-run` (`wants_preview(args)`) of `cfg`, after `checked`; the exit
    status."""
    status = checked(cfg)
    if status is not None:
        return status
    if args.print_config:
        print(dump_config(cfg), end="")
        print(vocab_note(cfg) or "", end="")
        return 0
    if getattr(args, "layouts", False):
        try:
            print(layouts_main(cfg, args.world_size or env_rank()[2], args.gpu_gib, args.max_tp, args.max_cp))
        except ConfigError as err:
            return error_status(str(err))
        return 0
    try:  # both before either prints: an error is the one line printed
        plan = dry_run(cfg, args.world_size or env_rank()[2], args.peak_tflops, args.mfu)
        evaluation = f"\n\n{evaluation_plan(cfg)}" if args.evaluate else ""
    except ConfigError as err:
        return error_status(str(err))
    print(plan + evaluation)
    return 0
