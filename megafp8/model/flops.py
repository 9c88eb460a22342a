"""FLOP counts of the decoder, for MFU estimates and planning, from each block's spec (`layer_spec`)."""
from __future__ import annotations

from megafp8.config import ModelConfig, layer_spec, mtp_layer_spec


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 x GEMM params a token uses (LM head included; for MoE layers the
    router, shared and top-k experts) + causal attention scores (each kind's `core_flops`)."""
    assert cfg.vocab_size is not None
    h = cfg.hidden_size
    gemm_params = sum(layer_spec(cfg, i).active_params(cfg) for i in range(cfg.num_layers)) + h * cfg.vocab_size
    # Each MTP depth: its combining projection, a block like the last one, and another pass through the head.
    gemm_params += cfg.mtp_depth * (2 * h * h + mtp_layer_spec(cfg).active_params(cfg) + h * cfg.vocab_size)
    attention = (cfg.num_layers + cfg.mtp_depth) * cfg.attention.core_flops(h, cfg.num_heads, seq_len)
    return 6.0 * gemm_params + attention
