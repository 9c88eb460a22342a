"""Process setup: device and backend choice, process-group init and shutdown, rank-0 logging, seeding."""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import random
from collections.abc import Collection

import numpy as np
import torch
import torch.distributed as dist

from megafp8.config import Config, ConfigError, validate_for_world
from megafp8.config.loader import config_to_dict, flat_settings
from megafp8.model.transformer import uses_cuda_graphs
from megafp8.parallel import ParallelDims
from megafp8.train.command_line import env_rank

log = logging.getLogger("megafp8")


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either
# Holds the value megafp8 itself put in PYTORCH_CUDA_ALLOC_CONF: a later start in this process, or a megafp8 process
# it launches, tells that value from one the user set (which always wins).
SET_BY_MEGAFP8 = "MEGAFP8_SET_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def graphs_capture_collectives(cfg: Config) -> bool:
    """Whether CUDA graphs record this layout's NCCL collectives: tensor-, expert- and context-parallel ones run
    inside the compiled blocks, which `reduce-overhead` and `max-autotune` put in graphs. Data- and
    pipeline-parallel traffic runs outside them."""
    return (cfg.training.compile and uses_cuda_graphs(cfg.training.compile_mode)
            and (cfg.parallel.tp > 1 or cfg.parallel.ep > 1 or cfg.parallel.cp > 1))


def cuda_alloc_conf(cfg: Config) -> str:
    """What `training.cuda_alloc_conf` asks of the allocator, `auto` resolved: expandable segments, except where CUDA
    graphs capture collectives, since NCCL's registration of buffers captured in a graph assumes one contiguous
    allocation, which expandable segments break (pytorch/pytorch#158029; torchtitan saw the hang with context
    parallelism, torchtitan#3306)."""
    conf = cfg.training.cuda_alloc_conf
    if conf != "auto":
        return conf
    return "" if graphs_capture_collectives(cfg) else EXPANDABLE_SEGMENTS


def users_alloc_conf() -> tuple[str, str] | None:
    """(variable, value) of an allocator setting the user's environment holds, not counting one megafp8 set."""
    for var in ALLOC_CONF_VARS:
        if var not in os.environ:
            continue
        ours = var == "PYTORCH_CUDA_ALLOC_CONF" and os.environ.get(SET_BY_MEGAFP8) == os.environ[var]
        if not ours:
            return var, os.environ[var]
    return None


def configure_cuda_allocator(conf: str) -> str | None:
    """Give torch's CUDA caching allocator `conf` (`training.cuda_alloc_conf` resolved) through
    `PYTORCH_CUDA_ALLOC_CONF`, which torch reads when CUDA starts in this process (and a process launched from here
    inherits). The user's own setting in the environment wins, even "". Returns what was set, or None."""
    users = users_alloc_conf()
    if users is not None:
        if users[1] != conf:
            log.info("CUDA allocator: %s=%r from the environment (training.cuda_alloc_conf gives %r, not applied)",
                     users[0], users[1], conf)
        return None
    ours = os.environ.get(SET_BY_MEGAFP8)
    if torch.cuda.is_initialized():  # the allocator has read its settings already
        if ours != conf and (ours or conf):  # not this process's earlier start with the same settings
            log.warning("CUDA is already initialized in this process: training.cuda_alloc_conf's %r cannot apply; "
                        "set PYTORCH_CUDA_ALLOC_CONF before the first CUDA call instead", conf)
        return None
    if not conf:  # torch's own settings: drop what a megafp8 process that launched this one set
        if ours is not None:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            os.environ.pop(SET_BY_MEGAFP8)
        return None
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = os.environ[SET_BY_MEGAFP8] = conf
    return conf


# What each variable reads where it gives a process no GPU: CUDA hides every device from an invalid index on ("-1");
# SLURM sets CUDA_VISIBLE_DEVICES=NoDevFiles for a job without GPUs on a node that has some. SLURM_GPUS_ON_NODE is a
# count (0: none), SLURM_JOB_GPUS and SLURM_STEP_GPUS lists of GPU indices ("0": the first GPU).
NO_GPUS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("CUDA_VISIBLE_DEVICES", ("", "-1", "nodevfiles")), ("SLURM_GPUS_ON_NODE", ("", "0", "(null)")),
    ("SLURM_JOB_GPUS", ("", "(null)")), ("SLURM_STEP_GPUS", ("", "(null)")),
)
# Set by launch/slurm/pretrain.sbatch where it assumes 8 GPUs per node: the job asked for none, and GPUS_PER_NODE
# (a CPU job's process count) is unset.
EXPECTS_GPUS = "MEGAFP8_EXPECTS_GPUS"


