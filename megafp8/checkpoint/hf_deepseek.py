"""Conversion between megafp8 weights and Hugging Face safetensors in the DeepSeek-V2/V3 layout (MLA, MoE, MTP).

Names follow the published DeepSeek checkpoints (`model.layers.N.self_attn.kv_a_proj_with_mqa.weight`,
`model.layers.N.mlp.experts.E.gate_proj.weight`, `model.layers.N.mlp.gate.e_score_correction_bias`, ...),
which `transformers`' `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM` load. Three layouts differ from ours:

- rotary dims: DeepSeek stores each head's rotary query/key rows in interleaved pairs (V2 always, V3 with
  `rope_interleave`); ours are "rotate half" (pair i is rows i and i + d/2). Export interleaves, import undoes it.
- our stacked expert weights (experts, out, in) and fused gate/up rows split into one tensor per expert
  and projection.
- MTP module k (V3) is stored as layer `num_layers + k` with `enorm`, `hnorm`, `eh_proj` (whose input is
  [embedding; hidden], ours [hidden; embedding], so its column halves swap), `shared_head.norm`, and
  copies of the embedding and head (`embed_tokens`, `shared_head.head`), as DeepSeek-V3 ships them. A V3
  checkpoint without them (what `transformers` saves) imports without MTP.

DeepSeek-V2's router has no selection bias: ours is exported only when zero, and imported as zero.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megafp8.checkpoint.hf_tensors import HfTensors, check_no_selection_bias, emitter
from megafp8.config import ConfigError, ModelConfig

_ATTN = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
         "attn.q_a_proj.weight": "self_attn.q_a_proj.weight", "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
         "attn.q_b_proj.weight": "self_attn.q_b_proj.weight", "attn.q_proj.weight": "self_attn.q_proj.weight",
         "attn.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
         "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
         "attn.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
         "attn.out_proj.weight": "self_attn.o_proj.weight", "mlp.down_proj.weight": "mlp.down_proj.weight",
         "mlp.router.weight": "mlp.gate.weight", "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
         "mlp.shared.down_proj.weight": "mlp.shared_experts.down_proj.weight"}
_ROTARY = ("attn.q_b_proj.weight", "attn.q_proj.weight", "attn.kv_a_proj.weight")  # rows to (de)interleave
_BIAS = "mlp.router.expert_bias"
_GATE_UP = {"mlp.gate_up_proj.weight": "mlp", "mlp.shared.gate_up_proj.weight": "mlp.shared_experts"}
_MTP = {"embed_norm.weight": "enorm.weight", "hidden_norm.weight": "hnorm.weight",
        "combine_proj.weight": "eh_proj.weight", "out_norm.weight": "shared_head.norm.weight"}
_MTP_COPIES = {"embed.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}
_ROUTED = ("mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight")
_TOP = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}


def _rope_order(rope_dim: int) -> torch.Tensor:
    """Row order taking our rotate-half rotary rows to DeepSeek's interleaved pairs: new[2i] = old[i],
    new[2i + 1] = old[i + d/2]."""
    half = rope_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def _permute_rope(w: torch.Tensor, cfg: ModelConfig, name: str, inverse: bool) -> torch.Tensor:
    """Reorder the rotary rows of a query projection (each head's last rope rows) or of kv_a (its last rope rows)."""
    rope, nope = cfg.attention.qk_rope_head_dim, cfg.attention.qk_nope_head_dim
    order = _rope_order(rope)
    if inverse:
        order = torch.argsort(order)
    if name.endswith("kv_a_proj.weight"):
        return torch.cat([w[:-rope], w[-rope:][order]])
    heads = w.view(cfg.num_heads, nope + rope, -1)  # (heads, nope + rope, in)
    return torch.cat([heads[:, :nope], heads[:, nope:][:, order]], dim=1).reshape(w.shape)


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    half = w.shape[1] // 2
    return torch.cat([w[:, half:], w[:, :half]], dim=1)


def _block_mapping(hf: str, key: str, tensor: torch.Tensor, cfg: ModelConfig, layout: str,
                   emit: Callable[[str, torch.Tensor], None]) -> bool:
    """Emit the DeepSeek tensors of one block tensor (`key` is its name within the block); False if unknown."""
    if key in _ROTARY:
        emit(f"{hf}.{_ATTN[key]}", _permute_rope(tensor, cfg, key, inverse=False))
    elif key == _BIAS and layout == "deepseek_v2":
        check_no_selection_bias(f"{hf}.{key}", tensor, "DeepSeek-V2")
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


def to_deepseek_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, fp8: bool,
                        layout: str = "deepseek_v3") -> dict[str, torch.Tensor]:
    """Our full state dict (weights and the routers' `expert_bias`) -> DeepSeek-V2/V3-named tensors."""
    out: dict[str, torch.Tensor] = {}
    emit = emitter(out, fp8)
    for name, tensor in state.items():
        if name in _TOP:
            emit(_TOP[name], tensor)
            continue
        parts = name.split(".")
        if parts[0] == "layers":
            if _block_mapping(f"model.layers.{parts[1]}", ".".join(parts[2:]), tensor, cfg, layout, emit):
                continue
        elif parts[0] == "mtp":
            hf = f"model.layers.{cfg.num_layers + int(parts[1])}"
            key = ".".join(parts[2:])
            if key in _MTP:
                emit(f"{hf}.{_MTP[key]}", _swap_halves(tensor) if key == "combine_proj.weight" else tensor)
                continue
            if parts[2] == "block" and _block_mapping(hf, ".".join(parts[3:]), tensor, cfg, layout, emit):
                continue
        raise ConfigError(f"tensor '{name}' has no DeepSeek name")
    for k in range(cfg.mtp_depth):  # DeepSeek-V3 ships each MTP layer with its own embedding and head copies
        for ours, copy in _MTP_COPIES.items():
            emit(f"model.layers.{cfg.num_layers + k}.{copy}", state[ours])
    return out


