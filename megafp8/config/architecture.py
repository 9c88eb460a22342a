"""What each transformer block of a model is (`layer_spec`), and the parameter counts that follow from it.

One function says which attention and which MLP block `i` holds; the model's builder, its FLOP count, config
validation and the memory planner all ask it, so "block 3 is an MoE block" is decided in one place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from megafp8.config.attention import AttentionConfig
from megafp8.config.moe import MoeConfig
from megafp8.config.schema import ModelConfig


@dataclass(frozen=True)
class DenseMlp:
    """A block's SwiGLU MLP (`model.ffn_hidden_size` wide)."""

    ffn_hidden_size: int

    def params(self, hidden_size: int) -> int:
        """GEMM parameters: [gate; up] and down."""
        return 3 * hidden_size * self.ffn_hidden_size

    active_params = params  # a token passes through all of them


@dataclass(frozen=True)
class LayerSpec:
    """One transformer block: its attention and its MLP (dense, or the model's mixture of experts)."""

    attention: AttentionConfig
    mlp: Union[DenseMlp, MoeConfig]

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, MoeConfig)

    def params(self, cfg: ModelConfig) -> int:
        """GEMM parameters of the block (every expert; norms left out)."""
        return self.attention.params(cfg.hidden_size, cfg.num_heads) + self.mlp.params(cfg.hidden_size)

    def active_params(self, cfg: ModelConfig) -> int:
        """GEMM parameters one token passes through (MoE: the router, its top-k and the shared experts)."""
        return self.attention.params(cfg.hidden_size, cfg.num_heads) + self.mlp.active_params(cfg.hidden_size)


def layer_spec(cfg: ModelConfig, layer: int) -> LayerSpec:
    """Block `layer` (0-based) of the model: the model's attention; MoE after `moe.first_dense_layers`, else dense."""
    mlp = cfg.moe if cfg.moe.holds_layer(layer) else DenseMlp(cfg.ffn_hidden_size)
    return LayerSpec(cfg.attention, mlp)


def mtp_layer_spec(cfg: ModelConfig) -> LayerSpec:
    """The block of every multi-token-prediction module: built like the last main block (MoE if that one is)."""
    return layer_spec(cfg, cfg.num_layers - 1)


def describe_blocks(cfg: ModelConfig) -> str:
    """The blocks in a few words, e.g. `61 layers, hidden 7168, 128 heads MLA (q/kv ranks 1536/512), ffn 18432, 256
    experts top-8 (ffn 2048)`."""
    moe = f", {cfg.moe.describe()}" if cfg.moe.enabled else ""
    return (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.attention.describe(cfg.num_heads)}, "
            f"ffn {cfg.ffn_hidden_size}{moe}")


def approximate_parameters(cfg: ModelConfig) -> int:
    """Parameters of the model, roughly (every linear and expert, embedding and head; norms left out), in Python
    integers: a bound on its size before anything is built."""
    h = cfg.hidden_size
    blocks = sum(layer_spec(cfg, i).params(cfg) for i in range(cfg.num_layers))
    mtp = cfg.mtp_depth * (2 * h * h + mtp_layer_spec(cfg).params(cfg))
    return blocks + mtp + 2 * (cfg.vocab_size or 0) * h
