"""SLURM job shape from a config: how many nodes and processes its parallel layout needs, checked before submitting.

`launch/slurm/submit.py` is the command line. The world size is, in order of precedence:
`--nodes` x processes per node; `tp x pp x dp` when `parallel.dp` is set; else the smallest multiple
of `tp x pp x lcm(ep, cp)` that fills whole nodes. Then the layout is validated for that world, the memory
plan is checked against the GPU (when the vocabulary is known), and the `sbatch` command of
`launch/slurm/pretrain.sbatch` is built. Extra sbatch arguments that would set that shape again (`--nodes`,
`--ntasks-per-node`, `--gpus-per-node`, ...) are refused (`check_sbatch_args`): the job would run another world size
than the one checked.
"""
from __future__ import annotations

import math
import re
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


_CHECKED = ("which submit.py sizes from the config's layout, and the job would run another world size than the one "
            "checked")
# The sbatch options that would set again what `sbatch_command` sets (sbatch's long names; it also takes an unambiguous
# prefix of one, `--ntasks-per-n=2`), with what they set and what to change instead.
SHAPE_OPTIONS: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("nodes", "N"), f"the job's nodes, {_CHECKED}",
     "pass --nodes N to submit.py (the layout is then checked for N x --gpus-per-node ranks), or set parallel.dp"),
    (("ntasks", "n", "ntasks-per-node", "ntasks-per-gpu"), f"the job's tasks, {_CHECKED}",
     "the job script starts one task per node (torchrun, which starts the ranks): give the processes per node with "
     "submit.py's --procs-per-node (alias --gpus-per-node)"),
    (("gpus", "G", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres"), f"the job's GPUs, {_CHECKED}",
     "give the GPUs per node, one rank each, with submit.py's --gpus-per-node G (or --cpu for a job without GPUs)"),
    (("export",), "the job's environment in place of submit.py's --export=ALL,GPUS_PER_NODE=<processes per node> "
     "(sbatch keeps the last --export), and the job would start another number of processes per node than the one "
     "checked", "set other variables in the shell you submit from: sbatch passes its environment on"),
)


def sbatch_option(arg: str) -> tuple[str, str]:
    """(name, value) of one sbatch argument: ("nodes", "4") for `--nodes=4` or `--nodes 4`, ("N", "4") for `-N4`;
    ("", arg) for an argument that is no option (the value of the one before)."""
    match = re.fullmatch(r"--([^=\s]+)[=\s]?(.*)|-(\w)\s*(.*)", arg.strip(), re.DOTALL)
    if match is None:
        return "", arg
    return (match[1], match[2]) if match[1] else (match[3], match[4])


def check_sbatch_args(sbatch_args: list[str]) -> None:
    """Refuse (ConfigError) an extra sbatch argument that would set the job's shape or environment again
    (`SHAPE_OPTIONS`); `--gres` only where it asks for GPUs, its value in the argument or in the next one."""
    for i, arg in enumerate(sbatch_args):
        name, value = sbatch_option(arg)
        if not value and i + 1 < len(sbatch_args) and not sbatch_option(sbatch_args[i + 1])[0]:
            value = sbatch_args[i + 1]
        for names, what, instead in SHAPE_OPTIONS:
            full = [n for n in names if n == name or (len(name) > 1 and n.startswith(name))]
            if full and not (full == ["gres"] and "gpu" not in value.lower()):
                raise ConfigError(f"--sbatch={arg} would set {what}: {instead}")


def sbatch_command(config: str, overrides: list[str], shape: JobShape, gpus: bool, sbatch_args: list[str],
                   script: str = "launch/slurm/pretrain.sbatch") -> list[str]:
    """`sbatch` of the megafp8 job script with the job's shape. The process count goes through GPUS_PER_NODE, which
    the script reads before SLURM's GPU count: GPU jobs set it too, since sbatch passes the submitter's environment
    on, and a GPUS_PER_NODE left there would launch another world size than the one checked here. A CPU job hides
    the GPUs (an empty CUDA_VISIBLE_DEVICES): one left in the submitting shell would have its ranks take GPUs that
    are not theirs, or, where torch finds none, stop (`training.device=auto` refuses the CPU of a job given GPUs)."""
    command = ["sbatch", f"--nodes={shape.nodes}"]
    if gpus:
        command += [f"--gpus-per-node={shape.procs_per_node}", f"--export=ALL,GPUS_PER_NODE={shape.procs_per_node}"]
    else:
        command.append(f"--export=ALL,GPUS_PER_NODE={shape.procs_per_node},OMP_NUM_THREADS=1,CUDA_VISIBLE_DEVICES=")
    return command + sbatch_args + [script, "--config", config, *overrides]
