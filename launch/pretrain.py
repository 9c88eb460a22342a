#!/usr/bin/env python
"""Pretraining entry point: `torchrun --nproc_per_node=N launch/pretrain.py --config NAME [key=value ...]`.

Also runs as plain `python launch/pretrain.py --config NAME` (one rank). All logic lives in
`megafp8.train.command_line` (the options and the config, before torch is imported) and
`megafp8.train.main`.
"""
import sys
from pathlib import Path

# Run from a source checkout without installing: put the repository root on the path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config.arguments import run_tool  # noqa: E402
from megafp8.train.command_line import exit_process, parse_args  # noqa: E402
from megafp8.train.entry import run_staged  # noqa: E402

if __name__ == "__main__":  # (run_tool: `--print-config | head` ends quietly)
    exit_process(run_tool(lambda: run_staged(parse_args(sys.argv[1:]))))
