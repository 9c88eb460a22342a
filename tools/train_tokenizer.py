#!/usr/bin/env python
"""Train a byte-level BPE tokenizer.json locally (Hugging Face `tokenizers`), no download needed.

Example:
    python tools/train_tokenizer.py --input stdlib --vocab-size 8192 --output data/tokenizer.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config import ConfigError  # noqa: E402
from megafp8.data.preprocess import train_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="text/JSONL files, directories, or 'stdlib'")
    parser.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    parser.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size, special tokens included")
    parser.add_argument("--json-key", default="text", help="field holding the text in JSONL records")
    args = parser.parse_args(argv)
    try:
        train_tokenizer(args.input, args.output, args.vocab_size, args.json_key)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
