#!/usr/bin/env python
"""Submit a megafp8 run to SLURM with the nodes and processes its parallel layout needs.

    python launch/slurm/submit.py --config 671b_fp8.yaml --nodes 256            # 2048 GPUs, as the paper (H800s)
    python launch/slurm/submit.py --config 1b_dense_fp8.yaml                    # fills one 8-GPU node
    python launch/slurm/submit.py --config tiny_dense --cpu --procs-per-node 2 --sbatch=--wait
    python launch/slurm/submit.py --config 671b_fp8.yaml --print-only           # just print the sbatch line

Checks before submitting: the layout against the world size (tp x pp x dp, experts over ep), the memory plan
against --gpu-memory-gib when the vocabulary is known, and that no --sbatch argument sets the job's shape again.
Overrides (`section.key=value`) go to the run unchanged.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megafp8.config import ConfigError, load_config, repeated_overrides, resolve_config_path  # noqa: E402
from megafp8.train.submit import check_memory, check_sbatch_args, job_shape, sbatch_command  # noqa: E402
from megafp8.config.arguments import positive_number, print_warnings, run_tool  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int, default=None, help="default: the fewest whole nodes the layout needs")
    parser.add_argument("--procs-per-node", "--gpus-per-node", type=int, default=8, dest="procs_per_node")
    parser.add_argument("--cpu", action="store_true", help="a CPU job: no --gpus-per-node, processes via GPUS_PER_NODE")
    parser.add_argument("--gpu-memory-gib", type=positive_number(), default=139.0,
                        help="memory of one GPU (H200: ~139 GiB)")
    parser.add_argument("--sbatch", action="append", default=[],
                        help="an extra sbatch argument (repeatable); not one that sets the job's shape (--nodes, "
                             "--ntasks-per-node, --gpus-per-node, ...), which this helper sizes from the layout")
    parser.add_argument("--print-only", action="store_true", help="print the sbatch command instead of running it")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    print_warnings(repeated_overrides(args.overrides))
    try:
        check_sbatch_args(args.sbatch)
        cfg = load_config(args.config, args.overrides)
        shape = job_shape(cfg, args.procs_per_node, args.nodes)
        note = None if args.cpu else check_memory(cfg, shape, args.gpu_memory_gib)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"megafp8 job: {shape.nodes} node(s) x {shape.procs_per_node} process(es) = {shape.world_size} ranks"
          + (f" ({note})" if note else ""))
    # sbatch runs in the repository root, and so does the job: the config file checked here goes to it absolute, be
    # it a path relative to this directory or a name found in this directory's configs/ (else the job looks for it
    # there, and may load the repository's configs/ file of that name instead). Not `resolve`: a symlink's own name
    # is the run's default run_name.
    config = str(resolve_config_path(args.config).absolute())
    command = sbatch_command(config, args.overrides, shape, not args.cpu, args.sbatch,
                             str(REPO / "launch/slurm/pretrain.sbatch"))
    print(shlex.join(command), flush=True)
    if args.print_only:
        return 0
    if shutil.which(command[0]) is None:
        print(f"error: {command[0]} is not on PATH: run this on a SLURM login node, or pass --print-only to see the "
              "command", file=sys.stderr)
        return 2
    return subprocess.run(command, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(run_tool(main))