def _from_block(get: HfTensors, hf: str, key: str, shape: tuple[int, ...], cfg: ModelConfig, layout: str,
                interleaved: bool) -> torch.Tensor:
    """Our block tensor `key` (within the block) from the DeepSeek tensors under `hf`."""
    if key in _ROTARY:
        w = get(f"{hf}.{_ATTN[key]}")
        # One of another shape cannot be permuted: it is returned as it is, for the caller's shape check to refuse.
        return _permute_rope(w, cfg, key, inverse=True) if interleaved and tuple(w.shape) == shape else w
    if key == _BIAS and layout == "deepseek_v2":
        return torch.zeros(shape)  # DeepSeek-V2 routes without one
    if key in _ATTN:
        return get(f"{hf}.{_ATTN[key]}")
    if key in _GATE_UP:
        return torch.cat([get(f"{hf}.{_GATE_UP[key]}.{p}_proj.weight") for p in ("gate", "up")])
    if key == _ROUTED[0]:
        return torch.stack([torch.cat([get(f"{hf}.mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up")])
                            for e in range(cfg.moe.num_experts)])
    if key == _ROUTED[1]:
        return torch.stack([get(f"{hf}.mlp.experts.{e}.down_proj.weight") for e in range(cfg.moe.num_experts)])
    raise ConfigError(f"tensor '{key}' has no DeepSeek name")


def from_deepseek_tensors(get: HfTensors, expected: dict[str, tuple[int, ...]], cfg: ModelConfig,
                          layout: str = "deepseek_v3", interleaved: bool = True) -> dict[str, torch.Tensor]:
    """DeepSeek-named tensors (read through `get`, dequantized) -> our state dict in FP32, for every name in
    `expected` (our model's names and full shapes). `interleaved`: the rotary rows are in DeepSeek's pairs."""
    ours: dict[str, torch.Tensor] = {}
    for name, shape in expected.items():
        parts = name.split(".")
        if name in _TOP:
            ours[name] = get.check_shape(name, get(_TOP[name]), shape)
            continue
        if parts[0] == "layers":
            hf, key = f"model.layers.{parts[1]}", ".".join(parts[2:])
        else:  # mtp.K.<...>
            hf, key = f"model.layers.{cfg.num_layers + int(parts[1])}", ".".join(parts[2:])
            if key in _MTP:
                t = get.check_shape(name, get(f"{hf}.{_MTP[key]}"), shape)
                ours[name] = _swap_halves(t) if key == "combine_proj.weight" else t
                continue
            key = key.removeprefix("block.")
        ours[name] = get.check_shape(name, _from_block(get, hf, key, shape, cfg, layout, interleaved), shape)
    return ours


def mtp_note(cfg: ModelConfig, get: HfTensors) -> Optional[str]:
    """The line to tell the user when a DeepSeek-V3 config declares MTP layers whose weights the checkpoint lacks
    (what `transformers` saves: it has no MTP modules); None when they are there (or none are declared)."""
    first = f"model.layers.{cfg.num_layers}."
    if cfg.mtp_depth == 0 or any(name.startswith(first) for name in get.tensors):
        return None
    return (f"num_nextn_predict_layers={cfg.mtp_depth} but the checkpoint has no MTP weights (layer {cfg.num_layers} "
            "on): imported with model.mtp_depth=0")


def check_mtp_copies(get: HfTensors, ours: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """DeepSeek-V3 stores each MTP layer's embedding and head as copies; ours are shared, so copies must be equal."""
    for k in range(cfg.mtp_depth):
        for name, copy in _MTP_COPIES.items():
            hf = f"model.layers.{cfg.num_layers + k}.{copy}"
            if hf in get and not torch.equal(get(hf), ours[name]):
                raise ConfigError(f"{hf} differs from the model's {name}: megafp8's MTP modules share the main "
                                  "embedding and head")
