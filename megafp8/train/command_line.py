"""The command line of `launch/pretrain.py` and `tools/plan.py`, without torch: the options, the config, and how a
process reports an error and leaves. Those scripts parse and load the config here first, so --help, usage errors and
a config that does not load answer at once; torch's import (seconds, more from a cluster's shared file system) comes
only past them, with `megafp8.train.main` (whose `main` and `plan_main` do both in one call, for callers in Python)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NoReturn

from megafp8.config import Config, ConfigError, load_config, repeated_overrides
from megafp8.config.arguments import positive_number, print_warnings, whole_number


H200_GIB = 139.8  # what torch reports for an H200's memory (143,771 MiB)


TRAIN_DESCRIPTION = ("Pretrain a language model. Run as `python launch/pretrain.py --config NAME` (one rank) "
                     "or under `torchrun --nproc_per_node=N launch/pretrain.py --config NAME`.")
PLAN_DESCRIPTION = ("Plan a run without allocating it: parameters by part, memory per GPU, FLOPs per token and "
                    "tokens/s at an assumed MFU. Same as `python launch/pretrain.py --config NAME --dry-run`. With "
                    "--layouts: every TP x PP x EP x DP layout on --world-size GPUs, its memory, and the one to "
                    "start with.")


class CommandLineParser(argparse.ArgumentParser):
    """argparse whose usage errors end with how to write what was probably meant (`usage_hint`)."""

    def error(self, message: str) -> NoReturn:
        super().error(message + usage_hint(message))


def usage_hint(message: str) -> str:
    """For an argparse error: settings given as options (`--training.steps=10`) are overrides without dashes; a
    config given without `--config` needs it."""
    unknown = message.partition("unrecognized arguments: ")[2].split()
    dotted = [arg.lstrip("-") for arg in unknown if arg.startswith("--") and "." in arg.partition("=")[0]]
    if dotted:
        return f" (settings are overrides without dashes, after the options: {' '.join(dotted)})"
    if unknown:
        return (" (settings go after the options as section.key=value, e.g. training.steps=10; --print-config "
                "lists them)")
    if "required: --config" in message:
        return " (e.g. --config tiny_dense.yaml: a file in configs/, or a path)"
    return ""


def build_parser(prog: str, description: str, plan_only: bool = False) -> argparse.ArgumentParser:
    """The command line of `launch/pretrain.py`, or with `plan_only` that of `tools/plan.py` (always a dry run)."""
    parser = CommandLineParser(prog=prog, description=description)
    parser.add_argument("--config", required=True,
                        help="a YAML path, or a name in configs/ (with or without .yaml), e.g. tiny_dense")
    if not plan_only:
        parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        parser.add_argument("--dry-run", action="store_true",
                            help="print parameters, per-GPU memory and FLOPs of the run and exit (allocates nothing); "
                                 "with --evaluate, also the checkpoint the evaluation would load, checked complete "
                                 "(its files are not read)")
        parser.add_argument("--evaluate", action="store_true",
                            help="evaluate the checkpoint checkpoint.resume names (auto: the run's newest that "
                                 "verifies) on training.eval_iters held-out micro-batches, print its record as JSON "
                                 "and exit; writes nothing")
    parser.add_argument("--world-size", type=whole_number(1), default=None,
                        help="ranks to plan the dry run for (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--peak-tflops", type=positive_number(), default=989.4,
                        help="dry run: peak TFLOP/s per GPU (H100/H200)")
    parser.add_argument("--mfu", type=positive_number(1, " (a fraction: 0.4 is 40%)"), default=0.4,
                        help="dry run: model FLOPs utilization to assume (above 0, at most 1)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted overrides, e.g. model.num_layers=2 optimizer.lr=1e-3")
    if plan_only:
        parser.add_argument("--layouts", action="store_true",
                            help="list every parallel layout on --world-size GPUs with its planned memory, and "
                                 "recommend the one with the least model parallelism that fits")
        parser.add_argument("--gpu-gib", type=positive_number(), default=None,
                            help="--layouts: memory per GPU in GiB (default: this machine's GPU, else an H200's "
                                 f"{H200_GIB:g})")
        parser.add_argument("--max-tp", type=int, default=8,
                            help="--layouts: the largest tensor-parallel size to consider (GPUs of one node)")
        parser.add_argument("--max-cp", type=int, default=None,
                            help="--layouts: also try context parallelism up to this size (long sequences; default: "
                                 "the config's parallel.cp)")
        parser.set_defaults(print_config=False, dry_run=True, evaluate=False)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser("pretrain.py", TRAIN_DESCRIPTION).parse_args(argv)


def env_rank() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) under plain python. Also (0, 0, 1) in
    each task of `srun -n N` without torchrun, which `srun_launch_status` refuses before anything runs."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def srun_tasks_without_torchrun() -> int:
    """N where `srun` started this process as one of N > 1 tasks of a job step and no launcher gave it a rank
    (`srun -n 4 python launch/pretrain.py`): each task would run alone as rank 0 of 1. 0 for any other start. As
    SLURM 22.05 sets them: a step's tasks carry SLURM_STEP_NUM_TASKS (and SLURM_PROCID, their index); the batch
    script itself carries the job's SLURM_NTASKS but no SLURM_STEP_NUM_TASKS; torchrun's workers inherit their node's
    task's count, beside the WORLD_SIZE that torchrun sets; a shell of `srun --pty` (SLURM_PTY_PORT) inherits its
    step's count too, and starts one process at a time."""
    if "WORLD_SIZE" in os.environ or "SLURM_PTY_PORT" in os.environ:
        return 0
    tasks = os.environ.get("SLURM_STEP_NUM_TASKS", "")
    return int(tasks) if tasks.isdigit() and int(tasks) > 1 else 0


