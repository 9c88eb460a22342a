#!/usr/bin/env python
"""Train a byte-level BPE tokenizer.json locally (Hugging Face `tokenizers`), no download needed.

It trains on the documents tools/preprocess_data.py puts in the training split: give both the same --input,
--json-key (or --extensions), --valid-fraction and --seed, and the documents it holds out stay unseen.

Examples:
    python tools/train_tokenizer.py --input stdlib --vocab-size 8192 --output data/tokenizer.json
    # on a 100 MB sample of a text tree's training files (same --extensions/--seed/--valid-fraction as
    # tools/preprocess_data.py, so held-out files stay unseen)
    python tools/train_tokenizer.py --input /usr/lib/python3/dist-packages --extensions .py .md .rst .txt \\
        --sample-bytes 1e8 --output data/tokenizer.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config.arguments import reported, run_tool  # noqa: E402
from megafp8.data.preprocess import train_tokenizer  # noqa: E402
from megafp8.data.text_tree import scan_text_tree  # noqa: E402
from tools.preprocess_data import add_text_tree_options, byte_count  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="text/JSONL files, directories, or 'stdlib'")
    parser.add_argument("--output", required=True, help="path of the tokenizer.json to write (must not exist unless "
                                                        "--overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.json")
    parser.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size, special tokens included")
    parser.add_argument("--json-key", default="text", help="field holding the text in JSONL records")
    add_text_tree_options(parser, "the fraction of documents (text-tree mode: files) that tools/preprocess_data.py "
                                  "holds out with the same --seed and inputs; they are left out of the tokenizer's "
                                  "training")
    parser.add_argument("--sample-bytes", type=byte_count, default=0,
                        help="train on documents up to this many bytes (0: all); with --extensions a seeded random "
                             "sample of the training split's files, otherwise the first training documents")
    args = parser.parse_args(argv)
    return reported(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    """Train and write the tokenizer `args` describe; 0, or a ConfigError or OSError (`reported`)."""
    tree = None
    if args.extensions is not None:
        tree = scan_text_tree(args.input, args.extensions, args.valid_fraction, args.seed, args.max_file_bytes)
    docs, size = train_tokenizer(args.input, args.output, args.vocab_size, args.json_key, tree,
                                 args.sample_bytes, args.overwrite, args.valid_fraction, args.seed)
    print(f"wrote {args.output} (trained on {docs:,} documents, {size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
