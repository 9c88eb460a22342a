"""Hugging Face `config.json` <-> our `ModelConfig`, for the architectures megafp8 can compute exactly.

Import reads every key of the file: what changes the model's function is converted (sizes, RoPE base and scaling,
norm epsilon, routing), what does not is listed in `hf_keys.INERT` (token ids, initialization, dropout, training-only
balancing settings), and anything else, or a value megafp8 cannot represent (biases, a sliding window, another
activation, another routing rule), is refused with one line naming the key and its value. Nothing is dropped silently.

| model_type | megafp8 model |
|---|---|
| llama, mistral | GQA, dense SwiGLU |
| qwen2 | GQA with a bias on the query, key and value projections (`model.attention.qkv_bias`), dense SwiGLU |
| qwen3 | GQA with per-head query/key RMSNorm (`model.attention.qk_norm`), dense SwiGLU |
| qwen3_moe | Qwen3's attention, MoE: softmax top-k over all experts (renormalized or not), no shared expert |
| mixtral | GQA, MoE: softmax top-k over all experts, renormalized, no shared expert |
| deepseek_v2 | MLA, MoE: softmax greedy top-k, weights not renormalized, shared experts |
| deepseek_v3 | MLA, MoE: sigmoid, group-limited top-k with selection bias, shared experts, MTP |

Export writes the layout a config converts to (`export_layout`), or refuses the setting that has none. The RoPE
settings go both into `rope_parameters` (transformers >= 5) and `rope_theta` / `rope_scaling` (earlier versions).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import typing
from typing import Any, Callable, Literal, Optional

from megafp8.checkpoint.hf_keys import ConfigKeys
from megafp8.config import (
    AttentionConfig, Config, ConfigError, ModelConfig, MoeConfig, RopeScalingConfig, validate_config,
)

HfLayout = Literal["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"]
_REFUSED_TYPES = {
    "qwen2_moe": "its shared expert is gated (shared_expert_gate), which megafp8's shared experts are not",
}
QWEN3_MOE_EXPERTS = 128  # Qwen3-MoE's expert count where config.json names none (its two names are read apart)
MLA_NORM_EPS = 1e-6  # DeepSeek's attention normalizes its compressed q and kv with this, whatever rms_norm_eps says


@dataclass
class HfModel:
    """What a config.json says, in our terms."""

    cfg: ModelConfig
    layout: HfLayout
    rope_interleave: bool = False  # DeepSeek: rotary rows stored in interleaved pairs
    tied: bool = False  # the head is the embedding
    notes: list[str] = field(default_factory=list)  # one line each, for the user


# ------------------------------------------------------------------------------------------------- RoPE
_ROPE_KEYS = {"default": set(), "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                         "mscale", "mscale_all_dim", "attention_factor", "truncate"},
              "llama3": {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}}


def _rope_parameters(keys: ConfigKeys) -> dict[str, Any]:
    """The RoPE dict transformers 5 would use: `rope_scaling` (older files) if set, else `rope_parameters`."""
    old, new = keys.get("rope_scaling", None), keys.get("rope_parameters", None)
    if old and "type" in old and "rope_type" not in old:  # the older spelling of rope_type (transformers reads both)
        old = {("rope_type" if k == "type" else k): v for k, v in old.items()}
    if old and new and any(new.get(k) != v for k, v in old.items()):
        raise ConfigError(f"config.json: rope_scaling={old} and rope_parameters={new} disagree; keep one")
    params = dict(old or new or {})
    theta = keys.get("rope_theta", None)  # null: the one the RoPE parameters give, as transformers reads it
    given = theta is not None and "rope_theta" in keys.hf
    if given and params.get("rope_theta", theta) != theta:  # transformers 4 and 5 read other ones
        raise ConfigError(f"config.json: rope_theta={theta} and {'rope_scaling' if old else 'rope_parameters'}."
                          f"rope_theta={params['rope_theta']} disagree; keep one")
    params.setdefault("rope_theta", theta)
    if params["rope_theta"] is None:  # transformers' model fails on it
        raise ConfigError(f"{keys.source}: rope_theta is null, and no rope_parameters (or rope_scaling) give one: "
                          "write the RoPE base the model was trained with")
    if keys.get("partial_rotary_factor", params.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("config.json: partial_rotary_factor != 1 is not supported (megafp8 rotates whole heads)")
    return params


def rope_from_hf(keys: ConfigKeys) -> tuple[float, RopeScalingConfig]:
    """(rope_theta, scaling) from rope_parameters / rope_scaling / rope_theta, refusing what megafp8 lacks."""
    params = _rope_parameters(keys)
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in _ROPE_KEYS:
        raise ConfigError(f"config.json: rope_type={kind!r} is not supported (megafp8 has default, yarn and llama3)")
    theta = float(params.pop("rope_theta"))
    unknown = sorted(set(params) - _ROPE_KEYS[kind])
    if unknown:
        raise ConfigError(f"config.json: rope_parameters.{unknown[0]}={params[unknown[0]]!r} is not a {kind} RoPE "
                          "setting megafp8 has")
    if kind == "default":
        return theta, RopeScalingConfig()
    # As transformers: the original length defaults to max_position_embeddings, YaRN's factor to their ratio.
    original = int(params.get("original_max_position_embeddings") or keys.get("max_position_embeddings"))
    factor = float(params.get("factor") or keys.get("max_position_embeddings") / original)
    if kind == "llama3":
        return theta, RopeScalingConfig(type=kind, factor=factor, original_max_position_embeddings=original,
                                        low_freq_factor=float(_rope_value(params, "low_freq_factor")),
                                        high_freq_factor=float(_rope_value(params, "high_freq_factor")))
    if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise ConfigError("config.json: rope_parameters.attention_factor / truncate=false are not supported (megafp8's "
                          "YaRN derives the attention factor from mscale and truncates the ramp, as DeepSeek)")
    return theta, RopeScalingConfig(
        type=kind, factor=factor, original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0))


def _rope_value(params: dict[str, Any], key: str) -> Any:
    if params.get(key) is None:
        raise ConfigError(f"config.json: the RoPE parameters have no '{key}'")
    return params[key]


def rope_to_hf(theta: float, scaling: RopeScalingConfig) -> dict[str, Any]:
    """config.json's RoPE keys for transformers >= 5 (`rope_parameters`) and earlier (`rope_theta`, `rope_scaling`)."""
    if scaling.type == "none":
        return {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                "rope_scaling": None}
    names = ["factor", "original_max_position_embeddings"] + (["beta_fast", "beta_slow", "mscale", "mscale_all_dim"]
                                                              if scaling.type == "yarn" else
                                                              ["low_freq_factor", "high_freq_factor"])
    values = {name: getattr(scaling, name) for name in names if getattr(scaling, name) != 0}
    return {"rope_theta": theta, "rope_parameters": {"rope_type": scaling.type, "rope_theta": theta, **values},
            "rope_scaling": {"rope_type": scaling.type, **values}}