def srun_launch_status() -> int | None:
    """Exit status 2 for a process that `srun` started as one of several tasks without torchrun
    (`srun_tasks_without_torchrun`), the error printed by the step's first task alone (every task has the same to
    say, and each would report as rank 0); None for any other start."""
    tasks = srun_tasks_without_torchrun()
    if not tasks:
        return None
    if os.environ.get("SLURM_PROCID", "0") == "0":
        report_error(f"srun started this process as one of {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}) without "
                     "torchrun: none has a rank (RANK and WORLD_SIZE are unset), so each would run alone as rank 0 "
                     "of 1. Start one torchrun per node inside srun, as launch/slurm/pretrain.sbatch does (srun "
                     "--ntasks-per-node=1 torchrun --nnodes=$SLURM_JOB_NUM_NODES --nproc_per_node=N --rdzv_backend="
                     "c10d --rdzv_endpoint=HOST:PORT launch/pretrain.py ...), or submit the run with "
                     "launch/slurm/submit.py")
    return 2


def write_error_file(line: str) -> None:
    """Record `line` in torchrun's error file for this rank (`TORCHELASTIC_ERROR_FILE`, set by torchrun), the form
    torch.distributed.elastic's `record` writes: torchrun's failure summary then shows the line instead of "To
    enable traceback see ...". Nothing outside torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the summary then falls back to torchrun's own words; the line was printed already


def report_error(message: str, linger_s: float = 2.0) -> None:
    """Print `error: <message>` once per job and record it in torchrun's error file. Rank 0 reports at once;
    another rank first lingers `linger_s`: where rank 0 hit the same error, torchrun ends the job meanwhile (so the
    line appears once), and where the error is this rank's alone, it then reports it itself."""
    if env_rank()[0] != 0:
        time.sleep(linger_s)
    line = f"error: {message}"
    print(line, file=sys.stderr, flush=True)
    write_error_file(line)


def exit_process(code: int) -> None:
    """Leave without running C++ static destructors: gloo's transport threads can still be joinable then,
    and destroying them aborts the process ("terminate called without an active exception", exit -6)
    after a run that finished cleanly. Everything the run wrote is closed by now; flush stdio and go."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def load_run_config(args: argparse.Namespace) -> Config | int:
    """The config `args` name, loaded and checked as far as it can be without torch; where it cannot be, or where
    `srun` started this process as one of several tasks without torchrun (`srun_launch_status`), the error reported
    in one line and the exit status 2. `megafp8.train.entry.run_staged` (the entry scripts) calls this first and
    imports torch only past it (`megafp8.train.preview` or `megafp8.train.main`), so a typo costs no torch import;
    `megafp8.train.main.run` (callers in Python) calls it too."""
    refused = srun_launch_status()
    if refused is not None:
        return refused
    if env_rank()[0] == 0:  # once per job
        print_warnings(repeated_overrides(args.overrides))
    try:
        cfg = load_config(args.config, args.overrides)
        if getattr(args, "evaluate", False) and cfg.training.eval_iters == 0:  # (its loss was NaN, exit status 0)
            raise ConfigError("--evaluate with training.eval_iters=0 evaluates no micro-batch: give "
                              "training.eval_iters=N (N held-out micro-batches) or -1 (the whole validation split)")
    except ConfigError as err:
        return error_status(str(err))
    return cfg


def wants_preview(args: argparse.Namespace) -> bool:
    """Whether `args` ask to print, plan or list layouts (`megafp8.train.preview`), not to train or evaluate."""
    return bool(args.print_config or getattr(args, "layouts", False) or args.dry_run)


def parse_plan_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser("plan.py", PLAN_DESCRIPTION, plan_only=True).parse_args(argv)


def error_status(message: str) -> int:
    """Report `message` in one line, once per job (`report_error`); the exit status 2."""
    report_error(message)
    return 2
