"""The keys of one Hugging Face `config.json`, as the import (`hf_config.model_from_hf`) reads them: what transformers
(5.x) assumes for a key left out, what a JSON null means, the type a size must have, and the keys that do not change
the function a model computes (`INERT`). Every read marks its key used, and `ConfigKeys.finish` refuses a key that
no reader took; every refusal is one line naming the key and the file.
"""
from __future__ import annotations

from typing import Any

from megafp8.config import ConfigError

# Keys that do not change the function a model computes (or only its training, whose settings megafp8's config owns).
INERT = frozenset({
    "_name_or_path", "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
    "max_position_embeddings", "pretraining_tp", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "aux_loss_alpha", "seq_aux", "ep_size", "tokenizer_class",
})
# What transformers (5.x) assumes for a key a config leaves out, where that matters.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "mistral": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 32},
    "qwen3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 32, "head_dim": 128},
    # Qwen3-MoE's config has no head_dim of its own (Qwen3's 128 is not inherited): left out, hidden / heads.
    "qwen3_moe": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 4, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8, "num_experts_per_tok": 2,
                "num_local_experts": 8},
    "deepseek_v2": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
                    "n_shared_experts": 2, "first_k_dense_replace": 0, "moe_intermediate_size": 1407,
                    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "topk_method": "greedy"},
    "deepseek_v3": {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
                    "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_intermediate_size": 2048,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 8, "topk_group": 4,
                    "num_experts_per_tok": 8, "rope_interleave": True},
}
# Keys whose value is a count or a width: JSON integers only (a string or 256.0 is a broken config.json, refused by
# name rather than failing later in arithmetic or a tensor's shape).
_INTEGER_KEYS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "num_key_value_heads",
    "head_dim", "num_local_experts", "num_experts", "num_experts_per_tok", "decoder_sparse_step",
    "first_k_dense_replace", "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
    "num_nextn_predict_layers", "num_mtp_layers", "max_position_embeddings", "sliding_window",
})
_NUMBER_KEYS = frozenset({"rms_norm_eps", "rope_theta", "routed_scaling_factor"})
# A numeric key that is JSON null is refused where a reader needs its value: transformers 5.25 refuses each such null
# too (its config classes type them `int`), or builds a model that fails on it (a null rope_theta, first_k_dense_replace
# or n_group). A reader that takes a key with a default of its own gives null a meaning, as transformers does: no
# sliding window, no query LoRA (DeepSeek-V2-Lite's q_lora_rank), no shared experts (as DeepSeek's own code reads a
# null n_shared_experts), a dense DeepSeek's unread MoE sizes, a V2's groups. These keys have such a meaning only for
# the model types listed, whose transformers config fills the null in (its post-init), or whose model reads it so:
# head_dim null is hidden / heads, num_key_value_heads null the number of heads (then checked against the weights'
# shapes), and MLA reads neither. Each was checked by building the transformers model with the null.
_NULL_READ_BY: dict[str, frozenset[str]] = {
    "head_dim": frozenset({"llama", "mistral", "mixtral", "deepseek_v2", "deepseek_v3"}),
    "num_key_value_heads": frozenset({"llama", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3"}),
    "num_experts": frozenset(), "num_local_experts": frozenset(),  # Qwen3-MoE's expert count (either name)
}
_MISSING = object()


class ConfigKeys:
    """The keys of one config.json (`source`, the file named in every refusal), each marked used when read."""

    def __init__(self, hf: dict[str, Any], model_type: str, source: str = "config.json") -> None:
        self.hf, self.model_type, self.source, self.used = hf, model_type, source, set(INERT)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The key's value (null where it means something: `_NULL_READ_BY`), else transformers' default for this model
        type, else `default`; a key without either is required, and must not be null."""
        self.used.add(key)
        if self.hf.get(key, _MISSING) is None and self._null_refused(key, default):
            raise ConfigError(f"{self.source}: {key} is null, which a {self.model_type} config gives no value "
                              f"(transformers refuses it, or its model fails on it): write the {key} the model has")
        default = DEFAULTS[self.model_type].get(key, default)
        value = self.hf.get(key, default)
        if value is _MISSING or (value is None and default is _MISSING):
            raise ConfigError(f"{self.source} ({self.model_type}) has no '{key}'")
        self._check_type(key, value)
        return value

    def _null_refused(self, key: str, default: Any) -> bool:
        """Whether a null `key`, read with `default`, has no meaning here (see `_NULL_READ_BY`)."""
        if key not in _INTEGER_KEYS and key not in _NUMBER_KEYS:
            return False
        readers = _NULL_READ_BY.get(key)
        return default is _MISSING or (readers is not None and self.model_type not in readers)

    def expect(self, key: str, allowed: tuple, why: str) -> Any:
        """The key's value, refused unless it is one of `allowed` (absent counts as transformers' default)."""
        value = self.get(key, None if None in allowed else _MISSING)
        if value not in allowed:
            raise ConfigError(f"{self.source}: {key}={value!r} is not supported ({why})")
        return value

    def finish(self) -> None:
        unknown = [k for k in self.hf if k not in self.used]
        if unknown:
            raise ConfigError(f"{self.source}: {unknown[0]}={self.hf[unknown[0]]!r} is a {self.model_type} setting "
                              "megafp8's converter does not know; it stops rather than guess whether it changes "
                              "the model")

    def _check_type(self, key: str, value: Any) -> None:
        if value is None or (key not in _INTEGER_KEYS and key not in _NUMBER_KEYS):
            return
        if isinstance(value, bool):  # JSON true is a Python int
            raise ConfigError(f"{self.source}: {key} must be a number, got {value!r}")
        if key in _INTEGER_KEYS and not isinstance(value, int):
            as_int = int(value) if isinstance(value, float) and value.is_integer() else "one"
            raise ConfigError(f"{self.source}: {key} must be an integer, got {value!r} ({type(value).__name__}): "
                              f"write it as {as_int}")
        if not isinstance(value, (int, float)):
            raise ConfigError(f"{self.source}: {key} must be a number, got {value!r} ({type(value).__name__})")
