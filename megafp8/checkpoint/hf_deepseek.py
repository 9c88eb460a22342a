"""Conversion between megafp8 weights and Hugging Face safetensors in the DeepSeek-V3 layout (MLA, MoE, MTP).

Names follow the published DeepSeek-V3 checkpoints (`model.layers.N.self_attn.kv_a_proj_with_mqa.weight`,
`model.layers.N.mlp.experts.E.gate_proj.weight`, `model.layers.N.mlp.gate.e_score_correction_bias`, ...),
which `transformers`' `DeepseekV3ForCausalLM` loads. Three layouts differ from ours:

- rotary dims: DeepSeek stores each head's rotary query/key rows in interleaved pairs (`rope_interleave`);
  ours are "rotate half" (pair i is rows i and i + d/2). Export interleaves, import undoes it.
- our stacked expert weights (experts, out, in) and fused gate/up rows split into one tensor per expert
  and projection.
- MTP module k is stored as layer `num_layers + k` with `enorm`, `hnorm`, `eh_proj` (whose input is
  [embedding; hidden], ours [hidden; embedding], so its column halves swap), `shared_head.norm`, and
  copies of the embedding and head (`embed_tokens`, `shared_head.head`), as DeepSeek-V3 ships them.

FP8 export stores every tile-aligned projection as E4M3 with 128x128 `weight_scale_inv` blocks
(the router, norms, embedding and head stay BF16/FP32; an unaligned weight, such as kv_a at
512 + 64 rows, stays BF16).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from megafp8.config import ConfigError, ModelConfig
from megafp8.precision.formats import E4M3, TILE
from megafp8.precision.quantize import quantize_128x128

_ATTN = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
         "attn.q_a_proj.weight": "self_attn.q_a_proj.weight", "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
         "attn.q_b_proj.weight": "self_attn.q_b_proj.weight", "attn.q_proj.weight": "self_attn.q_proj.weight",
         "attn.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
         "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
         "attn.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
         "attn.out_proj.weight": "self_attn.o_proj.weight", "mlp.down_proj.weight": "mlp.down_proj.weight",
         "mlp.router.weight": "mlp.gate.weight", "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
         "mlp.shared.down_proj.weight": "mlp.shared_experts.down_proj.weight"}
_GATE_UP = {"mlp.gate_up_proj.weight": "mlp", "mlp.shared.gate_up_proj.weight": "mlp.shared_experts"}
_MTP = {"embed_norm.weight": "enorm.weight", "hidden_norm.weight": "hnorm.weight",
        "combine_proj.weight": "eh_proj.weight", "out_norm.weight": "shared_head.norm.weight"}
_ROUTED = ("mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight")
_TOP = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}


def check_exportable(cfg: ModelConfig) -> None:
    if cfg.attention != "mla":
        raise ConfigError("the DeepSeek-V3 layout needs MLA attention (model.attention=mla); GQA models with MoE or "
                          "MTP have no Hugging Face layout here")
    if cfg.moe_num_experts and cfg.moe_score_func != "sigmoid":
        raise ConfigError("DeepSeek-V3's router scores with sigmoid: a model with moe_score_func=softmax does not "
                          "convert to its layout")


def deepseek_config(cfg: ModelConfig, max_seq_len: int, fp8: bool) -> dict[str, Any]:
    moe = cfg.moe_num_experts > 0
    out = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_nextn_predict_layers": cfg.mtp_depth, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads, "n_shared_experts": cfg.moe_num_shared_experts,
        "n_routed_experts": cfg.moe_num_experts if moe else 1, "routed_scaling_factor": cfg.moe_routed_scaling_factor,
        "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim, "n_group": cfg.moe_n_group,
        "topk_group": cfg.moe_topk_group, "num_experts_per_tok": cfg.moe_top_k,
        "first_k_dense_replace": cfg.moe_first_dense_layers if moe else cfg.num_layers,
        "norm_topk_prob": cfg.moe_norm_topk_prob, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "hidden_act": "silu", "max_position_embeddings": max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_interleave": True, "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if fp8:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return out


def model_config_of(hf: dict[str, Any]) -> ModelConfig:
    """Our model config from a DeepSeek-V3 `config.json`."""
    moe = hf.get("first_k_dense_replace", 0) < hf["num_hidden_layers"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], attention="mla", q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], ffn_hidden_size=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=hf.get("rope_theta", 10000.0),
        mtp_depth=hf.get("num_nextn_predict_layers", 0),
        moe_num_experts=hf["n_routed_experts"] if moe else 0, moe_top_k=hf.get("num_experts_per_tok", 1) if moe else 1,
        moe_ffn_hidden_size=hf.get("moe_intermediate_size", 0), moe_num_shared_experts=hf.get("n_shared_experts", 0),
        moe_first_dense_layers=hf.get("first_k_dense_replace", 0), moe_score_func="sigmoid",
        moe_n_group=hf.get("n_group", 1) if moe else 1, moe_topk_group=hf.get("topk_group", 1) if moe else 1,
        moe_routed_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        moe_norm_topk_prob=hf.get("norm_topk_prob", True))


def _rope_order(rope_dim: int) -> torch.Tensor:
    """Row order taking our rotate-half rotary rows to DeepSeek's interleaved pairs: new[2i] = old[i],
    new[2i + 1] = old[i + d/2]."""
    half = rope_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def _permute_rope(w: torch.Tensor, cfg: ModelConfig, name: str, inverse: bool) -> torch.Tensor:
    """Reorder the rotary rows of a query projection (each head's last rope rows) or of kv_a (its last rope rows)."""
    rope = cfg.qk_rope_head_dim
    order = _rope_order(rope)
    if inverse:
        order = torch.argsort(order)
    if name.endswith("kv_a_proj.weight"):
        return torch.cat([w[:-rope], w[-rope:][order]])
    heads = w.view(cfg.num_heads, cfg.qk_nope_head_dim + rope, -1)  # (heads, nope + rope, in)
    nope, rotary = heads[:, :cfg.qk_nope_head_dim], heads[:, cfg.qk_nope_head_dim:]
    return torch.cat([nope, rotary[:, order]], dim=1).reshape(w.shape)


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    half = w.shape[1] // 2
    return torch.cat([w[:, half:], w[:, :half]], dim=1)


def _block_mapping(ours: str, hf: str, key: str, tensor: torch.Tensor, cfg: ModelConfig,
                   emit: Callable[[str, torch.Tensor], None]) -> bool:
    """Emit the DeepSeek tensors of one block tensor (`key` is its name within the block); False if unknown."""
    if key in ("attn.q_b_proj.weight", "attn.q_proj.weight", "attn.kv_a_proj.weight"):
        emit(f"{hf}.{_ATTN[key]}", _permute_rope(tensor, cfg, key, inverse=False))
    elif key in _ATTN:
        emit(f"{hf}.{_ATTN[key]}", tensor)
    elif key in _GATE_UP:
        gate, up = tensor.chunk(2, dim=0)
        emit(f"{hf}.{_GATE_UP[key]}.gate_proj.weight", gate)
        emit(f"{hf}.{_GATE_UP[key]}.up_proj.weight", up)
    elif key == _ROUTED[0]:
        for e, w in enumerate(tensor):
            gate, up = w.chunk(2, dim=0)
            emit(f"{hf}.mlp.experts.{e}.gate_proj.weight", gate)
            emit(f"{hf}.mlp.experts.{e}.up_proj.weight", up)
    elif key == _ROUTED[1]:
        for e, w in enumerate(tensor):
            emit(f"{hf}.mlp.experts.{e}.down_proj.weight", w)
    else:
        return False
    return True


def to_deepseek_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, fp8: bool) -> dict[str, torch.Tensor]:
    """Our full state dict (weights and the routers' `expert_bias`) -> DeepSeek-V3-named tensors."""
    out: dict[str, torch.Tensor] = {}

    def emit(name: str, t: torch.Tensor) -> None:
        if fp8 and name.endswith("_proj.weight") and t.ndim == 2 and t.shape[0] % TILE == 0 and t.shape[1] % TILE == 0:
            out[name], out[name + "_scale_inv"] = quantize_128x128(t.float(), E4M3)
        elif name.endswith(("gate.weight", "e_score_correction_bias")):
            out[name] = t.float().contiguous()  # the router stays FP32, as DeepSeek ships it
        else:
            out[name] = t.to(torch.bfloat16).contiguous()

    for name, tensor in state.items():
        if name in _TOP:
            emit(_TOP[name], tensor)
            continue
        parts = name.split(".")
        if parts[0] == "layers":
            if _block_mapping(name, f"model.layers.{parts[1]}", ".".join(parts[2:]), tensor, cfg, emit):
                continue
        elif parts[0] == "mtp":
            hf = f"model.layers.{cfg.num_layers + int(parts[1])}"
            key = ".".join(parts[2:])
            if key in _MTP:
                emit(f"{hf}.{_MTP[key]}", _swap_halves(tensor) if key == "combine_proj.weight" else tensor)
                continue
            if parts[2] == "block" and _block_mapping(name, hf, ".".join(parts[3:]), tensor, cfg, emit):
                continue
        raise ConfigError(f"tensor '{name}' has no DeepSeek-V3 name")
    for k in range(cfg.mtp_depth):  # DeepSeek-V3 ships each MTP layer with its own embedding and head copies
        emit(f"model.layers.{cfg.num_layers + k}.embed_tokens.weight", state["embed.weight"])
        emit(f"model.layers.{cfg.num_layers + k}.shared_head.head.weight", state["lm_head.weight"])
    return out


