"""Command-line entry of a training run (`launch/pretrain.py`): parse, set up, train, shut down cleanly."""
from __future__ import annotations

import argparse
import logging

from megafp8.config import ConfigError, dump_config, load_config
from megafp8.precision import check_backend_name
from megafp8.train.plan import dry_run
from megafp8.train.runtime import env_rank, init_distributed, report_error, seed_everything, shutdown
from megafp8.train.trainer import Trainer

log = logging.getLogger("megafp8")


TRAIN_DESCRIPTION = ("Pretrain a language model. Run as `python launch/pretrain.py --config NAME` (one rank) "
                     "or under `torchrun --nproc_per_node=N launch/pretrain.py --config NAME`.")
PLAN_DESCRIPTION = ("Plan a run without allocating it: parameters by part, memory per GPU, FLOPs per token and "
                    "tokens/s at an assumed MFU. Same as `python launch/pretrain.py --config NAME --dry-run`.")


def build_parser(prog: str, description: str, plan_only: bool = False) -> argparse.ArgumentParser:
    """The command line of `launch/pretrain.py`, or with `plan_only` that of `tools/plan.py` (always a dry run)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", required=True,
                        help="a YAML path, or a name in configs/ (with or without .yaml), e.g. tiny_dense")
    if not plan_only:
        parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        parser.add_argument("--dry-run", action="store_true",
                            help="print parameters, per-GPU memory and FLOPs of the run and exit (allocates nothing)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to plan the dry run for (default: torchrun's WORLD_SIZE, else 1)")
    parser.add_argument("--peak-tflops", type=float, default=989.4, help="dry run: peak TFLOP/s per GPU (H100/H200)")
    parser.add_argument("--mfu", type=float, default=0.4, help="dry run: model FLOPs utilization to assume")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="dotted overrides, e.g. model.num_layers=2 optimizer.lr=1e-3")
    if plan_only:
        parser.set_defaults(print_config=False, dry_run=True)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser("pretrain.py", TRAIN_DESCRIPTION).parse_args(argv)


def _error(message: str) -> int:
    """Report `message` in one line, once per job (`megafp8.train.runtime.report_error`); the exit status 2."""
    report_error(message)
    return 2


def plan_main(argv: list[str] | None = None) -> int:
    """`tools/plan.py`: the dry run under its own name and usage."""
    return run(build_parser("plan.py", PLAN_DESCRIPTION, plan_only=True).parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """`launch/pretrain.py`."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Print the config, plan, or train, as `args` asks; the exit status."""
    try:
        cfg = load_config(args.config, args.overrides)
        check_backend_name(cfg.precision.fp8_backend)  # the backends register in `precision`, above the config
    except ConfigError as err:
        return _error(str(err))
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    if args.dry_run:
        try:
            print(dry_run(cfg, args.world_size or env_rank()[2], args.peak_tflops, args.mfu))
        except ConfigError as err:
            return _error(str(err))
        return 0
    clean = False
    try:
        dims, device = init_distributed(cfg)
        seed_everything(cfg.training.seed)
        Trainer(cfg, dims, device).fit()
        clean = True
    except ConfigError as err:
        return _error(str(err))
    except FloatingPointError as err:  # the loss diverged: every rank sees the same reduced loss
        _error(str(err))
        return 1
    except KeyboardInterrupt:
        log.warning("interrupted")
        return 130
    finally:
        shutdown(clean)
    return 0
