#!/usr/bin/env python
"""Tokenize text or JSONL files into megafp8's memory-mapped token format.

Examples:
    python tools/preprocess_data.py --input stdlib --output data/pystdlib
    python tools/preprocess_data.py --input corpus/ --output data/mycorpus --tokenizer tokenizer.json
    python tools/preprocess_data.py --input a.jsonl b.jsonl --json-key content --output data/ab
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config import ConfigError  # noqa: E402
from megafp8.data.preprocess import preprocess  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="text/JSONL files, directories (searched for .txt/.jsonl/.json), or 'stdlib' "
                             "(the Python standard library's sources: a corpus on any machine)")
    parser.add_argument("--output", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' (default) or a tokenizer.json path")
    parser.add_argument("--eos-token", default=None, help="end-of-document token of a tokenizer.json")
    parser.add_argument("--valid-fraction", type=float, default=0.01, help="fraction of documents held out")
    parser.add_argument("--seed", type=int, default=1234, help="seed of the held-out split")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    parser.add_argument("--json-key", default="text", help="field holding the text in JSONL records")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        splits = preprocess(args.input, args.output, args.tokenizer, args.valid_fraction, args.seed,
                            args.shard_tokens, args.json_key, args.eos_token, args.overwrite)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, shards in splits.items():
        print(f"{split}: {sum(s['num_docs'] for s in shards)} documents, "
              f"{sum(s['num_tokens'] for s in shards):,} tokens in {len(shards)} shard(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