def gpus_given() -> list[str]:
    """What in the environment says this process was given GPUs (`NAME=value` each): CUDA_VISIBLE_DEVICES naming
    devices, SLURM's GPU variables of a job or step that has some, pretrain.sbatch's assumption (`EXPECTS_GPUS`)."""
    given = [f"{var}={os.environ[var]}" for var, none in NO_GPUS
             if var in os.environ and os.environ[var].strip().lower() not in none]
    if os.environ.get(EXPECTS_GPUS):
        given.append(f"{EXPECTS_GPUS}={os.environ[EXPECTS_GPUS]}: launch/slurm/pretrain.sbatch took that many GPUs per "
                     "node, the job having asked for none (submit with --gpus-per-node=N, or set GPUS_PER_NODE to a "
                     "CPU job's processes per node)")
    return given


def no_cuda_for_given_gpus(given: list[str]) -> str:
    """The error of `training.device=auto` where the job was given GPUs (`gpus_given`) but torch finds none."""
    build = ("is a CPU build" if torch.version.cuda is None
             else f"is built for CUDA {torch.version.cuda} but finds no device (a driver that does not load?)")
    return (f"training.device=auto found no CUDA device, but this job was given GPUs ({'; '.join(given)}): torch "
            f"{torch.__version__} {build}. Install a CUDA build of torch or fix the driver (`python "
            "tools/check_env.py` on the node says what torch sees), or set training.device=cpu to train on the CPU "
            "anyway")


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    """The device this rank trains on: `training.device`, `auto` resolved (CUDA where available, else the CPU, but
    never the CPU of a job that was given GPUs: `gpus_given`)."""
    if cfg.training.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if cfg.training.device == "cuda":
            raise ConfigError("training.device=cuda but CUDA is not available here: set training.device=auto or cpu")
        given = gpus_given()
        if given:
            raise ConfigError(no_cuda_for_given_gpus(given))
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): launch at most "
            f"{torch.cuda.device_count()} processes per node"
        )
    conf = cuda_alloc_conf(cfg)
    warn_if_graphs_meet_expandable_segments(cfg, conf)
    configure_cuda_allocator(conf)
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def warn_if_graphs_meet_expandable_segments(cfg: Config, conf: str) -> None:
    """Say so where CUDA graphs capture collectives: why `auto` leaves expandable segments out, or that the user's
    setting (or `conf`, the config's resolved) puts them in anyway."""
    if not graphs_capture_collectives(cfg):
        return
    users = users_alloc_conf()
    asked = users[1] if users is not None else conf
    if "expandable_segments:true" in asked.replace(" ", "").lower():
        log.warning("expandable segments with CUDA graphs that capture NCCL collectives (parallel.tp or parallel.ep > "
                    "1 with training.compile_mode=%s): such runs can hang (pytorch/pytorch#158029); drop "
                    "expandable_segments from %s", cfg.training.compile_mode,
                    users[0] if users is not None else "training.cuda_alloc_conf")
    elif cfg.training.cuda_alloc_conf == "auto" and users is None:
        log.info("CUDA allocator as torch comes: CUDA graphs capture this layout's collectives, and NCCL's captured "
                 "buffers can hang on expandable segments (training.cuda_alloc_conf=auto)")


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor from the host on `device`, without the host waiting for the device. On CUDA a copy from
    pageable memory synchronizes the stream: the host would wait for every queued kernel (the previous step's
    included) before each micro-batch, and the GPU would idle while the next kernels are launched. Pinned memory
    with `non_blocking` makes the copy one more queued operation (torch's pinned-memory allocator keeps the
    buffer until the copy has run)."""
    if device.type != "cuda" or not t.is_cpu:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def setup_logging(rank: int) -> None:
    """INFO on rank 0, warnings and errors only elsewhere."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s", force=True)


def init_distributed(cfg: Config) -> tuple[ParallelDims, torch.device]:
    """Initialize the default process group when launched with more than one rank."""
    rank, local_rank, world_size = env_rank()
    setup_logging(rank)
    validate_for_world(cfg, world_size)  # a bad layout fails before any process group exists
    device = pick_device(cfg, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = cfg.parallel.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl" and device.type != "cuda":
            raise ConfigError("parallel.backend=nccl needs CUDA devices: set parallel.backend=auto or gloo")
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(minutes=cfg.parallel.timeout_minutes),
            device_id=device if device.type == "cuda" else None,
        )
        log.info("initialized %s with %d ranks on %s", backend, world_size, device.type)
    dims = ParallelDims.from_config(cfg.parallel)
    if dims.is_distributed:
        check_same_config(cfg, dims)
        log.info("layout: %s", dims.describe())
    return dims, device


