"""Which layers can run FP8: per-layer sensitivity of a model to per-tile FP8 GEMMs.

For each GEMM layer (the LM head, a precision island, is left out) on a few batches:
- output SNR: the layer's BF16 output against the same GEMM with per-tile FP8 operands, and with
  per-tensor FP8 for contrast;
- gradient SNR: the input gradient (dgrad) and weight gradient (wgrad) against BF16, for the
  output gradient the BF16 backward delivered;
- loss change: the model's loss with only that layer switched to FP8, against all-BF16.
A layer passes ("FP8") when its output and gradient SNRs reach `min_snr_db` and its relative loss
change stays within `max_loss_change`; otherwise the verdict is "keep BF16".
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.nn as nn

from megafp8.checkpoint import check_tensors_match, load_checkpoint
from megafp8.checkpoint.loading import LoadAdvice
from megafp8.data import PackedDataset, TokenStream, read_meta, validation_batches
from megafp8.model import resolve_vocab_size
from megafp8.parallel import ParallelLinear
from megafp8.precision import E4M3, Fp8Recipe, PrecisionRecipe
from megafp8.precision.quantize import dequantize_128x128, dequantize_1x128, quantize_128x128, quantize_1x128
from megafp8.train.build import build_model

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class LayerSensitivity:
    name: str
    output_snr_db: float
    output_snr_per_tensor_db: float
    dgrad_snr_db: float
    wgrad_snr_db: float
    loss_change: float  # relative: (loss with this layer in FP8 - BF16 loss) / BF16 loss
    verdict: str


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference.double() - approx.double()).square().sum().item()
    signal = reference.double().square().sum().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def _per_tile(x: torch.Tensor) -> torch.Tensor:
    return dequantize_1x128(*quantize_1x128(x, E4M3))


def _per_block(w: torch.Tensor) -> torch.Tensor:
    return dequantize_128x128(*quantize_128x128(w, E4M3))


def _per_tensor(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().max().clamp(min=1e-30) / E4M3.max
    return (x / scale).clamp(-E4M3.max, E4M3.max).to(E4M3.dtype).float() * scale


def _capture(model: nn.Module, layers: dict[str, ParallelLinear], batch: Batch) -> dict[str, dict[str, torch.Tensor]]:
    """Each layer's input, weight and output gradient on one BF16 forward/backward."""
    seen: dict[str, dict[str, torch.Tensor]] = {}
    handles = []
    for name, layer in layers.items():
        def hook(module, inputs, output, name=name):
            x = module.gemm_input(inputs).detach()
            seen[name] = {"x": x.reshape(-1, x.shape[-1]).float(),
                          "w": module.weight.detach().float()}
            output.register_hook(lambda g, name=name: seen[name].__setitem__("dy", g.reshape(-1, g.shape[-1]).float()))
        handles.append(layer.register_forward_hook(hook))
    model.zero_grad(set_to_none=True)
    model(*batch).backward()
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return seen


@torch.no_grad()
def _mean_loss(model: nn.Module, batches: Iterable[Batch]) -> float:
    losses = [model(tokens, targets).item() for tokens, targets in batches]
    return sum(losses) / len(losses)


