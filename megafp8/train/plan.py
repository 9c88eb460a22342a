"""Dry-run planning: parameters, per-GPU memory and throughput of a config, without allocating the model.

The model is built on the meta device (shapes only). Memory per rank follows the optimizer's
layout: model weights in the recipe's dtype, the FP32 gradient buffer (plus this rank's reduced
shard when sharded), FP32 master weights and AdamW moments divided over data-parallel ranks when
sharded. Activations are an estimate for one micro-batch without recomputation: ~34 bytes per
token per hidden unit per layer in BF16 (Megatron's count with a fused attention kernel), and the
logits (BF16, plus FP32 for the loss).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megafp8.config import Config, ConfigError
from megafp8.data import read_meta
from megafp8.model import Transformer, resolve_vocab_size, training_flops_per_token
from megafp8.precision import PrecisionRecipe

_PARAM_BYTES = {"bf16": 2, "fp8": 2, "fp16": 2, "fp32": 4}
GIB = 2**30


@dataclass
class Plan:
    params: dict[str, int]  # by part: embedding, attention, mlp, norms, lm_head
    bytes_per_rank: dict[str, float]  # weights, grads, master_weights, optimizer_states, activations
    flops_per_token: float
    world_size: int

    @property
    def total_params(self) -> int:
        return sum(self.params.values())

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes_per_rank.values())

    def tokens_per_s(self, peak_tflops: float, mfu: float) -> float:
        return peak_tflops * 1e12 * mfu * self.world_size / self.flops_per_token

    def render(self, peak_tflops: float, mfu: float) -> str:
        lines = ["| part | parameters |", "|---|---|"]
        lines += [f"| {part} | {count / 1e6:,.2f}M |" for part, count in self.params.items()]
        lines += [f"| **total** | **{self.total_params / 1e6:,.2f}M** |", "",
                  f"| memory per rank ({self.world_size} rank(s)) | GiB |", "|---|---|"]
        lines += [f"| {k.replace('_', ' ')} | {v / GIB:,.2f} |" for k, v in self.bytes_per_rank.items()]
        lines += [f"| **total** | **{self.total_bytes / GIB:,.2f}** |", "",
                  f"training FLOPs per token: {self.flops_per_token / 1e9:,.2f} GFLOP",
                  f"tokens/s at {100 * mfu:.0f}% MFU of {peak_tflops:g} TFLOP/s per GPU: "
                  f"{self.tokens_per_s(peak_tflops, mfu):,.0f}"]
        return "\n".join(lines)


def _part(name: str) -> str:
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if "norm" in name:
        return "norms"
    return "attention" if ".attn." in name else "mlp"


def make_plan(cfg: Config, world_size: int) -> Plan:
    """The plan of `cfg` on `world_size` data-parallel ranks; `model.vocab_size` must be set."""
    if cfg.model.vocab_size is None:
        raise ConfigError("planning needs model.vocab_size (it is otherwise read from the data): set it")
    recipe_name = cfg.precision.recipe if cfg.precision.recipe != "auto" else "fp8"
    model = Transformer(cfg.model, PrecisionRecipe.from_name(recipe_name), cfg.data.seq_len, device="meta")
    params: dict[str, int] = {p: 0 for p in ("embedding", "attention", "mlp", "norms", "lm_head")}
    for name, p in model.named_parameters():
        params[_part(name)] += p.numel()
    n = sum(params.values())
    dp = world_size
    shard = dp if cfg.optimizer.sharded else 1
    moment_bytes = 4 if cfg.optimizer.moment_dtype == "fp32" else 2
    tokens = cfg.training.micro_batch_size * cfg.data.seq_len
    activations = 34 * tokens * cfg.model.hidden_size * cfg.model.num_layers + tokens * cfg.model.vocab_size * (2 + 4)
    bytes_per_rank = {
        "weights": n * _PARAM_BYTES[recipe_name],
        "grads": n * 4 + (n * 4 / dp if cfg.optimizer.sharded and dp > 1 else 0),
        "master_weights": n * 4 / shard,
        "optimizer_states": n * 2 * moment_bytes / shard,
        "activations (estimate)": float(activations),
    }
    return Plan(params, bytes_per_rank, training_flops_per_token(cfg.model, cfg.data.seq_len), world_size)


def with_vocab(cfg: Config) -> Config:
    """`cfg` with model.vocab_size resolved from the data's tokenizer when it is not set."""
    if cfg.model.vocab_size is not None:
        return cfg

    try:
        vocab = read_meta(cfg.data.path).vocab_size
    except ConfigError:
        raise ConfigError(f"a dry run needs model.vocab_size or the data at data.path ({cfg.data.path}): "
                          "set model.vocab_size=N") from None
    return dataclasses.replace(cfg, model=resolve_vocab_size(cfg.model, vocab))


def dry_run(cfg: Config, world_size: int, peak_tflops: float, mfu: float) -> str:
    """The plan of `cfg` on `world_size` ranks as text (nothing is allocated, no process group is needed)."""
    cfg = with_vocab(cfg)
    m = cfg.model
    header = (f"{cfg.run_name or 'run'}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads / "
              f"{m.num_kv_heads or m.num_heads} kv, ffn {m.ffn_hidden_size}, vocab {m.vocab_size}, seq "
              f"{cfg.data.seq_len}, micro-batch {cfg.training.micro_batch_size}, precision {cfg.precision.recipe}, "
              f"optimizer {'sharded' if cfg.optimizer.sharded else 'replicated'} over {world_size} rank(s)")
    return header + "\n\n" + make_plan(cfg, world_size).render(peak_tflops, mfu)


def device_capacity(device: torch.device) -> Optional[int]:
    """Bytes of memory of a GPU; None on CPU (no fixed budget to check against)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def check_fits(plan: Plan, capacity: Optional[int]) -> None:
    """Fail fast, before allocating anything, when a GPU of `capacity` bytes cannot hold the planned state."""
    if capacity is not None and plan.total_bytes > capacity:
        parts = ", ".join(f"{k} {v / GIB:,.1f}" for k, v in plan.bytes_per_rank.items())
        raise ConfigError(
            f"this run needs about {plan.total_bytes / GIB:,.1f} GiB per GPU ({parts} GiB) but the GPU has "
            f"{capacity / GIB:,.1f} GiB: use more ranks, a smaller micro-batch or model; "
            "see `python launch/pretrain.py --config ... --dry-run --world-size N`"
        )
