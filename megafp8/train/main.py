"""Command-line entry of a training run (`launch/pretrain.py`): parse, set up, train, shut down cleanly."""
from __future__ import annotations

import argparse
import json
import logging
import re
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from megafp8.checkpoint.local import find_latest
from megafp8.config import (Config, ConfigError, dump_config, ignored_settings, load_config,
                            repeated_overrides)
from megafp8.config.arguments import positive_number, print_warnings, whole_number
from megafp8.parallel import ParallelDims
from megafp8.precision import check_backend_name
from megafp8.train.checkpointing import CheckpointWriteError
from megafp8.train.layouts import lighter_settings, render_layouts, search_layouts
from megafp8.train.plan import GIB, dry_run, make_plan, vocab_note, with_vocab
from megafp8.train.preemption import exit_status
from megafp8.train.resume import checkpoint_to_evaluate
from megafp8.train.run_history import run_paths
from megafp8.train.runtime import (env_rank, init_distributed, report_error, seed_everything, set_determinism,
                                   shutdown)
from megafp8.train.trainer import Trainer

log = logging.getLogger("megafp8")
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


def _error(message: str) -> int:
    """Report `message` in one line, once per job (`megafp8.train.runtime.report_error`); the exit status 2."""
    report_error(message)
    return 2


def out_of_memory_message(cfg: Config, err: BaseException, step: int | None, world_size: int) -> str:
    """One line for a run that ran out of device memory: where, what the device held, the plan's figure, and what to
    change. torch's own message is a paragraph, and its advice (expandable segments) is what
    `training.cuda_alloc_conf: auto` gives already on most layouts."""
    asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", str(err))
    where = f"at step {step + 1}" if step is not None else "while setting up"
    parts = [f"out of memory {where}" + (f" (allocating {asked.group(1)})" if asked else "")]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        parts.append(f"GPU {device}: peak {torch.cuda.max_memory_allocated(device) / GIB:,.1f} GiB in tensors, "
                     f"{torch.cuda.memory_reserved(device) / GIB:,.1f} reserved, of "
                     f"{torch.cuda.get_device_properties(device).total_memory / GIB:,.1f}")
    try:
        parts.append(f"planned {make_plan(with_vocab(cfg), world_size).total_bytes / GIB:,.2f} GiB per rank")
    except Exception:  # the plan is only a hint here; the error to report is the memory
        pass
    t = cfg.training
    fixes = []
    if t.micro_batch_size > 1:
        fixes.append(f"lower training.micro_batch_size (now {t.micro_batch_size}; global_batch_size "
                     f"{t.global_batch_size} stays, with more accumulation steps)")
    if t.recompute == "none":
        fixes.append("set training.recompute=full")
    elif t.recompute_layers is not None:
        fixes.append(f"raise training.recompute_layers (now {t.recompute_layers}; null recomputes every block)")
    fixes.append("spread the model over more GPUs (parallel.tp, parallel.pp, parallel.ep)")
    seen = ""
    if step is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        seen = (f"; relaunched with logging.memory_snapshot_steps={step + 1}, the run writes what held the memory "
                "until then")
    return ("; ".join(parts) + ". To fit: " + ", or ".join(fixes) + f". `python tools/plan.py --config ... "
            f"--world-size {world_size}` shows the memory per rank" + seen)


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
    checkpoint = checkpoint_to_evaluate(cfg.checkpoint.resume, run_paths(cfg)[1], ParallelDims.single(), verify=False)
    iters = cfg.training.eval_iters
    batches = "the whole held-out split" if iters == -1 else f"training.eval_iters={iters} held-out micro-batches"
    return (f"--evaluate: would load {checkpoint} (complete; its checksums are verified as it loads) and evaluate it "
            f"on {batches} of data.valid_split '{cfg.data.valid_split}', writing nothing")


def plan_main(argv: list[str] | None = None) -> int:
    """`tools/plan.py`: the dry run under its own name and usage."""
    return run(build_parser("plan.py", PLAN_DESCRIPTION, plan_only=True).parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """`launch/pretrain.py`."""
    return run(parse_args(argv))


_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|NCCL communicator was aborted|"
                        r"ProcessGroup\w* .*(aborted|shut ?down)")
_TIMED_OUT = re.compile(r"[Tt]imed out|[Tt]imeout")