# ------------------------------------------------------------------------------------------------- import
def _common(keys: ConfigKeys) -> dict[str, Any]:
    """ModelConfig fields every supported type has (sections as dicts); refuses another activation and biases."""
    keys.expect("hidden_act", ("silu", None), "megafp8's MLPs are SwiGLU")
    for key in ("attention_bias", "mlp_bias"):
        keys.expect(key, (False, None), "megafp8's linears have no biases")
    theta, scaling = rope_from_hf(keys)
    return dict(vocab_size=keys.get("vocab_size"), hidden_size=keys.get("hidden_size"),
                num_layers=keys.get("num_hidden_layers"), num_heads=keys.get("num_attention_heads"),
                ffn_hidden_size=keys.get("intermediate_size"), norm_eps=float(keys.get("rms_norm_eps")),
                rope_theta=theta, rope_scaling=scaling)


def _gqa(keys: ConfigKeys, window_off: bool = False) -> dict[str, Any]:
    """Llama / Mistral / Mixtral / Qwen3 attention. `window_off`: the layout turns its sliding window off by a key
    of its own (Qwen3's `use_sliding_window`), so `sliding_window` says nothing."""
    if not window_off:
        keys.expect("sliding_window", (None,), "megafp8 attends to the whole causal context")
    return dict(_common(keys), attention=dict(kind="gqa", num_kv_heads=keys.get("num_key_value_heads", None),
                                              head_dim=keys.get("head_dim", None)))


