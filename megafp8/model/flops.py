"""Parameter and FLOP counts of the dense decoder, for MFU estimates and planning."""
from __future__ import annotations

from megafp8.config import ModelConfig
from megafp8.model.attention import head_dim_of, kv_heads_of


def attention_params(cfg: ModelConfig) -> int:
    """GEMM parameters of one attention block (GQA or MLA)."""
    h, nh = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = (h * cfg.q_lora_rank + cfg.q_lora_rank * nh * qk) if cfg.q_lora_rank else h * nh * qk
        kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return q + kv + nh * cfg.v_head_dim * h
    hd, nkv = head_dim_of(cfg), kv_heads_of(cfg)
    return h * (nh + 2 * nkv) * hd + nh * hd * h


def matmul_params_per_layer(cfg: ModelConfig, layer: int = 0) -> int:
    """GEMM parameters a token passes through in block `layer` (MoE: router, shared and its top-k experts)."""
    attention = attention_params(cfg)
    if cfg.moe_num_experts > 0 and layer >= cfg.moe_first_dense_layers:
        active = cfg.moe_top_k + cfg.moe_num_shared_experts
        mlp = 3 * cfg.hidden_size * cfg.moe_ffn_hidden_size * active + cfg.hidden_size * cfg.moe_num_experts
    else:
        mlp = 3 * cfg.hidden_size * cfg.ffn_hidden_size
    return attention + mlp


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 x GEMM params a token uses (LM head included; for MoE layers the
    router, shared and top-k experts) + causal attention scores.

    Attention counts QK^T and AV over the causal half of the T x T scores: 2 GEMMs x 2 FLOPs x
    T/2 keys on average x heads x head_dim, times 3 for forward + backward.
    """
    assert cfg.vocab_size is not None
    gemm_params = sum(matmul_params_per_layer(cfg, i) for i in range(cfg.num_layers)) + cfg.hidden_size * cfg.vocab_size
    # Each MTP depth: its combining projection, a block like the last one, and another pass through the head.
    mtp_block = matmul_params_per_layer(cfg, cfg.num_layers - 1)
    gemm_params += cfg.mtp_depth * (2 * cfg.hidden_size * cfg.hidden_size + mtp_block + cfg.hidden_size * cfg.vocab_size)
    if cfg.attention == "mla":  # QK^T over nope + rope dims, AV over v dims
        per_head = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2
    else:
        per_head = head_dim_of(cfg)
    attention = (cfg.num_layers + cfg.mtp_depth) * 3 * 2 * 2 * (seq_len / 2) * cfg.num_heads * per_head
    return 6.0 * gemm_params + attention