def analyze(model: nn.Module, batches: list[Batch], min_snr_db: float = 25.0,
            max_loss_change: float = 0.005) -> list[LayerSensitivity]:
    """Sensitivity of every FP8-eligible GEMM layer of `model` (all layers BF16 on entry and on exit)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, ParallelLinear) and n != "lm_head"}
    base = {n: m.recipe for n, m in layers.items()}
    fp8 = PrecisionRecipe.from_name("fp8", Fp8Recipe(backend="reference"))
    captured = _capture(model, layers, batches[0])
    base_loss = _mean_loss(model, batches)
    results = []
    for name, layer in layers.items():
        t = captured[name]
        x, w, dy = t["x"], t["w"], t["dy"]
        y = x @ w.t()
        layer.set_recipe(fp8)
        fp8_loss = _mean_loss(model, batches)
        layer.set_recipe(base[name])
        output = snr_db(y, _per_tile(x) @ _per_block(w).t())
        grads = (snr_db(dy @ w, _per_tile(dy) @ _per_block(w)),
                 snr_db(dy.t() @ x, _per_tile(dy.t().contiguous()) @ _per_tile(x.t().contiguous()).t()))
        change = (fp8_loss - base_loss) / base_loss
        passes = min(output, *grads) >= min_snr_db and abs(change) <= max_loss_change
        results.append(LayerSensitivity(name, output, snr_db(y, _per_tensor(x) @ _per_tensor(w).t()), *grads,
                                        change, "FP8" if passes else "keep BF16"))
    return results


def format_table(results: list[LayerSensitivity], min_snr_db: float, max_loss_change: float) -> str:
    lines = [
        f"verdict: FP8 if every SNR >= {min_snr_db:g} dB and |loss change| <= {100 * max_loss_change:g}%",
        "",
        "| layer | output SNR per-tile (dB) | output SNR per-tensor (dB) | dgrad SNR (dB) | wgrad SNR (dB) "
        "| loss change, this layer FP8 | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.name} | {r.output_snr_db:.1f} | {r.output_snr_per_tensor_db:.1f} | {r.dgrad_snr_db:.1f} "
                     f"| {r.wgrad_snr_db:.1f} | {100 * r.loss_change:+.3f}% | {r.verdict} |")
    return "\n".join(lines)


def plot(results: list[LayerSensitivity], min_snr_db: float, path: str) -> None:
    """Bar chart of per-tile and per-tensor output SNR per layer, with the threshold (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in results]
    xs = range(len(results))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(results) + 2), 4.5))
    ax.bar([i - 0.2 for i in xs], [r.output_snr_db for r in results], width=0.4, label="per-tile FP8 (1x128 / 128x128)")
    ax.bar([i + 0.2 for i in xs], [r.output_snr_per_tensor_db for r in results], width=0.4, label="per-tensor FP8")
    ax.axhline(min_snr_db, color="red", linestyle="--", label=f"threshold {min_snr_db:g} dB")
    for i, r in enumerate(results):
        if r.verdict != "FP8":
            ax.annotate("keep BF16", (i, r.output_snr_db), ha="center", va="bottom", fontsize=8, color="red")
    ax.set_xticks(list(xs), names, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("output SNR (dB)")
    ax.set_title("FP8 sensitivity per GEMM layer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_and_batches(cfg, checkpoint: str | None, num_batches: int, device: torch.device
                      ) -> tuple[nn.Module, list[Batch]]:
    """The config's model in BF16 (weights from `checkpoint` if given, else its seeded init) and the first
    `num_batches` micro-batches of the held-out split (the training split if there is none)."""
    meta = read_meta(cfg.data.directories[0])  # of a mixture (data.paths), its first directory
    model_cfg = resolve_vocab_size(cfg.model, meta.vocab_size)
    bf16_cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, recipe="bf16"))
    model = build_model(bf16_cfg, model_cfg, PrecisionRecipe.from_name("bf16"), device)
    if checkpoint:
        state = load_checkpoint(Path(checkpoint), advice=LoadAdvice(missing="check --checkpoint",
                                                                     damaged="measure an earlier checkpoint"),
                                tensors="weights")
        check_tensors_match(state["model"], model.state_dict(), Path(checkpoint))
        model.load_state_dict(state["model"])
    split = cfg.data.valid_split if cfg.data.valid_split in meta.splits else cfg.data.train_split
    dataset = PackedDataset(TokenStream(meta, split), cfg.data.seq_len, split)
    batches = validation_batches(dataset, cfg.training.micro_batch_size, num_batches, 0, 1)
    return model, [(t.to(device), y.to(device)) for t, y in batches]
