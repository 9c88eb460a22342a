#!/usr/bin/env python
"""Plan a run without allocating it: parameters by part, memory per GPU, FLOPs per token, tokens/s at an MFU.

    python tools/plan.py --config tiny_dense --world-size 8 model.size=1b data.seq_len=2048 model.vocab_size=32768
Same as `python launch/pretrain.py --config ... --dry-run --world-size N`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config.arguments import run_tool  # noqa: E402
from megafp8.train.command_line import parse_plan_args  # noqa: E402
from megafp8.train.entry import run_staged  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_tool(lambda: run_staged(parse_plan_args(sys.argv[1:]))))
