"""Text from a checkpoint: a look at what a run has learned, without exporting it (`tools/generate.py`).

The model is built on one device from the checkpoint's weights (the FP32 masters where it has them), whatever
layout wrote it, and runs in FP32 (CPU) or BF16 (GPU): a sanity check of a pretraining run, not a server. Each new
token costs one forward pass over a fixed window of the run's `data.seq_len` tokens (the prompt and what follows,
the last `seq_len` of them; the rest padded on the right, which a causal model never reads at earlier positions),
so the model sees every length it was trained on and nothing longer. A prompt begins as the run's documents
began: with the beginning-of-document token where its data had one (`--bos-token` at preprocessing), and for an
imported model never trained here, with the token its tokenizer.json's template begins a text with (as
`AutoTokenizer` encodes it: Llama's `<|begin_of_text|>`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megafp8.checkpoint.convert import best_weights, model_config_of
from megafp8.checkpoint.loading import CONVERTING, load_checkpoint
from megafp8.config import ConfigError
from megafp8.data.dataset import tokenizer_record
from megafp8.data.tokenizer import HFTokenizer, Tokenizer, tokenizer_of_data
from megafp8.model import Transformer
from megafp8.precision import PrecisionRecipe
from megafp8.precision.cpu_gemm import widen_reduced_precision_gemms


@dataclass
class Generator:
    """A checkpoint's model, ready to continue text, and the tokenizer its data was made with."""

    model: Transformer
    tokenizer: Tokenizer
    window: int  # tokens a forward pass reads: the run's data.seq_len
    device: torch.device

    @torch.no_grad()
    def continue_ids(self, ids: list[int], new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                     seed: int = 0, stop_at_eos: bool = True) -> list[int]:
        """`new_tokens` ids after `ids`: the most likely one each time (`temperature` 0), else drawn from the
        softmax at `temperature` over the `top_k` likeliest (0: all), seeded. Stops early at the end-of-document
        token (not returned) when `stop_at_eos`."""
        if not ids:
            raise ConfigError("the prompt is empty: give at least one character of text")
        draw = torch.Generator(device="cpu").manual_seed(seed)
        out: list[int] = []
        for _ in range(new_tokens):
            context = (ids + out)[-self.window:]
            tokens = torch.full((1, self.window), self.tokenizer.eos_id, dtype=torch.int64)
            tokens[0, :len(context)] = torch.tensor(context)
            logits = self.model(tokens.to(self.device))[0, len(context) - 1].float().cpu()
            logits = logits[: self.tokenizer.vocab_size]  # padded vocabulary rows are no token
            token = _choose(logits, temperature, top_k, draw)
            if stop_at_eos and token == self.tokenizer.eos_id:
                break
            out.append(token)
        return out


def continuation_text(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The text `ids` add after the `prompt` ids: the prompt and continuation decoded together, less the prompt's
    own text. Decoded alone, a continuation loses the space its first token begins with under a tokenizer whose
    decoder strips a text's leading space (Llama 2's and Mistral's: "Once upon" went on "a time", printed as
    "Once upona time")."""
    whole, head = tokenizer.decode(prompt + ids), tokenizer.decode(prompt)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)


def _choose(logits: torch.Tensor, temperature: float, top_k: int, draw: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    if top_k:
        threshold = torch.topk(logits, min(top_k, len(logits))).values[-1]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=draw))


DEFAULT_WINDOW = 2048  # tokens a forward pass reads where the checkpoint records no data.seq_len (an import)


def load_generator(checkpoint: Path, device: torch.device, tokenizer: Optional[str] = None,
                   eos_token: Optional[str] = None, window: Optional[int] = None) -> Generator:
    """The model of `checkpoint` on `device` and its tokenizer: `tokenizer` (a tokenizer.json, or `byte`), else the
    one the checkpoint's data was made with (recorded in its data position). `window`: the tokens a forward pass
    reads; by default the run's data.seq_len (`DEFAULT_WINDOW` for an import, which records none)."""
    state = load_checkpoint(checkpoint, advice=CONVERTING, tensors="weights")
    cfg = model_config_of(state)
    record = tokenizer_record(state.get("loader", {}).get("fingerprint", {}))
    recorded = record.get("tokenizer")
    spec = tokenizer or recorded
    if spec is None:
        raise ConfigError(f"{checkpoint} records no tokenizer (an imported model, or a checkpoint written before "
                          "megafp8 recorded it): give --tokenizer FILE.json")
    if tokenizer is None and spec != "byte" and not Path(spec).is_file():
        raise ConfigError(f"{checkpoint}'s data was tokenized with {spec}, which is not there now: give "
                          "--tokenizer FILE.json (that tokenizer, moved)")
    tok = tokenizer_of_data(spec, eos_token, record.get("eos_id"), record.get("bos_id"))
    bos = tok.template_bos() if recorded is None and isinstance(tok, HFTokenizer) else None
    if bos is not None:  # an import: its text encoded as its authors did (`AutoTokenizer`)
        tok = HFTokenizer(spec, eos_token, bos_token=bos)
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(f"tokenizer {spec} has {tok.vocab_size} ids, more than the model's {cfg.vocab_size} "
                          "embedding rows: give the tokenizer the run's data was made with")
    window = _window(checkpoint, window, state.get("config", {}).get("data", {}).get("seq_len"))
    recipe = PrecisionRecipe.from_name("bf16" if device.type == "cuda" else "fp32")
    if device.type == "cpu":
        widen_reduced_precision_gemms()
    model = Transformer(cfg, recipe, window, device=device)
    model.load_state_dict(best_weights(state))
    return Generator(model.eval(), tok, window, device)


def _window(checkpoint: Path, asked: Optional[int], seq_len: Optional[int]) -> int:
    """The tokens a forward pass reads: `asked` (--window), at most the run's `seq_len` (the longest the model was
    trained on: RoPE positions past it were never seen, and the continuation would say nothing about the run);
    by default `seq_len`, or `DEFAULT_WINDOW` for an import, which records none."""
    if asked is None:
        return int(seq_len or DEFAULT_WINDOW)
    if seq_len and asked > int(seq_len):
        raise ConfigError(f"--window {asked}: {checkpoint} was trained on windows of {int(seq_len)} tokens "
                          f"(data.seq_len), and a longer one reads positions it never saw: give --window "
                          f"{int(seq_len)} or less, or leave it out")
    return asked