def _qwen_window_off(keys: ConfigKeys) -> None:
    """Qwen2's and Qwen3's sliding window, which must be off (its settings then unread by transformers too)."""
    keys.expect("use_sliding_window", (False, None), "megafp8 attends to the whole causal context")
    for inert in ("sliding_window", "max_window_layers"):  # unread by transformers with the window off
        keys.get(inert, None)
    kinds = keys.get("layer_types", None)
    if kinds is not None and any(kind != "full_attention" for kind in kinds):
        raise ConfigError(f"config.json: layer_types holds {sorted(set(kinds) - {'full_attention'})[0]!r}: megafp8's "
                          "layers all attend to the whole causal context (full_attention)")


def _qwen2(keys: ConfigKeys) -> dict[str, Any]:
    """Qwen2 / Qwen2.5 dense: Llama's attention with a bias on the q, k and v projections, the window off."""
    _qwen_window_off(keys)
    fields = _gqa(keys, window_off=True)
    fields["attention"]["qkv_bias"] = True
    return fields


def _qwen3(keys: ConfigKeys) -> dict[str, Any]:
    """Qwen3 dense: Llama's attention with RMSNorm over each query and key head, the window off."""
    _qwen_window_off(keys)
    fields = _gqa(keys, window_off=True)
    fields["attention"]["qk_norm"] = True
    return fields


