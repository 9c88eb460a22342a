"""Which checkpoint a run resumes from, verified before anything is read from it (collective: every rank calls).

Verification re-reads every file of the checkpoint and compares its xxh3_64 digest with the one recorded when
it was written; the files are shared out over the ranks, so each reads about 1/world of them. `auto` takes
the newest checkpoint that verifies and says which newer ones it passed over and why; it starts fresh only
where no checkpoint directory exists at all. A path is where a run starts: once the run has saved checkpoints
of its own since, a relaunch with the same path continues from those.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from megafp8.checkpoint.local import (
    checkpoint_bytes,
    checkpoint_problem,
    has_checksums,
    not_a_checkpoint,
    resume_candidates,
    STATE_FILE,
    saved_config,
    verification_problem,
)
from megafp8.checkpoint.sharded import is_sharded_checkpoint
from megafp8.config import ConfigError
from megafp8.parallel import ParallelDims

log = logging.getLogger("megafp8")
T = TypeVar("T")


def from_rank0(compute: Callable[[], T], dims: ParallelDims) -> T:
    """`compute()`, run on rank 0 only, on every rank (collective). Rank 0 failing alone would leave its peers
    waiting in the broadcast, so every failure is broadcast: where it raised a ConfigError or an OSError (a run
    directory rank 0 cannot read), every rank raises the same ConfigError; anything else, rank 0 raises as it came
    (its traceback is the one to read) and the other ranks a RuntimeError that names it."""
    result: list[Any] = [None]
    failure: Optional[BaseException] = None
    if dims.rank == 0:
        try:
            result = [(compute(), None, True)]
        except (ConfigError, OSError) as err:
            result = [(None, str(err), True)]
        except Exception as err:  # noqa: BLE001 - told to every rank, then raised again below
            failure = err
            result = [(None, f"{type(err).__name__}: {err}", False)]
    if dims.is_distributed:
        dist.broadcast_object_list(result, src=0)
    value, error, is_config = result[0]
    if failure is not None:
        raise failure
    if error is not None:
        if is_config:
            raise ConfigError(error)
        raise RuntimeError(f"rank 0 failed while every rank waited for it (its own traceback says where): {error}")
    return value


def first_problem(path: Path, dims: ParallelDims) -> Optional[str]:
    """Why checkpoint `path` cannot be trusted (the first bad file, in one line), the same on every rank, or None.
    Each rank hashes its share of the files."""
    started = time.perf_counter()
    problem = verification_problem(path, dims.rank, dims.world_size)
    if dims.is_distributed:
        every: list[Optional[str]] = [None] * dims.world_size
        dist.all_gather_object(every, problem)
        problem = next((p for p in every if p), None)
    if problem is None and dims.rank == 0:
        if has_checksums(path):
            log.info("verified %s: %.2f GiB of checksummed files in %.1f s", path, checkpoint_bytes(path) / 2**30,
                     time.perf_counter() - started)
        else:
            log.warning("checkpoint %s has no checksums (written before megafp8 recorded them): loading it "
                        "unverified", path)
    return problem


def _problem(path: Path, dims: ParallelDims, verify: bool) -> Optional[str]:
    """Why checkpoint directory `path` cannot be used: every file checked against its checksum (`first_problem`), or
    without `verify` (a dry run) only whether it is complete, every file its manifest lists there at its size (reads
    the manifest alone: a dry run of a 1 TB checkpoint takes no hour of hashing)."""
    return first_problem(path, dims) if verify else checkpoint_problem(path)


def verified_resume_path(resume: str, checkpoint_dir: Path, dims: ParallelDims) -> Optional[Path]:
    """The checkpoint `checkpoint.resume` names, verified: a path, or for `auto` the newest good one under
    `checkpoint_dir`; None to start fresh. A ConfigError names the bad file."""
    if resume == "none":
        return None
    if resume == "auto":
        return _newest_good(checkpoint_dir, dims)
    if from_rank0(lambda: continues_from(resume, checkpoint_dir), dims):
        if dims.rank == 0:
            log.warning("checkpoint.resume=%s: this run started from it and has checkpoints of its own since: "
                        "continuing from the newest of them (to start over from %s, give this run another run_name "
                        "or checkpoint.dir)", resume, resume)
        return _newest_good(checkpoint_dir, dims)
    return _verified_path(Path(resume), dims)


def _verified_path(path: Path, dims: ParallelDims, verify: bool = True) -> Path:
    """Checkpoint `path` (a directory, or a full checkpoint's state.pt), verified (`_problem`); a ConfigError names
    the bad file."""
    if path.is_dir() and (holder := not_a_checkpoint(path)) is not None:
        raise ConfigError(f"checkpoint.resume: {holder}")
    if path.is_file() and path.name != STATE_FILE and not is_sharded_checkpoint(path.parent):
        # (judged as its folder, it was named in "checkpoint <folder> is incomplete")
        raise ConfigError(f"checkpoint.resume={path} is a file, not a checkpoint: give a checkpoint's directory "
                          f"(step_NNNNNNNN) or a full checkpoint's {STATE_FILE}")
    problem = _problem(path.parent if path.is_file() else path, dims, verify)  # a directory, or its state.pt
    if problem:
        raise ConfigError(f"{problem}. Resume from another checkpoint (checkpoint.resume=PATH), or set "
                          "checkpoint.resume=auto to take the newest one that verifies")
    return path


def checkpoint_to_evaluate(resume: str, checkpoint_dir: Path, dims: ParallelDims, verify: bool = True) -> Path:
    """The checkpoint `launch/pretrain.py --evaluate` evaluates, verified: the one `checkpoint.resume` names, or for
    `auto` the newest good one under `checkpoint_dir`. A ConfigError where there is none. `verify=False` (the dry
    run's `--evaluate`): checked complete, not hashed (`_problem`)."""
    if resume == "none":
        raise ConfigError("--evaluate evaluates a checkpoint, and checkpoint.resume=none names none: leave it auto "
                          "(the newest in checkpoint.dir) or name one (checkpoint.resume=PATH)")
    path = (_newest_good(checkpoint_dir, dims, verify) if resume == "auto"
            else _verified_path(Path(resume), dims, verify))
    if path is None:
        raise ConfigError(f"--evaluate: {checkpoint_dir} holds no checkpoint: name one with checkpoint.resume=PATH, "
                          "or give the run_name (or checkpoint.dir) of the run that saved them")
    return path


def continues_from(resume: str, checkpoint_dir: Path) -> bool:
    """Whether the newest readable checkpoint under `checkpoint_dir` was saved by a launch that started from
    `resume` (a path) too: the run has moved on from that path, and a relaunch of the same config (a requeue)
    continues it instead of going back to the path. A checkpoint saved before (a run going back to one of its own
    earlier checkpoints, killed before its first save) records another start, and the path still applies."""
    candidates, _ = resume_candidates(checkpoint_dir)
    for directory in candidates:
        config = saved_config(directory)
        if config is not None:
            started_from = config.get("checkpoint", {}).get("resume")
            return isinstance(started_from, str) and Path(started_from).resolve() == Path(resume).resolve()
    return False


def _newest_good(root: Path, dims: ParallelDims, verify: bool = True) -> Optional[Path]:
    """`auto`: the newest checkpoint under `root` that verifies (`_problem`), logging the ones passed over; a
    ConfigError if checkpoints exist but none verifies (a damaged run is never silently restarted from step 0)."""
    candidates, passed_over = from_rank0(lambda: resume_candidates(root), dims)
    for path in candidates:
        problem = _problem(path, dims, verify)
        if problem is None:
            if passed_over and dims.rank == 0:
                for reason in passed_over:
                    log.warning("checkpoint.resume=auto: passed over a checkpoint: %s", reason)
                log.warning("checkpoint.resume=auto: resuming from %s, the newest checkpoint that %s", path,
                            "verifies" if verify else "is complete")
            return path
        passed_over.append(problem)
    if passed_over:
        more = f" (and {len(passed_over) - 1} more)" if len(passed_over) > 1 else ""
        raise ConfigError(f"no checkpoint under {root} can be resumed: {passed_over[0]}{more}. Resume from one you "
                          "trust (checkpoint.resume=PATH), or start over with checkpoint.resume=none")
    return None
