"""A training run past its config (`launch/pretrain.py`, after `megafp8.train.command_line` loaded it): print,
plan, evaluate or train, and shut down cleanly."""
from __future__ import annotations

import argparse
import json
import logging
import re
from typing import Optional

import torch
import torch.distributed as dist

from megafp8.checkpoint.local import find_latest
from megafp8.config import Config, ConfigError
from megafp8.train.checkpointing import CheckpointWriteError
from megafp8.train.command_line import (env_rank, error_status, load_run_config, parse_args, parse_plan_args,
                                        wants_preview)
from megafp8.train.plan import GIB, make_plan, with_vocab
from megafp8.train.preemption import exit_status
from megafp8.train.preview import checked, preview
from megafp8.train.runtime import init_distributed, seed_everything, set_determinism, shutdown
from megafp8.train.trainer import Trainer

log = logging.getLogger("megafp8")


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


def main(argv: list[str] | None = None) -> int:
    """`launch/pretrain.py` in one call (the script itself loads the config before importing this module)."""
    return run(parse_args(argv))


def plan_main(argv: list[str] | None = None) -> int:
    """`tools/plan.py`: the dry run under its own name and usage."""
    return run(parse_plan_args(argv))


def run(args: argparse.Namespace) -> int:
    """Load the config `args` name, then print, plan or train it as `args` asks; the exit status. (The entry scripts
    route the same way in `megafp8.train.entry.run_staged`, importing this module only to train.)"""
    cfg = load_run_config(args)
    if isinstance(cfg, int):
        return cfg
    return preview(args, cfg) if wants_preview(args) else run_config(args, cfg)


def run_config(args: argparse.Namespace, cfg: Config) -> int:
    """Train, or evaluate a checkpoint, as `args` asks (`cfg`: `load_run_config`'s); the exit status."""
    status = checked(cfg)
    if status is not None:
        return status
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
        return error_status(str(err))
    except FloatingPointError as err:  # the loss diverged: every rank sees the same reduced loss
        error_status(str(err))
        return 1
    except CheckpointWriteError as err:  # raised on every rank alike, whichever rank's write failed
        error_status(str(err))
        return 1
    except torch.OutOfMemoryError as err:
        log.debug("out of memory", exc_info=True)
        error_status(out_of_memory_message(cfg, err, trainer.step if trainer is not None else None, env_rank()[2]))
        return 1
    except RuntimeError as err:  # after CheckpointWriteError and OutOfMemoryError, which are RuntimeErrors too
        lost = lost_peer_message(err, cfg.parallel.timeout_minutes)
        if lost is None:
            raise
        log.debug("lost a peer", exc_info=True)
        error_status(lost)
        return 1
    except KeyboardInterrupt:
        log.warning("interrupted (SIGINT: nothing saved; SIGTERM or SIGUSR1 stop with a checkpoint): %s",
                    _where_a_relaunch_resumes(trainer))
        return 130
    finally:
        shutdown(clean)
    return 0
