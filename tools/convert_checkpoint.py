#!/usr/bin/env python
"""Inspect megafp8 checkpoints and convert them to and from Hugging Face Llama safetensors.

    python tools/convert_checkpoint.py inspect runs/tiny_dense/checkpoints/step_00000200
    python tools/convert_checkpoint.py to-hf runs/tiny_dense/checkpoints/step_00000200 --out hf/tiny [--fp8]
    python tools/convert_checkpoint.py from-hf hf/tiny --out runs/from_hf/checkpoints

`to-hf` writes config.json + model.safetensors in Llama naming (BF16, or with --fp8 E4M3 projection
weights with 128x128 `weight_scale_inv` blocks, DeepSeek-V3 style). `from-hf` writes a step-0
megafp8 checkpoint (fresh optimizer); train from it with `checkpoint.resume=<printed path>`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.checkpoint.convert import describe, export_hf, import_hf  # noqa: E402
from megafp8.config import ConfigError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list tensors, shapes, dtypes, layout and step")
    inspect.add_argument("checkpoint", type=Path)
    to_hf = commands.add_parser("to-hf", help="export to Hugging Face Llama safetensors")
    to_hf.add_argument("checkpoint", type=Path)
    to_hf.add_argument("--out", type=Path, required=True)
    to_hf.add_argument("--fp8", action="store_true", help="store projections as E4M3 with 128x128 block scales")
    from_hf = commands.add_parser("from-hf", help="import a Hugging Face Llama directory")
    from_hf.add_argument("hf_dir", type=Path)
    from_hf.add_argument("--out", type=Path, required=True, help="checkpoint directory to create step_00000000 in")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            print(describe(args.checkpoint))
        elif args.command == "to-hf":
            export_hf(args.checkpoint, args.out, args.fp8)
            print(f"wrote {args.out}")
        else:
            print(f"wrote {import_hf(args.hf_dir, args.out)}")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
