"""SLURM job shape from a config: how many nodes and processes its parallel layout needs, checked before submitting.

`launch/slurm/submit.py` is the command line. The world size is, in order of precedence:
`--nodes` x processes per node; `tp x pp x dp` when `parallel.dp` is set; else the smallest multiple
of `tp x pp x lcm(ep, cp)` that fills whole nodes. Then the layout is validated for that world, the memory
plan is checked against the GPU (when the vocabulary is known), and the `sbatch` command of
`launch/slurm/pretrain.sbatch` is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megafp8.config import Config, ConfigError, validate_for_world
from megafp8.train.plan import GIB, check_fits, make_plan, with_vocab


@dataclass(frozen=True)
class JobShape:
    nodes: int
    procs_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


def job_shape(cfg: Config, procs_per_node: int, nodes: Optional[int] = None) -> JobShape:
    """The nodes and processes per node `cfg`'s layout runs on (validated for that world size)."""
    par = cfg.parallel
    if procs_per_node < 1 or (nodes is not None and nodes < 1):
        raise ConfigError("--gpus-per-node and --nodes must be at least 1")
    if nodes is not None:
        world = nodes * procs_per_node
    elif par.dp is not None:
        world = par.tp * par.pp * par.dp
    else:  # the data-parallel size a multiple of both ep and cp (their groups are made of data-parallel ranks)
        world = math.lcm(par.tp * par.pp * math.lcm(par.ep, par.cp), procs_per_node)
    if world > procs_per_node and world % procs_per_node != 0:
        raise ConfigError(f"the layout needs {world} ranks (tp {par.tp} x pp {par.pp} x dp {par.dp}), which do not "
                          f"fill whole nodes of {procs_per_node}: change parallel.dp or pass --nodes")
    validate_for_world(cfg, world)
    return JobShape(max(1, world // procs_per_node), min(world, procs_per_node))


def check_memory(cfg: Config, shape: JobShape, gpu_memory_gib: float) -> Optional[str]:
    """None if the plan fits `gpu_memory_gib` per rank (raises ConfigError if not); a note when it cannot tell."""
    try:
        planned = with_vocab(cfg)
    except ConfigError:
        return "memory not checked: set model.vocab_size (the data is not readable from here)"
    check_fits(make_plan(planned, shape.world_size), int(gpu_memory_gib * GIB), "the GPU has")
    return None


def sbatch_command(config: str, overrides: list[str], shape: JobShape, gpus: bool, sbatch_args: list[str],
                   script: str = "launch/slurm/pretrain.sbatch") -> list[str]:
    """`sbatch` of the megafp8 job script with the job's shape. The process count goes through GPUS_PER_NODE, which
    the script reads before SLURM's GPU count: GPU jobs set it too, since sbatch passes the submitter's environment
    on, and a GPUS_PER_NODE left there would launch another world size than the one checked here."""
    command = ["sbatch", f"--nodes={shape.nodes}"]
    if gpus:
        command += [f"--gpus-per-node={shape.procs_per_node}", f"--export=ALL,GPUS_PER_NODE={shape.procs_per_node}"]
    else:
        command.append(f"--export=ALL,GPUS_PER_NODE={shape.procs_per_node},OMP_NUM_THREADS=1")
    return command + sbatch_args + [script, "--config", config, *overrides]
