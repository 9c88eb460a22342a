"""Run a test body on N gloo ranks in fresh processes (forked from a preloaded server, file-store rendezvous)."""
from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
import traceback
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
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
PRELOAD = ["torch", "torch.distributed", "megafp8.train.trainer", "megafp8.train.main", "tests.distributed"]


def spawn(world_size: int, fn: Callable, *args) -> None:
    """Run `fn(rank, world_size, *args)` on every rank; an exception on any rank fails the caller."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world_size, f"{tmp}/store", fn, args), nprocs=world_size, join=True,
                           start_method="forkserver")


def full_grads(trainer) -> dict:
    """Every parameter's reduced gradient at its full shape: data-parallel shards, tensor-parallel shards and
    expert-parallel slices gathered (collective); under pipeline parallelism rank 0 gets every stage's."""
    import torch

    from megafp8.parallel import gather_param
    from megafp8.parallel.flat import all_gather_flat

    buckets, dims = trainer.grad_buckets, trainer.dims
    names = {p: n for n, p in trainer.model.named_parameters()}
    grads = {}
    for bucket in buckets.buckets:
        flat = buckets.shard_grads(bucket)
        if buckets.sharded and bucket.group_size > 1:
            whole = torch.empty(bucket.numel)
            all_gather_flat(whole, flat, group=bucket.group)
            flat = whole
        for p, offset in zip(bucket.params, bucket.offsets):
            grads[names[p]] = gather_param(flat[offset:offset + p.numel()].view_as(p), p, trainer.tp,
                                           trainer.ep).clone()
    if dims.pp_group is not None and dims.rank % (dims.tp * dims.dp) == 0:  # rank 0's pipeline
        stages = [None] * dims.pp if dims.rank == 0 else None
        dist.gather_object(grads, stages, dst=0, group=dims.pp_group)
        if dims.rank == 0:
            grads = {name: g for stage in stages for name, g in stage.items()}
    return grads


def capture_first_step_grads(trainer) -> dict:
    """A dict that fills, at the trainer's first optimizer step, with every parameter's gradient as the optimizer
    sees it (reduced over every group and clipped; `full_grads`), the step itself then running as usual."""
    captured: dict = {}
    real_step = trainer.optimizer.step

    def step(lr, apply=None):
        if not captured:
            captured.update(full_grads(trainer))
        real_step(lr, apply)
    trainer.optimizer.step = step
    return captured
