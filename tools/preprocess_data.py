#!/usr/bin/env python
"""Tokenize text or JSONL files into megafp8's memory-mapped token format.

Examples:
    python tools/preprocess_data.py --input stdlib --output data/pystdlib
    python tools/preprocess_data.py --input corpus/ --output data/mycorpus --tokenizer tokenizer.json
    python tools/preprocess_data.py --input a.jsonl b.jsonl --json-key content --output data/ab
    # documents begun as Llama 3 was trained (to continue an imported Llama 3 model)
    python tools/preprocess_data.py --input corpus/ --output data/llama --tokenizer llama3/tokenizer.json \\
        --bos-token '<|begin_of_text|>'
    # your own held-out file as the validation split (every --input document is trained on)
    python tools/preprocess_data.py --input corpus/ --valid-input heldout.jsonl --output data/mycorpus
    # every .py/.md/.rst/.txt file under a tree, de-duplicated, held out by file; --dry-run only measures it
    python tools/preprocess_data.py --input /usr/lib/python3/dist-packages --extensions .py .md .rst .txt \\
        --output data/pkgs --dry-run
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config.arguments import reported, run_tool, whole_number  # noqa: E402
from megafp8.data.preprocess import preprocess  # noqa: E402
from megafp8.data.text_tree import scan_text_tree, summary_lines  # noqa: E402


byte_count = whole_number(0, " (0: no limit)")  # 1000000 or 1e6


def add_text_tree_options(parser: argparse.ArgumentParser, held_out: str = "fraction of documents (files) held out",
                          fraction_default: float | None = 0.01) -> None:
    """The options of the text-tree input mode (shared with tools/train_tokenizer.py). `fraction_default` None:
    the caller decides `--valid-fraction`'s default (preprocess_data.py's depends on --valid-input)."""
    parser.add_argument("--extensions", nargs="+", default=None, metavar="EXT",
                        help="text-tree mode: every file under the input directories whose name ends with one of "
                             "these (e.g. .py .md .rst .txt) is one document; identical files are kept once, whole "
                             "files are held out (chosen by a seeded hash of their content), binary, non-UTF-8 and "
                             "empty files are skipped. Without it: directories are searched for .txt/.jsonl/.json "
                             "and each document is held out by a seeded draw")
    parser.add_argument("--valid-fraction", type=float, default=fraction_default, help=f"{held_out} (default 0.01)")
    # numpy's generators take no negative seed: -1 was a ValueError traceback from the split's draw
    parser.add_argument("--seed", type=whole_number(0), default=1234,
                        help="seed of the held-out split (and text-tree order); 0 or more")
    parser.add_argument("--max-file-bytes", type=byte_count, default=0,
                        help="text-tree mode: skip files larger than this (0: no limit)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="text/JSONL files, directories (searched for .txt/.jsonl/.json, or for --extensions), "
                             "or 'stdlib' (the Python standard library's sources: a corpus on any machine)")
    parser.add_argument("--output", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--valid-input", nargs="+", default=None,
                        help="text/JSONL files or directories whose documents are the validation split (your own "
                             "held-out set); every --input document is then trained on (no --valid-fraction)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' (default) or a tokenizer.json path")
    parser.add_argument("--eos-token", default=None, help="end-of-document token of a tokenizer.json")
    parser.add_argument("--bos-token", default=None,
                        help="a tokenizer.json's token to begin every document with (e.g. '<|begin_of_text|>' to "
                             "continue a Llama 3 model, which was trained so); default: none")
    add_text_tree_options(parser, "fraction of documents (files) held out; 0 with --valid-input",
                          fraction_default=None)
    parser.add_argument("--max-bytes", type=byte_count, default=0,
                        help="text-tree mode: keep a seeded random sample of the unique files up to this many bytes "
                             "(0: all)")
    parser.add_argument("--dry-run", action="store_true",
                        help="text-tree mode: scan and print the summary (files, duplicates, skipped, bytes per "
                             "split) without tokenizing or writing anything")
    parser.add_argument("--shard-tokens", type=whole_number(1), default=100_000_000, help="tokens per shard file")
    parser.add_argument("--json-key", default="text", help="field holding the text in JSONL records")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output directory (one this tool wrote, holding nothing else, or an "
                             "empty one)")
    args = parser.parse_args(argv)
    if args.extensions is None and (args.dry_run or args.max_bytes or args.max_file_bytes):
        parser.error("--dry-run, --max-bytes and --max-file-bytes belong to the text-tree mode: add --extensions")
    if args.extensions is not None and args.valid_input:
        parser.error("--valid-input belongs to the default mode: drop --extensions, or hold files out with "
                     "--valid-fraction")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.valid_fraction is None:  # nothing drawn beside a held-out file of one's own
        args.valid_fraction = 0.0 if args.valid_input else 0.01
    return reported(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    """Measure (`--dry-run`) or tokenize what `args` name; 0, or a ConfigError or OSError (`reported`)."""
    tree = None
    if args.extensions is not None:
        tree = scan_text_tree(args.input, args.extensions, args.valid_fraction, args.seed, args.max_file_bytes,
                              args.max_bytes)
        if args.dry_run:
            print("\n".join(summary_lines(tree)))
            return 0
    splits = preprocess(args.input, args.output, args.tokenizer, args.valid_fraction, args.seed,
                        args.shard_tokens, args.json_key, args.eos_token, args.overwrite, tree, args.valid_input,
                        args.bos_token)
    for split, shards in splits.items():
        print(f"{split}: {sum(s['num_docs'] for s in shards)} documents, "
              f"{sum(s['num_tokens'] for s in shards):,} tokens in {len(shards)} shard(s)")
    if tree is not None:
        tokens = {split: sum(s["num_tokens"] for s in shards) for split, shards in splits.items()}
        print("\n".join(summary_lines(tree, tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
