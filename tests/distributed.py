"""Run a test body on N gloo ranks in fresh processes (forked from a preloaded server, file-store rendezvous)."""
from __future__ import annotations

import datetime
import multiprocessing
import os
import sys
import tempfile
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megafp8.precision.cpu_gemm import widen_reduced_precision_gemms


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple) -> None:
    # One intra-op thread per rank, as torchrun gives each (OMP_NUM_THREADS=1). Left at torch's default, every rank
    # ran as many OpenMP threads as there are cores: 4 ranks x 2 spinning threads on a 2-core CI machine made a
    # 4-rank pipeline run of the tiny model ~5x slower.
    torch.set_num_threads(1)
    widen_reduced_precision_gemms()  # as in the test process (tests/conftest.py), before the rank computes anything
    # A collective that some rank never reaches fails the test after 5 minutes, not torch's default 30.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=5))
    try:
        try:
            fn(rank, world_size, *args)
        except BaseException:
            # The parent re-raises whichever rank died first, often a peer's "connection closed": print the cause.
            print(f"rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Passed: leave without C++ static destructors. gloo's transport threads can still be joinable at interpreter
    # exit and abort the process (SIGABRT, "terminate called without an active exception"), which spawn reports
    # as a failure of a test that passed (seen once in CI-like runs); the launcher exits the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Ranks fork from one server process that imported torch and megafp8 once for the whole session: a fresh
# interpreter per rank spent ~5 s of CPU importing them, most of a small test's time on a 2-core CI machine. The
# server runs no torch operations, so no thread pool exists when it forks. (Its environment is the one it started
# with: a test that needs different variables in its ranks must pass them as arguments.)
# torch._dynamo and torch._inductor: the package imports them only where it compiles (megafp8.precision.eager), and
# the ranks of the compiled tests would each import them again.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor", "megafp8.train.trainer",
           "megafp8.train.main", "tests.distributed", "tests.parity"]


def spawn(world_size: int, fn: Callable, *args) -> None:
    """Run `fn(rank, world_size, *args)` on every rank; an exception on any rank fails the caller."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world_size, f"{tmp}/store", fn, args), nprocs=world_size, join=True,
                           start_method="forkserver")

