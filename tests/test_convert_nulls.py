"""config.json values that are JSON null: read as transformers (5.x) reads them where it gives the null a meaning (a
null head_dim is hidden / heads, a null num_key_value_heads the number of heads, a null rope_theta beside
rope_parameters the one there), and refused in one line naming the key and the file where it gives none (its config
class refuses the null, or its model fails on it). Before, most of these ended `from-hf` in a TypeError traceback."""
from __future__ import annotations

import dataclasses

import pytest

from megafp8.config import ConfigError, GqaConfig

pytest.importorskip("safetensors")
from megafp8.checkpoint.hf import load_hf  # noqa: E402
from tests.test_convert import CFG, DEEPSEEK, V2, _edited, _exported, with_moe  # noqa: E402

QWEN3 = dataclasses.replace(CFG, attention=dataclasses.replace(CFG.attention, qk_norm=True))
SOFTMAX_MOE = dict(num_experts=4, top_k=2, ffn_hidden_size=128, num_shared_experts=0, score_func="softmax",
                   bias_update_rate=0.0, n_group=1, topk_group=1, routed_scaling_factor=1.0)
LAYOUTS = {"llama": CFG, "mha": dataclasses.replace(CFG, attention=GqaConfig()), "qwen3": QWEN3,
           "qwen3_moe": with_moe(QWEN3, first_dense_layers=1, **SOFTMAX_MOE),
           "mixtral": with_moe(CFG, first_dense_layers=0, norm_topk_prob=True, **SOFTMAX_MOE),
           "deepseek_v2": V2, "deepseek_v3": DEEPSEEK}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{name: a Hugging Face directory of that model}, exported once (tests edit copies of its config.json)."""
    base = tmp_path_factory.mktemp("nulls")
    for name, cfg in LAYOUTS.items():
        _exported(cfg, base / name)
    return {name: base / name for name in LAYOUTS}


READ = [  # (model, the nulls, what the import reads them as)
    ("llama", dict(head_dim=None), lambda cfg: cfg.attention.head_dim_for(cfg.hidden_size, cfg.num_heads) == 64),
    ("mixtral", dict(head_dim=None), lambda cfg: cfg.attention.head_dim_for(cfg.hidden_size, cfg.num_heads) == 64),
    ("mha", dict(num_key_value_heads=None), lambda cfg: cfg.attention.kv_heads_for(cfg.num_heads) == 4),
    ("llama", dict(rope_theta=None), lambda cfg: cfg.rope_theta == 10000.0),  # the one rope_parameters gives
    ("deepseek_v3", dict(head_dim=None, num_key_value_heads=None), lambda cfg: cfg.attention.kind == "mla"),
    ("deepseek_v2", dict(n_group=None, topk_group=None), lambda cfg: cfg.moe.n_group == 1),  # no groups
]


@pytest.mark.parametrize("name, nulls, read", READ, ids=[f"{n}-{'-'.join(k)}" for n, k, _ in READ])
def test_a_null_that_transformers_reads_as_a_value_imports_as_it_reads_it(tmp_path, exported, name, nulls, read):
    imported = load_hf(_edited(exported[name], tmp_path / "hf", nulls))
    assert read(imported.cfg)


REFUSED = [  # (model, the key made null); transformers 5.25 refuses each, or builds a model that fails on it
    ("llama", "intermediate_size"), ("llama", "rms_norm_eps"), ("llama", "vocab_size"),
    ("qwen3", "head_dim"),  # Qwen3's default is 128, not hidden / heads: a null one is no default
    ("qwen3_moe", "moe_intermediate_size"), ("qwen3_moe", "num_experts_per_tok"), ("qwen3_moe", "num_experts"),
    ("qwen3_moe", "num_key_value_heads"), ("mixtral", "num_local_experts"), ("mixtral", "num_key_value_heads"),
    ("deepseek_v2", "n_routed_experts"), ("deepseek_v2", "v_head_dim"), ("deepseek_v2", "rms_norm_eps"),
    ("deepseek_v3", "moe_intermediate_size"), ("deepseek_v3", "first_k_dense_replace"),
    ("deepseek_v3", "kv_lora_rank"), ("deepseek_v3", "routed_scaling_factor"), ("deepseek_v3", "n_group"),
]


@pytest.mark.parametrize("name, key", REFUSED, ids=[f"{n}-{k}" for n, k in REFUSED])
def test_a_null_that_transformers_gives_no_value_is_refused_naming_the_key_and_the_file(tmp_path, exported, name,
                                                                                        key):
    hf = _edited(exported[name], tmp_path / "hf", {key: None})
    with pytest.raises(ConfigError) as err:
        load_hf(hf)
    assert str(err.value).startswith(f"{hf / 'config.json'}: {key} is null, ") and "\n" not in str(err.value)


def test_a_null_rope_theta_with_no_rope_parameters_to_give_one_is_refused(tmp_path, exported):
    """transformers puts the null into its RoPE parameters, and its model fails on it."""
    hf = _edited(exported["llama"], tmp_path / "hf", dict(rope_theta=None, rope_parameters=None, rope_scaling=None))
    with pytest.raises(ConfigError, match=f"^{hf / 'config.json'}: rope_theta is null, and no rope_parameters"):
        load_hf(hf)


def test_deepseek_n_shared_experts_null_means_none(tmp_path):
    """DeepSeek's own modeling code reads a null `n_shared_experts` as no shared experts; before, a TypeError."""
    _exported(with_moe(DEEPSEEK, num_shared_experts=0), tmp_path / "hf")
    imported = load_hf(_edited(tmp_path / "hf", tmp_path / "null", dict(n_shared_experts=None)))
    assert imported.cfg.moe.num_shared_experts == 0
