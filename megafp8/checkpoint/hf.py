"""Conversion between megafp8 model weights and Hugging Face safetensors: Llama layout for dense GQA models
(this module), DeepSeek-V3 layout for MLA / MoE / MTP models (`hf_deepseek.py`).

One table maps our parameter names onto the Llama names (`model.layers.N.self_attn.q_proj.weight`
...); our fused QKV and gate/up weights are split into Llama's separate projections on export and
fused again on import. RoPE uses the same "rotate half" layout as Hugging Face Llama, so no
permutation is needed. `fp8=True` stores every attention/MLP projection as E4M3 with 128x128
block scales under `<name>_scale_inv` (the DeepSeek-V3 layout: the FP32 multiplier that
dequantizes each block) and declares it in `config.json`'s `quantization_config`; embeddings,
norms and the LM head stay BF16.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from megafp8.checkpoint.hf_deepseek import check_exportable, deepseek_config, from_deepseek_tensors
from megafp8.checkpoint.hf_deepseek import model_config_of as deepseek_model_config
from megafp8.checkpoint.hf_deepseek import to_deepseek_tensors
from megafp8.config import ConfigError, ModelConfig
from megafp8.precision.formats import E4M3
from megafp8.precision.quantize import dequantize_128x128, quantize_128x128

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_PLAIN = {  # ours -> Hugging Face Llama, per layer ({i}) or global
    "embed.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.attn.out_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_FUSED = {  # ours -> the Llama tensors it is the row-wise concatenation of
    "layers.{i}.attn.qkv_proj.weight": ("model.layers.{i}.self_attn.q_proj.weight",
                                        "model.layers.{i}.self_attn.k_proj.weight",
                                        "model.layers.{i}.self_attn.v_proj.weight"),
    "layers.{i}.mlp.gate_up_proj.weight": ("model.layers.{i}.mlp.gate_proj.weight",
                                           "model.layers.{i}.mlp.up_proj.weight"),
}
_FP8_SUFFIXES = ("_proj.weight",)  # the GEMM weights FP8 export quantizes (never embeddings, norms, lm_head)


def _split_sizes(cfg: ModelConfig, ours: str) -> list[int]:
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    kv = cfg.num_kv_heads or cfg.num_heads
    if "qkv_proj" in ours:
        return [cfg.num_heads * head_dim, kv * head_dim, kv * head_dim]
    return [cfg.ffn_hidden_size, cfg.ffn_hidden_size]


def _templates(name: str) -> tuple[str, str | None]:
    """(template with {i}, layer index or None) of one of our names."""
    match = re.match(r"layers\.(\d+)\.(.*)", name)
    return (f"layers.{{i}}.{match.group(2)}", match.group(1)) if match else (name, None)


def hf_config(cfg: ModelConfig, max_seq_len: int, fp8: bool) -> dict[str, Any]:
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_heads
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads, "num_hidden_layers": cfg.num_layers,
        "head_dim": head_dim, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": max_seq_len, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    }
    if fp8:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return out


def to_hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig, fp8: bool) -> dict[str, torch.Tensor]:
    """Our state dict (by our names) -> Llama-named tensors (BF16, or E4M3 + `_scale_inv` for projections)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        template, layer = _templates(name)
        if template in _PLAIN:
            pieces = {_PLAIN[template]: tensor}
        elif template in _FUSED:
            parts = torch.split(tensor, _split_sizes(cfg, template), dim=0)
            pieces = dict(zip(_FUSED[template], parts))
        else:
            raise ConfigError(f"tensor '{name}' has no Hugging Face Llama name (not a megafp8 dense model?)")
        for hf_template, piece in pieces.items():
            hf_name = hf_template.format(i=layer)
            if fp8 and hf_name.endswith(_FP8_SUFFIXES):
                q, scale = quantize_128x128(piece.float(), E4M3)
                out[hf_name], out[hf_name + "_scale_inv"] = q, scale
            else:
                out[hf_name] = piece.to(torch.bfloat16).contiguous()
    return out


def _reader(tensors: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """A getter of Hugging Face tensors by name, in FP32 (E4M3 ones dequantized with their `_scale_inv` blocks)."""
    def get(hf_name: str) -> torch.Tensor:
        if hf_name not in tensors:
            raise ConfigError(f"tensor '{hf_name}' is missing from the Hugging Face checkpoint")
        value = tensors[hf_name]
        if value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = tensors.get(hf_name + "_scale_inv")
            if scale is None:
                raise ConfigError(f"FP8 tensor '{hf_name}' has no '{hf_name}_scale_inv' block scales")
            return dequantize_128x128(value, scale.float())
        return value.float()
    return get


def from_hf_tensors(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Llama-named tensors (BF16/FP32, or E4M3 with `_scale_inv`) -> our state dict, in FP32."""
    get = _reader(tensors)
    ours: dict[str, torch.Tensor] = {}
    layer_ids = [str(i) for i in range(num_layers)]
    for template, hf_template in _PLAIN.items():
        for layer in (layer_ids if "{i}" in template else [None]):
            ours[template.format(i=layer)] = get(hf_template.format(i=layer))
    for template, hf_templates in _FUSED.items():
        for layer in layer_ids:
            ours[template.format(i=layer)] = torch.cat([get(t.format(i=layer)) for t in hf_templates], dim=0)
    return ours


def is_deepseek_style(cfg: ModelConfig) -> bool:
    """MLA, MoE or MTP models convert in the DeepSeek-V3 layout; dense GQA models in Llama's."""
    return cfg.moe_num_experts > 0 or cfg.attention != "gqa" or cfg.mtp_depth > 0


def save_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, max_seq_len: int, out_dir: Path, fp8: bool) -> None:
    """Write config.json + model.safetensors: Llama layout for dense GQA models, DeepSeek-V3 layout for MLA/MoE/MTP
    ones (`state` then includes the routers' `expert_bias` buffers)."""
    from safetensors.torch import save_file

    if is_deepseek_style(cfg):
        check_exportable(cfg)
        tensors, config = to_deepseek_tensors(state, cfg, fp8), deepseek_config(cfg, max_seq_len, fp8)
    else:
        tensors, config = to_hf_tensors(state, cfg, fp8), hf_config(cfg, max_seq_len, fp8)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2))


def full_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter and persistent buffer of the model `cfg` describes, with its shape (built on the meta
    device)."""
    from megafp8.model import Transformer
    from megafp8.precision import PrecisionRecipe

    model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), 1, device=torch.device("meta"))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def load_hf(in_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Hugging Face directory (config.json + model.safetensors or a sharded index) in the Llama or DeepSeek-V3
    layout -> (our model config, state in FP32, the routers' `expert_bias` buffers included)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path = in_dir / CONFIG_FILE
    if not config_path.is_file():
        raise ConfigError(f"{config_path} not found: expected a Hugging Face model directory")
    hf = json.loads(config_path.read_text())
    index = in_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [WEIGHTS_FILE]
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(in_dir / file)))
        except (SafetensorError, OSError, ValueError) as err:
            raise ConfigError(f"{in_dir / file} is not a readable safetensors file ({err})") from None
    if hf.get("model_type") == "deepseek_v3":
        cfg = deepseek_model_config(hf)
        return cfg, from_deepseek_tensors(_reader(tensors), full_shapes(cfg), cfg)
    cfg = ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"], num_kv_heads=hf.get("num_key_value_heads"),
        head_dim=hf.get("head_dim"), ffn_hidden_size=hf["intermediate_size"], norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=hf.get("rope_theta", 10000.0),
    )
    return cfg, from_hf_tensors(tensors, cfg.num_layers)
