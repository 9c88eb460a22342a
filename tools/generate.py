#!/usr/bin/env python
"""Continue a prompt with a checkpoint's model: a look at what a run has learned, without exporting it.

    python tools/generate.py runs/tiny_dense/checkpoints/step_00000200 --prompt "def main():"
    python tools/generate.py runs/mine/checkpoints/step_00001000 --prompt "Once upon" --tokens 100 \\
        --temperature 0.8 --top-k 50 --samples 3

The checkpoint (any form, saved at any layout) is read onto one device, CUDA where there is one, and continued with
the tokenizer its data was made with (`--tokenizer` where that file moved, or for an import). Greedy by default;
`--temperature` above 0 samples, seeded (`--seed`). Each new token runs the model over a window of the run's
data.seq_len tokens: a sanity check of a run, not a server (docs/checkpoints.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.config.arguments import reported, run_tool, whole_number  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint directory (e.g. runs/NAME/checkpoints/step_N)")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--tokens", type=whole_number(1), default=64, help="new tokens at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): the most likely token each time; above 0: sampled at this temperature")
    parser.add_argument("--top-k", type=whole_number(0), default=0, help="with --temperature: sample among the k "
                                                                        "likeliest (0, the default: all)")
    parser.add_argument("--samples", type=whole_number(1), default=1, help="continuations to print (seeds "
                                                                           "--seed, --seed + 1, ...)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer.json (or 'byte'), where the one the data was made with moved")
    parser.add_argument("--eos-token", default=None, help="with --tokenizer: its end-of-document token")
    parser.add_argument("--window", type=whole_number(1), default=None,
                        help="tokens a forward pass reads, at most the run's data.seq_len (the default)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    args = parser.parse_args(argv)
    if args.temperature < 0 or args.temperature != args.temperature:
        parser.error(f"--temperature {args.temperature}: give 0 (greedy) or a positive number")
    if args.top_k and not args.temperature:
        parser.error("--top-k samples among the likeliest tokens: give --temperature above 0 too (0 is greedy)")
    return reported(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    """Print the continuations `args` ask for; 0, or a ConfigError or OSError (`reported`)."""
    import torch  # after the arguments: --help and usage errors need no torch

    from megafp8.config import ConfigError
    from megafp8.train.generate import continuation_text, load_generator
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise ConfigError(f"--device {args.device}: give cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: this torch sees no CUDA GPU ({torch.__version__}): use --device "
                          "cpu, or leave --device out")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {args.device}: give cpu, cuda or cuda:N")
    generator = load_generator(args.checkpoint, device, args.tokenizer, args.eos_token, args.window)
    prompt = generator.tokenizer.document(args.prompt)  # with the beginning-of-document token its data had
    for sample in range(args.samples):
        ids = generator.continue_ids(prompt, args.tokens, args.temperature, args.top_k, args.seed + sample)
        if args.samples > 1:
            print(f"--- sample {sample + 1} (seed {args.seed + sample})")
        print(args.prompt + continuation_text(generator.tokenizer, prompt, ids))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
