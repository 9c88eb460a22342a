"""Parameter and FLOP counts of the dense decoder, for MFU estimates and planning."""
from __future__ import annotations

from megafp8.config import ModelConfig
from megafp8.model.attention import head_dim_of, kv_heads_of


def matmul_params_per_layer(cfg: ModelConfig) -> int:
    hd, nh, nkv = head_dim_of(cfg), cfg.num_heads, kv_heads_of(cfg)
    attention = cfg.hidden_size * (nh + 2 * nkv) * hd + nh * hd * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.ffn_hidden_size
    return attention + mlp


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 x GEMM params (LM head included) + causal attention scores.

    Attention counts QK^T and AV over the causal half of the T x T scores: 2 GEMMs x 2 FLOPs x
    T/2 keys on average x heads x head_dim, times 3 for forward + backward.
    """
    assert cfg.vocab_size is not None
    gemm_params = cfg.num_layers * matmul_params_per_layer(cfg) + cfg.hidden_size * cfg.vocab_size
    attention = cfg.num_layers * 3 * 2 * 2 * (seq_len / 2) * cfg.num_heads * head_dim_of(cfg)
    return 6.0 * gemm_params + attention
