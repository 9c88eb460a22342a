#!/usr/bin/env python
"""Plan a run without allocating it: parameters by part, memory per GPU, FLOPs per token, tokens/s at an MFU.

    python tools/plan.py --config tiny_dense --world-size 8 model.size=1b data.seq_len=2048 model.vocab_size=32768
Same as `python launch/pretrain.py --config ... --dry-run --world-size N`.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config.arguments import run_tool  # noqa: E402
from megafp8.train.command_line import load_run_config, parse_plan_args  # noqa: E402


def main() -> int:
    """The options and the config first (no torch: a typo is answered at once), then the plan."""
    args = parse_plan_args(sys.argv[1:])
    cfg = load_run_config(args)
    if isinstance(cfg, int):
        return cfg
    from megafp8.train.main import run_config  # torch and the model: past a config that loads
    return run_config(args, cfg)


if __name__ == "__main__":
    sys.exit(run_tool(main))