def _qwen3_moe(keys: ConfigKeys) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention; softmax over every expert, top-k, renormalized where `norm_topk_prob`; no shared
    expert; the layers `mlp_only_layers` names dense (`intermediate_size` wide), which must be the first ones."""
    keys.expect("decoder_sparse_step", (1,), "megafp8's MoE layers are every layer after the leading dense ones")
    fields = _qwen3(keys)
    dense = keys.get("mlp_only_layers", None) or []
    if sorted(dense) != list(range(len(dense))):
        raise ConfigError(f"config.json: mlp_only_layers={dense} is not supported (megafp8's dense layers are the "
                          "first ones: [0, 1, ..., k-1])")
    named = {key: keys.get(key, None) for key in ("num_experts", "num_local_experts")}  # transformers reads both
    given = {value for value in named.values() if value is not None}
    if len(given) > 1:
        raise ConfigError(f"config.json: num_experts={named['num_experts']} and num_local_experts="
                          f"{named['num_local_experts']} disagree; keep one")
    experts = given.pop() if given else QWEN3_MOE_EXPERTS  # transformers' default for neither
    fields["moe"] = dict(num_experts=experts, top_k=keys.get("num_experts_per_tok"),
                         ffn_hidden_size=keys.get("moe_intermediate_size"), num_shared_experts=0,
                         first_dense_layers=len(dense), score_func="softmax",
                         norm_topk_prob=bool(keys.get("norm_topk_prob")), bias_update_rate=0.0)
    return fields


def _mixtral(keys: ConfigKeys) -> dict[str, Any]:
    return dict(_gqa(keys), moe=dict(num_experts=keys.get("num_local_experts"), top_k=keys.get("num_experts_per_tok"),
                                     ffn_hidden_size=keys.get("intermediate_size"), num_shared_experts=0,
                                     first_dense_layers=0, score_func="softmax", norm_topk_prob=True,
                                     bias_update_rate=0.0))


def _mla(keys: ConfigKeys) -> dict[str, Any]:
    """DeepSeek-V2/V3 attention and the MoE sizes they share."""
    keys.expect("rms_norm_eps", (MLA_NORM_EPS,), "DeepSeek's attention normalizes q and kv with eps 1e-6, megafp8 "
                "uses model.norm_eps for every norm")
    keys.expect("moe_layer_freq", (1, None), "megafp8's MoE layers are every layer after first_k_dense_replace")
    for derived in ("num_key_value_heads", "head_dim", "qk_head_dim"):  # MLA ignores them (transformers too)
        keys.get(derived, None)
    dense = keys.get("first_k_dense_replace")
    moe = dense < keys.get("num_hidden_layers")  # a dense model reads the MoE keys too, and ignores them
    experts, top_k, width = (keys.get(k) if moe else keys.get(k, None) for k in (
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"))
    shared = keys.get("n_shared_experts", None)  # null: none, as DeepSeek's own modeling code reads it
    fields = dict(_common(keys), attention=dict(  # a null q_lora_rank: no query compression (DeepSeek-V2-Lite)
        kind="mla", q_lora_rank=keys.get("q_lora_rank", None), kv_lora_rank=keys.get("kv_lora_rank"),
        qk_nope_head_dim=keys.get("qk_nope_head_dim"), qk_rope_head_dim=keys.get("qk_rope_head_dim"),
        v_head_dim=keys.get("v_head_dim")), moe=dict(routed_scaling_factor=float(keys.get("routed_scaling_factor"))))
    if moe:
        fields["moe"].update(num_experts=experts, top_k=top_k, ffn_hidden_size=width, num_shared_experts=shared or 0,
                             first_dense_layers=dense)
    return fields


def _deepseek_v2(keys: ConfigKeys) -> dict[str, Any]:
    keys.expect("scoring_func", ("softmax", None), "DeepSeek-V2 routes by softmax")
    keys.expect("norm_topk_prob", (False, None), "transformers' DeepSeek-V2 ignores it, DeepSeek's own code "
                "renormalizes: the two disagree")
    method = keys.expect("topk_method", ("greedy", "group_limited_greedy"), "megafp8 routes V2 greedily")
    groups = (keys.get("n_group", None), keys.get("topk_group", None))
    if method == "group_limited_greedy" and groups[0] not in (None, 1):
        raise ConfigError(f"config.json: topk_method=group_limited_greedy with n_group={groups[0]} is not supported "
                          "(it scores a group by its best expert, megafp8 by its two best)")
    keys.expect("num_nextn_predict_layers", (0, None), "DeepSeek-V2 has no multi-token prediction")
    fields = _mla(keys)
    fields["moe"].update(score_func="softmax", norm_topk_prob=False, bias_update_rate=0.0)
    return fields


def _deepseek_v3(keys: ConfigKeys) -> dict[str, Any]:
    keys.expect("scoring_func", ("sigmoid", None), "DeepSeek-V3 routes by sigmoid")
    keys.expect("topk_method", ("noaux_tc", None), "DeepSeek-V3 routes group-limited with a selection bias")
    depth, alias = keys.get("num_nextn_predict_layers", None), keys.get("num_mtp_layers", None)
    fields = _mla(keys)
    moe = fields["moe"].get("num_experts", 0) > 0
    groups = [keys.get(k) if moe else keys.get(k, None) for k in ("n_group", "topk_group")]  # a dense model's: unread
    fields["moe"].update(score_func="sigmoid", norm_topk_prob=bool(keys.get("norm_topk_prob")),
                         n_group=groups[0] if moe else 1, topk_group=groups[1] if moe else 1)
    fields["mtp_depth"] = next((d for d in (depth, alias) if d is not None), 1)  # transformers' default: 1
    return fields


_READERS: dict[str, Callable[[ConfigKeys], dict[str, Any]]] = {
    "llama": _gqa, "mistral": _gqa, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral,
    "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3}


def _check_quantization(keys: ConfigKeys) -> None:
    quant = keys.get("quantization_config", None)
    if quant is None:
        return
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method != "fp8" or list(block or []) != [128, 128] or quant.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config.json: quantization_config (quant_method={method!r}, weight_block_size={block!r}) "
                          "is not supported (megafp8 reads E4M3 weights with 128x128 block scales)")


def model_from_hf(hf: dict[str, Any], source: str = "config.json") -> HfModel:
    """Our model config (and the layout's facts) from a config.json (the file `source`), or one ConfigError naming the
    key that has no exact megafp8 equivalent."""
    model_type = hf.get("model_type")
    if model_type in _REFUSED_TYPES:
        raise ConfigError(f"config.json: model_type={model_type!r} is not supported: {_REFUSED_TYPES[model_type]}")
    if model_type not in _READERS:
        raise ConfigError(f"config.json: model_type={model_type!r} is not supported (megafp8 imports "
                          f"{', '.join(typing.get_args(HfLayout))})")
    keys = ConfigKeys(hf, model_type, source)
    fields = _READERS[model_type](keys)
    interleave = model_type == "deepseek_v2" or (model_type == "deepseek_v3" and keys.get("rope_interleave"))
    tied = bool(keys.get("tie_word_embeddings", False))
    _check_quantization(keys)
    keys.finish()
    attention, moe = fields.pop("attention"), fields.pop("moe", {})
    cfg = ModelConfig(**fields, attention=AttentionConfig.kinds()[attention.pop("kind")](**attention),
                      moe=MoeConfig(**moe))
    try:
        validate_config(Config(model=cfg))
    except ConfigError as err:
        raise ConfigError(f"config.json describes a model megafp8 refuses: {err}") from None
    notes = ["tie_word_embeddings=true: lm_head starts as a copy of the embedding and trains on its own (megafp8's "
             "head is untied)"] if tied else []
    return HfModel(cfg, model_type, bool(interleave), tied, notes)


# ------------------------------------------------------------------------------------------------- export
_MIXTRAL_NEEDS = {"moe.score_func": "softmax", "moe.norm_topk_prob": True, "moe.num_shared_experts": 0,
                  "moe.first_dense_layers": 0, "moe.n_group": 1, "moe.routed_scaling_factor": 1.0}
_V2_NEEDS = {"moe.norm_topk_prob": False, "moe.n_group": 1, "mtp_depth": 0}
_QWEN3_MOE_NEEDS = {"moe.score_func": "softmax", "moe.num_shared_experts": 0, "moe.n_group": 1,
                    "moe.routed_scaling_factor": 1.0}


def _require(cfg: ModelConfig, needs: dict[str, Any], layout: str) -> None:
    """A ConfigError naming every setting of `cfg` that `layout` cannot hold (all at once: one at a time, a model
    trained with model.moe's defaults took a retraining per setting to learn what Mixtral needs), with the
    settings to train with."""
    wrong: dict[str, tuple[Any, Any]] = {}
    for key, value in needs.items():
        setting = cfg
        for part in key.split("."):
            setting = getattr(setting, part)
        if setting != value:
            wrong[f"model.{key}"] = (setting, value)
    if not wrong:
        return

    def listed(items: list[str]) -> str:
        return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]

    has = listed([f"{key}={setting!r}" for key, (setting, _) in wrong.items()])
    verb = "has" if len(wrong) == 1 else "have"
    fix = " ".join(f"{key}={value}" for key, (_, value) in wrong.items())
    if layout in ("Mixtral", "Qwen3-MoE") and cfg.moe.bias_update_rate > 0:
        fix += f" model.moe.bias_update_rate=0 ({layout} has no selection bias)"
    raise ConfigError(f"{has} {verb} no place in the {layout} layout this model converts to (it needs "
                      f"{listed([repr(value) for _, value in wrong.values()])}): train it with {fix}")


def export_layout(cfg: ModelConfig) -> HfLayout:
    """The Hugging Face model type `cfg` converts to exactly, or a ConfigError naming the setting that has none."""
    if cfg.attention.kind == "gqa":
        if cfg.mtp_depth:
            raise ConfigError(f"model.mtp_depth={cfg.mtp_depth}: only the DeepSeek-V3 layout "
                              "(model.attention.kind=mla) holds MTP modules")
        if cfg.attention.qkv_bias:
            if cfg.attention.qk_norm or cfg.moe.enabled:
                raise ConfigError("model.attention.qkv_bias=true exports as Qwen2, a dense layout without query/key "
                                  "norms: train such a model without model.attention.qk_norm and model.moe")
            return "qwen2"
        if cfg.attention.qk_norm:
            if not cfg.moe.enabled:
                return "qwen3"
            _require(cfg, _QWEN3_MOE_NEEDS, "Qwen3-MoE")
            return "qwen3_moe"
        if not cfg.moe.enabled:
            return "llama"
        _require(cfg, _MIXTRAL_NEEDS, "Mixtral")
        return "mixtral"
    if cfg.norm_eps != MLA_NORM_EPS:
        raise ConfigError(f"model.norm_eps={cfg.norm_eps}: DeepSeek's layout normalizes MLA's q and kv with eps 1e-6, "
                          "so an MLA model converts only with model.norm_eps=1e-6")
    if cfg.moe.enabled and cfg.moe.score_func == "softmax":
        _require(cfg, _V2_NEEDS, "DeepSeek-V2")
        return "deepseek_v2"
    return "deepseek_v3"


def _gqa_config(cfg: ModelConfig) -> dict[str, Any]:
    gqa = cfg.attention
    return {"num_key_value_heads": gqa.kv_heads_for(cfg.num_heads),
            "head_dim": gqa.head_dim_for(cfg.hidden_size, cfg.num_heads), "mlp_bias": False}


def _qwen_config(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen2's and Qwen3's config.json keys beyond Llama's: the sliding window off."""
    return {**_gqa_config(cfg), "use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * cfg.num_layers}


def _qwen3_moe_config(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    return {**_qwen_config(cfg), "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.ffn_hidden_size, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": list(range(moe.first_dense_layers))}


def _mixtral_config(cfg: ModelConfig) -> dict[str, Any]:
    return {**_gqa_config(cfg), "intermediate_size": cfg.moe.ffn_hidden_size, "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.top_k, "sliding_window": None}


def _deepseek_config(cfg: ModelConfig, layout: HfLayout) -> dict[str, Any]:
    mla, moe = cfg.attention, cfg.moe
    out = {"moe_intermediate_size": moe.ffn_hidden_size, "n_shared_experts": moe.num_shared_experts,
           "n_routed_experts": moe.num_experts if moe.enabled else 1,
           "routed_scaling_factor": moe.routed_scaling_factor,
           "kv_lora_rank": mla.kv_lora_rank, "q_lora_rank": mla.q_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim,
           "qk_nope_head_dim": mla.qk_nope_head_dim, "v_head_dim": mla.v_head_dim, "num_experts_per_tok": moe.top_k,
           # A dense model's layers past its main ones (the MTP modules, layer num_layers on) are dense too: at
           # num_layers, DeepSeek's code (as vLLM's) built its MTP layer as MoE, which megafp8's dense one is not
           "first_k_dense_replace": moe.first_dense_layers if moe.enabled else cfg.num_layers + cfg.mtp_depth,
           "norm_topk_prob": moe.norm_topk_prob, "num_key_value_heads": cfg.num_heads}
    if layout == "deepseek_v2":
        return {**out, "scoring_func": "softmax", "topk_method": "greedy", "mlp_bias": False}
    return {**out, "num_nextn_predict_layers": cfg.mtp_depth, "n_group": moe.n_group,
            "topk_group": moe.topk_group, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "rope_interleave": True}


_GQA_CONFIGS: dict[str, Callable[[ModelConfig], dict[str, Any]]] = {  # config.json keys beyond the common ones
    "llama": _gqa_config, "mistral": _gqa_config, "qwen2": _qwen_config, "qwen3": _qwen_config,
    "qwen3_moe": _qwen3_moe_config, "mixtral": _mixtral_config}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                  "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def hf_config(cfg: ModelConfig, layout: HfLayout, max_seq_len: int, fp8: bool,
              token_ids: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The config.json of `cfg` in `layout` (from `export_layout`). The token ids are always written, from
    `token_ids`, `null` where it lacks one: left out, transformers assumes its model type's defaults (Llama's bos 1
    and eos 2, DeepSeek's 0 and 1), ids that are ordinary tokens of another tokenizer, and generation stops at
    them."""
    specific = (_GQA_CONFIGS[layout](cfg) if layout in _GQA_CONFIGS else _deepseek_config(cfg, layout))
    out = {"architectures": [_ARCHITECTURES[layout]], "model_type": layout, "vocab_size": cfg.vocab_size,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads, "rms_norm_eps": cfg.norm_eps,
           "max_position_embeddings": max_seq_len, "hidden_act": "silu", "attention_bias": False,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", **rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **(token_ids or {}), **specific}
    if fp8:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return out

