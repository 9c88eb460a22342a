#!/usr/bin/env python
"""Inspect megafp8 checkpoints and convert them to and from Hugging Face safetensors (Llama, Mistral, Mixtral,
DeepSeek-V2 and -V3; docs/checkpoints.md lists what converts and what is refused).

    python tools/convert_checkpoint.py inspect runs/tiny_dense/checkpoints/step_00000200
    python tools/convert_checkpoint.py verify runs/tiny_dense/checkpoints/step_00000200
    python tools/convert_checkpoint.py to-hf runs/tiny_dense/checkpoints/step_00000200 --out hf/tiny [--fp8]
    python tools/convert_checkpoint.py to-hf runs/mine/checkpoints/step_00001000 --out hf/mine --tokenizer tok.json
    python tools/convert_checkpoint.py from-hf hf/tiny --out runs/from_hf/checkpoints
    python tools/convert_checkpoint.py consolidate runs/big/checkpoints/step_00001000 --out one_file/
    python tools/convert_checkpoint.py shard one_file/step_00001000 --out sharded/

`to-hf` writes config.json + model.safetensors as Llama (dense GQA), Mixtral (GQA + softmax MoE), DeepSeek-V2 (MLA +
softmax MoE) or DeepSeek-V3 (MLA, sigmoid MoE, MTP) (BF16, or with --fp8 E4M3 projection weights with 128x128
`weight_scale_inv` blocks); weights over --shard-gib (5) go into model-0000i-of-0000n.safetensors shards with
model.safetensors.index.json, as Hugging Face saves large models. `from-hf` writes a step-0 megafp8 checkpoint (fresh optimizer), and prints the model
settings to train from it with `checkpoint.resume=<printed path>`. A config key or tensor with no exact megafp8
equivalent is refused with one line naming it.
`verify` re-reads every file of each checkpoint given and checks it against the checksum recorded when it was written
(one line per checkpoint that passes; under one that fails, each of its problems, the first 10 listed; every checkpoint
is checked, then one error line counts the failures, exit status 2); it builds no model.
`consolidate` turns a sharded checkpoint (every rank's pieces) into one `state.pt`; `shard` does the reverse.
Neither needs a layout: both forms hold full tensors by name, and a run at any TP/PP/EP/DP layout loads either.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.checkpoint.convert import (consolidate, describe, export_hf, import_hf, missing_tokenizer_note,  # noqa: E402
                                        model_settings, shard)
from megafp8.checkpoint.local import verification_problems, verified_summary  # noqa: E402
from megafp8.config import ConfigError  # noqa: E402
from megafp8.config.arguments import reported, run_tool  # noqa: E402
from megafp8.config.errors import os_error_text  # noqa: E402


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse to write into an existing, non-empty --out unless --overwrite says to, and into a file at all."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory: choose another --out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConfigError(f"--out {out} exists and is not empty: choose another --out, or pass --overwrite to write "
                          "into it (files of the same name are replaced; to-hf also removes an earlier export's "
                          "weight files)")


MAX_LISTED = 10  # problems listed under one checkpoint, the rest counted: a damaged disk can fail thousands of shards


def verify_all(checkpoints: list[Path]) -> int:
    """Verify every checkpoint in `checkpoints`, printing its summary line, or its problems (the first MAX_LISTED);
    0, or once all are checked a ConfigError that counts the failures."""
    failed: list[tuple[Path, int]] = []  # each failed checkpoint and its count of problems
    for checkpoint in checkpoints:
        started = time.perf_counter()
        try:
            problems = verification_problems(checkpoint)
        except OSError as err:  # a directory that cannot be listed: said, and the next checkpoint still checked
            problems = [os_error_text(err)]
        if not problems:
            print(verified_summary(checkpoint, time.perf_counter() - started))
            continue
        failed.append((checkpoint, len(problems)))
        print(f"{checkpoint}: {_count(len(problems), 'problem')}:")
        print("\n".join(f"  {problem}" for problem in problems[:MAX_LISTED]))
        if len(problems) > MAX_LISTED:
            print(f"  ... and {len(problems) - MAX_LISTED} more")
    if failed:
        names = ", ".join(str(c) for c, _ in failed[:MAX_LISTED]) + (" ..." if len(failed) > MAX_LISTED else "")
        raise ConfigError(f"{len(failed)} of {_count(len(checkpoints), 'checkpoint')} failed verification, with "
                          f"{_count(sum(n for _, n in failed), 'problem')} (listed above): {names}")
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list tensors, shapes, dtypes, layout and step")
    inspect.add_argument("checkpoint", type=Path)
    verify = commands.add_parser("verify", help="check every file against its recorded checksum (no model is built)")
    verify.add_argument("checkpoints", type=Path, nargs="+", metavar="checkpoint")
    to_hf = commands.add_parser("to-hf", help="export to Hugging Face safetensors (Llama, Mixtral, DeepSeek-V2/V3)")
    to_hf.add_argument("checkpoint", type=Path)
    to_hf.add_argument("--out", type=Path, required=True)
    to_hf.add_argument("--fp8", action="store_true", help="store projections as E4M3 with 128x128 block scales")
    to_hf.add_argument("--tokenizer", type=Path, default=None,
                       help="the tokenizer.json the run's data was made with: copied into --out with a "
                            "tokenizer_config.json (AutoTokenizer loads the directory), its end-of-text id into "
                            "config.json's eos_token_id (else null)")
    to_hf.add_argument("--eos-token", default=None,
                       help="with --tokenizer: its end-of-text token, as tools/preprocess_data.py was given it")
    to_hf.add_argument("--shard-gib", type=float, default=5.0,
                       help="largest safetensors file to write, GiB (default 5): above it, shards and an index")
    from_hf = commands.add_parser("from-hf", help="import a Hugging Face Llama, Mistral, Mixtral or DeepSeek-V2/V3 "
                                                 "directory")
    from_hf.add_argument("hf_dir", type=Path)
    from_hf.add_argument("--out", type=Path, required=True, help="checkpoint directory to create step_00000000 in")
    converts = []
    for name, what in (("consolidate", "a checkpoint of either form -> one state.pt"),
                       ("shard", "a checkpoint of either form -> a sharded (torch.distributed.checkpoint) one")):
        convert = commands.add_parser(name, help=what)
        convert.add_argument("checkpoint", type=Path)
        convert.add_argument("--out", type=Path, required=True, help="checkpoint directory to create the step in")
        converts.append(convert)
    for command in (to_hf, from_hf, *converts):
        command.add_argument("--overwrite", action="store_true", help="write into an existing, non-empty --out")
    args = parser.parse_args(argv)
    return reported(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    """The command `args` names; 0, or a ConfigError or OSError (`reported`). The conversions that publish a
    checkpoint into --out hold the lock of a run's checkpoint directory there themselves (`lock_for_conversion`)."""
    if getattr(args, "out", None) is not None:
        check_out(args.out, args.overwrite)
    if args.command == "inspect":
        print(describe(args.checkpoint))
    elif args.command == "verify":
        return verify_all(args.checkpoints)
    elif args.command == "to-hf":
        if not 0 < args.shard_gib < float("inf"):
            raise ConfigError(f"--shard-gib {args.shard_gib:g}: give the largest file size in GiB, above 0")
        if args.eos_token is not None and args.tokenizer is None:
            raise ConfigError("--eos-token belongs to --tokenizer: add --tokenizer FILE.json")
        written = export_hf(args.checkpoint, args.out, args.fp8, int(args.shard_gib * 2**30), args.tokenizer,
                            args.eos_token)
        print(f"wrote {args.out} ({written})")
        if args.tokenizer is None:
            print(missing_tokenizer_note(args.checkpoint))
    elif args.command == "from-hf":
        path, cfg, notes = import_hf(args.hf_dir, args.out)
        print("\n".join(notes + [f"wrote {path}", f"train from it with checkpoint.resume={path} and these model "
                                 "settings:", model_settings(cfg)]))
    else:
        print(f"wrote {(consolidate if args.command == 'consolidate' else shard)(args.checkpoint, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