def from_deepseek_tensors(get: Callable[[str], torch.Tensor], expected: dict[str, tuple[int, ...]],
                          cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepSeek-V3-named tensors (read through `get`, dequantized) -> our state dict in FP32, for every name in
    `expected` (our model's names and full shapes)."""
    ours: dict[str, torch.Tensor] = {}
    for name in expected:
        parts = name.split(".")
        if name in _TOP:
            ours[name] = get(_TOP[name])
            continue
        if parts[0] == "layers":
            hf, key = f"model.layers.{parts[1]}", ".".join(parts[2:])
        else:  # mtp.K.<...>
            hf = f"model.layers.{cfg.num_layers + int(parts[1])}"
            key = ".".join(parts[2:])
            if key in _MTP:
                t = get(f"{hf}.{_MTP[key]}")
                ours[name] = _swap_halves(t) if key == "combine_proj.weight" else t
                continue
            key = key.removeprefix("block.")
        if key in ("attn.q_b_proj.weight", "attn.q_proj.weight", "attn.kv_a_proj.weight"):
            ours[name] = _permute_rope(get(f"{hf}.{_ATTN[key]}"), cfg, key, inverse=True)
        elif key in _ATTN:
            ours[name] = get(f"{hf}.{_ATTN[key]}")
        elif key in _GATE_UP:
            ours[name] = torch.cat([get(f"{hf}.{_GATE_UP[key]}.{p}_proj.weight") for p in ("gate", "up")])
        elif key == _ROUTED[0]:
            ours[name] = torch.stack([torch.cat([get(f"{hf}.mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up")])
                                      for e in range(cfg.moe_num_experts)])
        elif key == _ROUTED[1]:
            ours[name] = torch.stack([get(f"{hf}.mlp.experts.{e}.down_proj.weight")
                                      for e in range(cfg.moe_num_experts)])
        else:
            raise ConfigError(f"tensor '{name}' has no DeepSeek-V3 name")
    return ours