def lost_peer_message(err: RuntimeError, timeout_minutes: float) -> Optional[str]:
    """One line for a collective that failed because another rank went away (killed, or failed first) or never
    came, in place of gloo's or NCCL's traceback on every surviving rank; None for any other RuntimeError."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if _PEER_LOST.search(str(err)):
        return (f"rank {dist.get_rank()} lost another rank mid-collective: it ended or failed first (torchrun's "
                f"summary names it, and its own error comes first in the log) [{text}]")
    if _TIMED_OUT.search(str(err)) and (isinstance(err, dist.DistError) or re.search(r"gloo|NCCL", str(err))):
        return (f"rank {dist.get_rank()} waited parallel.timeout_minutes={timeout_minutes:g} in a collective for a "
                f"rank that never came (stopped, hung or far slower) [{text}]")
    return None


def _where_a_relaunch_resumes(trainer: Optional[Trainer]) -> str:
    if trainer is None:
        return "stopped before training"
    try:
        latest = find_latest(trainer.checkpointer.directory)
    except OSError:
        latest = None
    return f"a relaunch resumes from {latest}" if latest is not None else "this run has saved no checkpoint yet"


def run(args: argparse.Namespace) -> int:
    """Print the config, plan, or train, as `args` asks; the exit status."""
    if env_rank()[0] == 0:  # once per job
        print_warnings(repeated_overrides(args.overrides))
    try:
        cfg = load_config(args.config, args.overrides)
        check_backend_name(cfg.precision.fp8_backend)  # the backends register in `precision`, above the config
        if getattr(args, "evaluate", False) and cfg.training.eval_iters == 0:  # (its loss was NaN, exit status 0)
            raise ConfigError("--evaluate with training.eval_iters=0 evaluates no micro-batch: give "
                              "training.eval_iters=N (N held-out micro-batches) or -1 (the whole validation split)")
    except ConfigError as err:
        return _error(str(err))
    if env_rank()[0] == 0:
        print_warnings(ignored_settings(cfg))
    if args.print_config:
        print(dump_config(cfg), end="")
        print(vocab_note(cfg) or "", end="")
        return 0
    if getattr(args, "layouts", False):
        try:
            print(layouts_main(cfg, args.world_size or env_rank()[2], args.gpu_gib, args.max_tp, args.max_cp))
        except ConfigError as err:
            return _error(str(err))
        return 0
    if args.dry_run:
        try:  # both before either prints: an error is the one line printed
            plan = dry_run(cfg, args.world_size or env_rank()[2], args.peak_tflops, args.mfu)
            evaluation = f"\n\n{evaluation_plan(cfg)}" if args.evaluate else ""
        except ConfigError as err:
            return _error(str(err))
        print(plan + evaluation)
        return 0
    clean, trainer = False, None
    try:
        dims, device = init_distributed(cfg)
        set_determinism(cfg.training.deterministic)
        seed_everything(cfg.training.seed)
        trainer = Trainer(cfg, dims, device, evaluate_only=args.evaluate)
        if args.evaluate:
            record = trainer.evaluate_checkpoint()
            if dims.rank == 0:
                print(json.dumps(record), flush=True)
            clean = True
            return 0
        trainer.fit()
        clean = True
        if trainer.stopped_on is not None:  # checkpointed, not finished: say so as the signal would have
            return exit_status(trainer.stopped_on)
    except ConfigError as err:
        return _error(str(err))
    except FloatingPointError as err:  # the loss diverged: every rank sees the same reduced loss
        _error(str(err))
        return 1
    except CheckpointWriteError as err:  # raised on every rank alike, whichever rank's write failed
        _error(str(err))
        return 1
    except torch.OutOfMemoryError as err:
        log.debug("out of memory", exc_info=True)
        _error(out_of_memory_message(cfg, err, trainer.step if trainer is not None else None, env_rank()[2]))
        return 1
    except RuntimeError as err:  # after CheckpointWriteError and OutOfMemoryError, which are RuntimeErrors too
        lost = lost_peer_message(err, cfg.parallel.timeout_minutes)
        if lost is None:
            raise
        log.debug("lost a peer", exc_info=True)
        _error(lost)
        return 1
    except KeyboardInterrupt:
        log.warning("interrupted (SIGINT: nothing saved; SIGTERM or SIGUSR1 stop with a checkpoint): %s",
                    _where_a_relaunch_resumes(trainer))
        return 130
    finally:
        shutdown(clean)
    return 0