def check_same_config(cfg: Config, dims: ParallelDims) -> None:
    """Every rank must run the config rank 0 runs (collective): a rank launched with other overrides (a launcher
    script that builds each rank's command line) would train its shard at another learning rate without a word,
    or wait in a collective its peers never enter. Each rank's digest is gathered; where they differ, the whole
    configs are, and every rank raises the same ConfigError naming the first setting that differs."""
    mine = config_to_dict(cfg)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True, default=str).encode()).hexdigest()
    digests: list[object] = [None] * dims.world_size
    dist.all_gather_object(digests, digest)
    if len(set(digests)) == 1:
        return
    configs: list[object] = [None] * dims.world_size
    dist.all_gather_object(configs, mine)
    flat = [flat_settings(c) for c in configs]
    key = next(k for k in sorted(set().union(*flat)) if len({repr(f.get(k)) for f in flat}) > 1)
    values: dict[str, list[int]] = {}
    for rank, f in enumerate(flat):
        values.setdefault(repr(f.get(key)), []).append(rank)
    shown = "; ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}"
                      for value, ranks in values.items())
    raise ConfigError(f"the ranks were launched with different settings: {key} is {shown}. Launch every rank with "
                      "the same config file and overrides")


def _ranks(ranks: list[int]) -> str:
    """`0-3, 5` for [0, 1, 2, 3, 5]."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def shutdown(clean: bool) -> None:
    """Tear down the process group. After a clean run, ranks first meet at a barrier: gloo aborts a rank
    ("terminate called without an active exception") if a peer destroys the group while it is still busy."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


# cuBLAS gives the same bits run to run only with a fixed workspace per handle (its docs, "Results reproducibility");
# under deterministic algorithms torch refuses cuBLAS matmuls without one of these.
CUBLAS_FIXED_WORKSPACES = (":4096:8", ":16:8")


# What `training.deterministic` sets, by part (`set_determinism`'s `parts`): `cublas` a fixed workspace, `cudnn` cuDNN
# without benchmarking and with its deterministic algorithms, `inductor` Inductor without on-device timing (its
# autotuned kernels' choice), `algorithms` torch's deterministic algorithms (which bring `cublas` with them).
DETERMINISM_PARTS = ("cublas", "cudnn", "inductor", "algorithms")


def set_determinism(on: bool, parts: Collection[str] = DETERMINISM_PARTS) -> None:
    """`training.deterministic`: torch's deterministic algorithms (ops without one raise, naming themselves), a fixed
    cuBLAS workspace, cuDNN without benchmarking, Inductor without on-device timing. Call before the first CUDA
    matmul; a `CUBLAS_WORKSPACE_CONFIG` already in the environment is kept if it is one of the fixed ones. `parts`
    (a subset of `DETERMINISM_PARTS`) sets only some, to find which one a run needs to repeat
    (`benchmarks/determinism.py --only`); `algorithms` sets `cublas` too, since torch refuses cuBLAS matmuls under
    deterministic algorithms without a fixed workspace."""
    if not on:
        return
    unknown = sorted(set(parts) - set(DETERMINISM_PARTS))
    if unknown or not parts:
        raise ValueError(f"determinism parts {unknown or '(none)'}: choose among {', '.join(DETERMINISM_PARTS)}")
    chosen = set(parts) | ({"cublas"} if "algorithms" in parts else set())
    workspace = None
    if "cublas" in chosen:
        workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_FIXED_WORKSPACES[0])
        if workspace not in CUBLAS_FIXED_WORKSPACES:
            raise ConfigError(f"training.deterministic=true needs a fixed cuBLAS workspace, but the environment sets "
                              f"CUBLAS_WORKSPACE_CONFIG={workspace}: unset it (megafp8 then sets "
                              f"{CUBLAS_FIXED_WORKSPACES[0]}) or set one of {', '.join(CUBLAS_FIXED_WORKSPACES)}")
    import torch._inductor.config as inductor_config  # (imported here: only deterministic runs touch it)
    inductor_was = getattr(inductor_config, "deterministic", None)
    if "algorithms" in chosen:
        torch.use_deterministic_algorithms(True)  # (in torch 2.13 this sets Inductor's mode too)
    if "cudnn" in chosen:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    if inductor_was is not None:  # `algorithms` alone leaves Inductor's mode as it was
        inductor_config.deterministic = True if "inductor" in chosen else inductor_was
    if chosen == set(DETERMINISM_PARTS):
        log.info("deterministic: torch's deterministic algorithms, CUBLAS_WORKSPACE_CONFIG=%s", workspace)
    else:
        log.info("deterministic in part: %s%s", ", ".join(p for p in DETERMINISM_PARTS if p in chosen),
                 f" (CUBLAS_WORKSPACE_CONFIG={workspace})" if workspace else "")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
