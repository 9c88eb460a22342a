"""Process setup: device and backend choice, process-group init and shutdown, rank-0 logging, seeding."""
from __future__ import annotations

import datetime
import json
import logging
import os
import random
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from megafp8.config import Config, ConfigError, validate_for_world
from megafp8.parallel import ParallelDims

log = logging.getLogger("megafp8")


def env_rank() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; (0, 0, 1) under plain python."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either; the environment's wins
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def cuda_alloc_conf(cfg: Config) -> str:
    """What `training.cuda_alloc_conf` asks of the allocator, `auto` resolved: expandable segments, except where CUDA
    graphs capture NCCL collectives (tensor- or expert-parallel ones inside the compiled blocks), since NCCL's
    registration of buffers captured in a graph assumes one contiguous allocation, which expandable segments break
    (pytorch/pytorch#158029; torchtitan saw the hang with context parallelism, torchtitan#3306). Data- and
    pipeline-parallel traffic runs outside the graphs."""
    conf = cfg.training.cuda_alloc_conf
    if conf != "auto":
        return conf
    graphs = cfg.training.compile and cfg.training.compile_mode == "reduce-overhead"
    if graphs and (cfg.parallel.tp > 1 or cfg.parallel.ep > 1):
        return ""
    return EXPANDABLE_SEGMENTS


def configure_cuda_allocator(conf: str) -> str | None:
    """Give torch's CUDA caching allocator `conf` (`training.cuda_alloc_conf`) through `PYTORCH_CUDA_ALLOC_CONF`,
    which torch reads when CUDA starts in this process. The environment's own setting wins: a launcher or user who
    set either variable (even to "") chose. Returns what was set, or None when nothing was."""
    for var in ALLOC_CONF_VARS:
        if var in os.environ:
            if os.environ[var] != conf:
                log.info("CUDA allocator: %s=%r from the environment (training.cuda_alloc_conf=%r not applied)",
                         var, os.environ[var], conf)
            return None
    if not conf:
        return None
    if torch.cuda.is_initialized():  # e.g. a notebook that used CUDA first: the allocator has read its settings
        log.warning("CUDA is already initialized in this process: training.cuda_alloc_conf=%r cannot apply; set "
                    "PYTORCH_CUDA_ALLOC_CONF before the first CUDA call instead", conf)
        return None
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    return conf


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    if cfg.training.device == "cpu" or (cfg.training.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("training.device=cuda but CUDA is not available here: set training.device=auto or cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): launch at most "
            f"{torch.cuda.device_count()} processes per node"
        )
    conf = cuda_alloc_conf(cfg)
    if cfg.training.cuda_alloc_conf == "auto" and conf != EXPANDABLE_SEGMENTS:
        log.info("CUDA allocator as torch comes: CUDA graphs capture this layout's collectives, and NCCL's captured "
                 "buffers can hang on expandable segments (training.cuda_alloc_conf=auto)")
    configure_cuda_allocator(conf)
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


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
        log.info("layout: %s", dims.describe())
    return dims, device


def shutdown(clean: bool) -> None:
    """Tear down the process group. After a clean run, ranks first meet at a barrier: gloo aborts a rank
    ("terminate called without an active exception") if a peer destroys the group while it is still busy."""
    if dist.is_available() and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """Leave without running C++ static destructors: gloo's transport threads can still be joinable then,
    and destroying them aborts the process ("terminate called without an active exception", exit -6)
    after a run that finished cleanly. Everything the run wrote is closed by now; flush stdio and go."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
