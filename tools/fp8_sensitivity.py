#!/usr/bin/env python
"""Which GEMM layers of a model can run in per-tile FP8? A table (and a plot) per layer.

For each attention/MLP linear: output SNR with per-tile FP8 (and per-tensor, for contrast),
dgrad and wgrad SNR, and the loss change when only that layer runs FP8; verdict "FP8" or
"keep BF16" against the thresholds shown.

Examples:
    python tools/fp8_sensitivity.py --config tiny_dense --batches 4
    python tools/fp8_sensitivity.py --config tiny_dense --checkpoint runs/tiny_dense/checkpoints/step_00000200 \\
        --plot docs/fp8_sensitivity.png data.path=data/pystdlib
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config import ConfigError, load_config, repeated_overrides  # noqa: E402
from megafp8.train.sensitivity import analyze, format_table, model_and_batches, plot  # noqa: E402
from megafp8.config.arguments import print_warnings, run_tool, whole_number  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a config name or path (its model and data are used)")
    parser.add_argument("--checkpoint", default=None, help="checkpoint directory to take the weights from")
    parser.add_argument("--batches", type=whole_number(1), default=4, help="held-out micro-batches to measure on")
    parser.add_argument("--min-snr-db", type=float, default=25.0, help="SNR a layer needs to run FP8")
    parser.add_argument("--max-loss-change", type=float, default=0.005, help="relative loss change allowed")
    parser.add_argument("--json", default=None, help="also write the results as JSON here")
    parser.add_argument("--plot", default=None, help="also draw the SNRs into this PNG (needs matplotlib)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    for option, out in (("--json", args.json), ("--plot", args.plot)):  # before the analysis, not after it
        if out and not Path(out).parent.is_dir():
            parser.error(f"{option} {out}: the directory {Path(out).parent} does not exist: create it first")
    print_warnings(repeated_overrides(args.overrides))
    try:
        cfg = load_config(args.config, args.overrides)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(cfg.training.seed)
        model, batches = model_and_batches(cfg, args.checkpoint, args.batches, device)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results = analyze(model, batches, args.min_snr_db, args.max_loss_change)
    print(format_table(results, args.min_snr_db, args.max_loss_change))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.plot:
        try:
            plot(results, args.min_snr_db, args.plot)
        except ImportError:
            print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
