"""Hugging Face safetensors export/import (Llama and DeepSeek layouts), FP8 export, config values and tensors that
have no exact megafp8 equivalent, bad files, and the conversion tool. Comparisons with `transformers` itself are in
tests/test_hf_transformers.py."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch

from megafp8.config import (
    ConfigError, GqaConfig, MlaConfig, ModelConfig, MoeConfig, RopeScalingConfig, load_config,
)
from megafp8.model import Transformer, init_weights
from megafp8.parallel import ParallelDims
from megafp8.precision import E4M3, PrecisionRecipe
from megafp8.precision.quantize import quantize_128x128
from megafp8.train import Trainer
from tests.scripts import run_scripts

pytest.importorskip("safetensors")
from megafp8.checkpoint import load_checkpoint
from megafp8.checkpoint.hf import WEIGHTS_FILE, load_hf, save_hf  # noqa: E402

TOOL = "tools/convert_checkpoint.py"
CFG = ModelConfig(vocab_size=384, hidden_size=256, num_layers=2, num_heads=4, attention=GqaConfig(num_kv_heads=2),
                  ffn_hidden_size=512)


def with_moe(cfg: ModelConfig, **moe) -> ModelConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))


def tiny_model(cfg=CFG, seed=0):
    model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), 64)
    init_weights(model, cfg, seed)
    return model


def test_round_trip_gives_identical_logits(tmp_path):
    model = tiny_model()
    assert save_hf(model.state_dict(), CFG, 64, tmp_path / "hf", fp8=False) == "llama"
    imported = load_hf(tmp_path / "hf")
    cfg, state = imported.cfg, imported.state
    assert (cfg.hidden_size, cfg.attention.num_kv_heads, cfg.ffn_hidden_size, cfg.vocab_size) == (256, 2, 512, 384)
    assert imported.layout == "llama" and imported.notes == []
    restored = tiny_model(cfg, seed=1)
    restored.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()})
    tokens = torch.randint(0, 384, (2, 64))
    assert torch.equal(model(tokens), restored(tokens))


def test_llama_names_and_fp8_blocks(tmp_path):
    from safetensors.torch import load_file

    model = tiny_model()
    save_hf(model.state_dict(), CFG, 64, tmp_path / "hf8", fp8=True)
    tensors = load_file(str(tmp_path / "hf8" / WEIGHTS_FILE))
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 256)
    assert tensors["model.layers.1.self_attn.q_proj.weight_scale_inv"].shape == (2, 2)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (128, 256)  # 2 kv heads x 64
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # islands stay BF16
    assert tensors["lm_head.weight"].dtype == torch.bfloat16
    state = load_hf(tmp_path / "hf8").state
    for name, original in model.state_dict().items():
        restored, w = state[name], original.float()
        if name.endswith("_proj.weight"):
            # Within E4M3's rounding bound: half an ulp (2^-4 relative) or half the subnormal step of the block.
            scale = w.abs().reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128).amax(dim=(1, 3)) / E4M3.max
            step = scale.repeat_interleave(128, 0).repeat_interleave(128, 1) * 2.0**-10
            assert torch.all((restored - w).abs() <= torch.maximum(w.abs() * 2.0**-4, step) * (1 + 1e-6)), name
            assert not torch.equal(restored, w)
        else:
            assert torch.equal(restored, w), name


def test_tool_exports_a_training_checkpoint_and_imports_it_for_training(tiny_overrides, tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = load_config("tiny_dense", tiny_overrides + [f"checkpoint.dir={ckpt}", "checkpoint.interval=6"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    trainer.fit()

    # Every invocation of the tool, in the order they run; each refused one gets its own non-empty --out.
    step6 = ckpt / "step_00000006"
    refusals = {command: (command, source, "--out", tmp_path / f"taken-{command}") for command, source in
                (("to-hf", step6), ("from-hf", tmp_path / "hf"), ("consolidate", step6), ("shard", step6))}
    for *_, out in refusals.values():
        out.mkdir()
        (out / "keep.txt").write_text("not yours")
    invocations = {
        "inspect": ("inspect", step6),
        "consolidate": ("consolidate", step6, "--out", tmp_path / "one"),
        "inspect consolidated": ("inspect", tmp_path / "one" / "step_00000006"),
        "shard": ("shard", tmp_path / "one" / "step_00000006", "--out", tmp_path / "sharded"),
        "to-hf": ("to-hf", step6, "--out", tmp_path / "hf"),
        "from-hf": ("from-hf", tmp_path / "hf", "--out", tmp_path / "imported"),
        **{f"refused {command}": argv for command, argv in refusals.items()},
        "to-hf --overwrite": ("to-hf", step6, "--out", tmp_path / "hf", "--overwrite"),
        "to-hf in shards": ("to-hf", step6, "--out", tmp_path / "hf_shards", "--shard-gib", "0.0005"),
        "to-hf no size": ("to-hf", step6, "--out", tmp_path / "hf_none", "--shard-gib", "0"),
        "to-hf endless size": ("to-hf", step6, "--out", tmp_path / "hf_inf", "--shard-gib", "inf"),
        "inspect missing": ("inspect", tmp_path / "nope"),
    }
    # One interpreter imports torch and megafp8 for all of them (tests/scripts.py): ~4 s of CPU each otherwise.
    results = dict(zip(invocations, run_scripts([(TOOL, *argv) for argv in invocations.values()])))

    def output(name: str) -> str:
        assert results[name].returncode == 0, (name, results[name].stderr)
        return results[name].stdout

    listing = output("inspect")
    assert "step: 6" in listing and "| layers.1.attn.qkv_proj.weight | (256, 128) | bfloat16 | yes | yes |" in listing
    assert "form: sharded (torch.distributed.checkpoint: 1 shard file(s)" in listing
    # Between the two on-disk forms and back: the same tensors and state.
    output("consolidate")
    assert "form: full (one state.pt)" in output("inspect consolidated")
    rows = [[line.split(" | ")[0] for line in output(name).splitlines() if line.startswith("| ") and "weight" in line]
            for name in ("inspect", "inspect consolidated")]
    assert rows[0] == rows[1]  # the sharded index's order was the ranks' (layers.0.attn_norm after lm_head)
    assert rows[0][:3] == ["| embed.weight", "| final_norm.weight", "| layers.0.attn.out_proj.weight"]
    output("shard")
    original, back = (load_checkpoint(step6), load_checkpoint(tmp_path / "sharded" / "step_00000006"))
    assert original["loader"] == back["loader"] and original["optimizer"]["step"] == back["optimizer"]["step"] == 6
    for kind in ("masters", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(t, back["optimizer"][kind][n]) for n, t in original["optimizer"][kind].items())
    output("to-hf")
    printed = output("from-hf")
    assert f"train from it with checkpoint.resume={tmp_path / 'imported' / 'step_00000000'}" in printed
    (tmp_path / "run.yaml").write_text(printed[printed.index("model:"):])  # the printed model section, as it is
    not_model = [o for o in tiny_overrides if not o.startswith("model.")]
    resumed = Trainer(load_config(tmp_path / "run.yaml", not_model + [
        f"checkpoint.resume={tmp_path / 'imported' / 'step_00000000'}", "run_name=imported"]),
        ParallelDims.single(), torch.device("cpu"))
    written_out = dataclasses.replace(trainer.model_cfg.attention, head_dim=64)  # as transformers does
    assert resumed.model_cfg == dataclasses.replace(trainer.model_cfg, attention=written_out)
    assert resumed.step == 0 and resumed.optimizer.step_count == 0
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name  # masters rounded to BF16 are the model weights
    losses = [r["loss"] for r in resumed.fit() if r["kind"] == "train"]
    assert losses[0] < 5.0  # starts from the trained weights, not from scratch (ln 384 = 5.95)
    for command, (*_, out) in refusals.items():
        refused = results[f"refused {command}"]
        assert refused.returncode == 2 and refused.stderr == (
            f"error: --out {out} exists and is not empty: choose another --out, or pass --overwrite to write into it "
            "(files of the same name are replaced; to-hf also removes an earlier export's weight files)\n"), \
            (command, refused.stderr)
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    output("to-hf --overwrite")
    output("to-hf in shards")  # 0.0005 GiB, ~0.5 MiB: the tiny model's BF16 weights in more than one file
    shards = sorted(p.name for p in (tmp_path / "hf_shards").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                                          for i in range(1, len(shards) + 1)]
    assert (tmp_path / "hf_shards" / "model.safetensors.index.json").is_file()
    assert results["to-hf no size"].returncode == 2 and results["to-hf no size"].stderr == (
        "error: --shard-gib 0: give the largest file size in GiB, above 0\n")
    assert results["to-hf endless size"].returncode == 2 and results["to-hf endless size"].stderr == (
        "error: --shard-gib inf: give the largest file size in GiB, above 0\n")
    bad = results["inspect missing"]
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_an_imported_checkpoint_holds_no_moments_and_resumes_in_either_form(tiny_overrides, tmp_path):
    """An import is a fresh optimizer: its checkpoint stores the model and the masters, not 8 bytes a parameter of
    zero moments (a 70B import held and wrote ~560 GB of zeros). Resumed as it is and as a sharded checkpoint, the
    moments start at zero; a checkpoint past step 0 without them is refused as incomplete."""
    from megafp8.checkpoint.convert import consolidate, import_hf, model_settings, shard
    from megafp8.checkpoint.local import save_checkpoint

    save_hf(tiny_model().state_dict(), CFG, 64, tmp_path / "hf", fp8=False)
    imported, cfg, _ = import_hf(tmp_path / "hf", tmp_path / "ck")
    assert set(load_checkpoint(imported)["optimizer"]) == {"step", "masters"}
    (tmp_path / "run.yaml").write_text(model_settings(cfg))
    not_model = [o for o in tiny_overrides if not o.startswith("model.")]

    def resumed(path, name):
        return Trainer(load_config(tmp_path / "run.yaml", not_model + [f"checkpoint.resume={path}", f"run_name={name}",
                                                                        "training.steps=2"]),
                       ParallelDims.single(), torch.device("cpu"))

    sharded = shard(imported, tmp_path / "sharded")
    back = consolidate(sharded, tmp_path / "back")  # and back to one file: still no moments
    assert set(load_checkpoint(back)["optimizer"]) == {"step", "masters"}
    state = load_checkpoint(imported)  # as a consolidation of this session's first form wrote it: empty moments
    state["optimizer"].update(exp_avg={}, exp_avg_sq={})
    empty = save_checkpoint(tmp_path / "empty", 0, state, keep_last=0)
    for path, name in ((imported, "full"), (sharded, "sharded"), (back, "consolidated"), (empty, "empty")):
        trainer = resumed(path, name)
        assert trainer.step == 0
        assert all(not s.exp_avg.any() and not s.exp_avg_sq.any() for s in trainer.optimizer.shards)
        losses = [r["loss"] for r in trainer.fit() if r["kind"] == "train"]
        assert len(losses) == 2 and math.isfinite(losses[-1]), name
    state = load_checkpoint(imported)
    state["step"] = state["optimizer"]["step"] = 5
    later = save_checkpoint(tmp_path / "later", 5, state, keep_last=0)
    for path, says in ((later, "optimizer state lacks exp_avg .*only a checkpoint of step 0 may leave out"),
                       (shard(later, tmp_path / "later_sharded"), "holds no AdamW moments but was saved at "
                                                                  "optimizer step 5: it is incomplete")):
        with pytest.raises(ConfigError, match=says):
            resumed(path, f"refused_{path.parent.name}")


DEEPSEEK = ModelConfig(vocab_size=384, hidden_size=256, num_layers=3, num_heads=4, ffn_hidden_size=512, mtp_depth=1,
                       norm_eps=1e-6, attention=MlaConfig(q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
                                                          qk_rope_head_dim=64, v_head_dim=64),
                       moe=MoeConfig(num_experts=8, top_k=2, ffn_hidden_size=128, num_shared_experts=1,
                                     first_dense_layers=1, n_group=4, topk_group=2, routed_scaling_factor=2.5))


def _deepseek_model(cfg=DEEPSEEK, seed=0):
    """FP32, weights on the BF16 grid (export is BF16, so lossless), uneven selection biases."""
    model = Transformer(cfg, PrecisionRecipe.from_name("fp32"), 64)
    init_weights(model, cfg, seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return model


def test_deepseek_layout_round_trip_and_names(tmp_path):
    """MLA + MoE + MTP: DeepSeek-V3 names (per-expert tensors, the router's correction bias, MTP as layer 3 with
    its embedding and head copies), and import restores every tensor exactly."""
    model = _deepseek_model()
    state = model.state_dict()
    save_hf(state, DEEPSEEK, 64, tmp_path / "hf", fp8=False)
    from safetensors.torch import load_file

    names = load_file(str(tmp_path / "hf" / WEIGHTS_FILE)).keys()
    for expected in ("model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                     "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                     "model.layers.1.mlp.shared_experts.gate_proj.weight",
                     "model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight",
                     "model.layers.3.embed_tokens.weight", "model.layers.3.mlp.experts.0.down_proj.weight"):
        assert expected in names, expected
    imported = load_hf(tmp_path / "hf")
    cfg, restored = imported.cfg, imported.state
    assert cfg == DEEPSEEK and imported.notes == []  # its MTP weights are there: imported
    assert restored.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(restored[name], t.float()), name


def test_a_dense_deepseek_v3_export_keeps_its_mtp_layer_dense(tmp_path):
    """first_k_dense_replace was num_layers: DeepSeek's code (and vLLM's) builds every layer from it on as MoE, the
    MTP layer at index num_layers included, which megafp8's dense model holds as a dense block. Now past it too;
    the import reads it back as the same dense model."""
    from megafp8.checkpoint.hf_config import hf_config

    dense = dataclasses.replace(DEEPSEEK, moe=dataclasses.replace(DEEPSEEK.moe, num_experts=0))
    config = hf_config(dense, "deepseek_v3", 64, fp8=False)
    assert config["num_hidden_layers"] == dense.num_layers and config["num_nextn_predict_layers"] == dense.mtp_depth
    assert config["first_k_dense_replace"] == dense.num_layers + dense.mtp_depth
    assert hf_config(DEEPSEEK, "deepseek_v3", 64, fp8=False)["first_k_dense_replace"] == DEEPSEEK.moe.first_dense_layers


def test_deepseek_fp8_export_dequantizes_within_the_e4m3_bound(tmp_path):
    model = _deepseek_model()
    save_hf(model.state_dict(), DEEPSEEK, 64, tmp_path / "hf", fp8=True)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "hf" / WEIGHTS_FILE))
    assert tensors["model.layers.1.mlp.experts.3.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays FP32
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.bfloat16  # 192 rows: unaligned
    # ... and declared, or FP8 loaders would make it an FP8 layer with no scale (checked in test_hf_transformers.py)
    quantization = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    assert quantization["modules_to_not_convert"] == ["lm_head"] + [
        f"model.layers.{i}.self_attn.kv_a_proj_with_mqa" for i in range(4)]  # layer 3: the MTP module
    restored = load_hf(tmp_path / "hf").state
    w = model.state_dict()["layers.1.mlp.experts.gate_up_proj.weight"]
    assert (restored["layers.1.mlp.experts.gate_up_proj.weight"] - w).abs().max() <= 2**-3 * w.abs().max()




def _exported(cfg: ModelConfig, path):
    """A megafp8 model of `cfg` written as a Hugging Face directory (selection biases zero where the layout has
    none)."""
    model = _deepseek_model(cfg) if cfg.attention.kind == "mla" else tiny_model(cfg)
    if cfg.moe.score_func == "softmax":
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.data.zero_()
    save_hf(model.state_dict(), cfg, 64, path, fp8=False)
    return model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """An exported dense model whose config.json the refusal tests edit."""
    path = tmp_path_factory.mktemp("llama")
    _exported(CFG, path)
    return path


def _edited(source, target, change: dict):
    """`target`: the directory `source` with `change` merged into its config.json (the weights linked)."""
    target.mkdir(exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **change}))
    (target / WEIGHTS_FILE).symlink_to(source / WEIGHTS_FILE)
    return target


REFUSED = [
    (dict(attention_bias=True), "config.json: attention_bias=True is not supported (megafp8's linears have no biases)"),
    (dict(mlp_bias=True), "config.json: mlp_bias=True is not supported"),
    (dict(hidden_act="gelu"), "config.json: hidden_act='gelu' is not supported (megafp8's MLPs are SwiGLU)"),
    (dict(model_type="mistral", sliding_window=32),
     "config.json: sliding_window=32 is not supported (megafp8 attends to the whole causal context)"),
    (dict(model_type="mistral"), "config.json: sliding_window=4096 is not supported"),  # transformers' default
    (dict(model_type="qwen2_moe"), "config.json: model_type='qwen2_moe' is not supported: its shared expert is "
                                   "gated (shared_expert_gate)"),
    (dict(model_type="gemma"), "config.json: model_type='gemma' is not supported (megafp8 imports llama, mistral, "
                               "qwen2, qwen3, qwen3_moe, mixtral, deepseek_v2, deepseek_v3)"),
    (dict(mlp_only_layers=[1], model_type="qwen3_moe"), "config.json: mlp_only_layers=[1] is not supported "
                                                        "(megafp8's dense layers are the first ones: [0, 1, ..., k-1])"),
    (dict(decoder_sparse_step=2, model_type="qwen3_moe"), "config.json: decoder_sparse_step=2 is not supported"),
    (dict(num_experts=8, num_local_experts=4, model_type="qwen3_moe"),
     "config.json: num_experts=8 and num_local_experts=4 disagree; keep one"),
    (dict(use_sliding_window=True, model_type="qwen3"),
     "config.json: use_sliding_window=True is not supported (megafp8 attends to the whole causal context)"),
    (dict(layer_types=["sliding_attention", "full_attention"], model_type="qwen3"),
     "config.json: layer_types holds 'sliding_attention': megafp8's layers all attend to the whole causal context"),
    (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)),
     "config.json: rope_type='dynamic' is not supported (megafp8 has default, yarn and llama3)"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0, attention_factor=0.9)),
     "rope_parameters.attention_factor / truncate=false are not supported"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=2.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, mscale=1.0)),
     "config.json: rope_parameters.mscale=1.0 is not a llama3 RoPE setting megafp8 has"),
    (dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "config.json: rope_scaling={'rope_type': 'yarn', "
                                                            "'factor': 4.0} and rope_parameters="),
    (dict(rope_theta=20000.0, rope_parameters=dict(rope_type="default", rope_theta=1e4)),  # was 1e4 without a word
     "config.json: rope_theta=20000.0 and rope_parameters.rope_theta=10000.0 disagree; keep one"),
    (dict(partial_rotary_factor=0.5), "config.json: partial_rotary_factor != 1 is not supported"),
    (dict(quantization_config=dict(quant_method="bitsandbytes")), "quantization_config (quant_method='bitsandbytes'"),
    (dict(qk_layernorm=True), "config.json: qk_layernorm=True is a llama setting megafp8's converter does not know"),
    (dict(num_key_value_heads=3), "config.json describes a model megafp8 refuses: model.attention.num_kv_heads=3 "
                                            "must divide"),
    (dict(hidden_size="256"), "config.json: hidden_size must be an integer, got '256' (str): write it as one"),  # was
    (dict(hidden_size=256.0), "config.json: hidden_size must be an integer, got 256.0 (float): write it as 256"),  # a
    (dict(num_hidden_layers=True), "config.json: num_hidden_layers must be a number, got True"),            # TypeError
    (dict(rms_norm_eps="1e-5"), "config.json: rms_norm_eps must be a number, got '1e-5' (str)"),
]


@pytest.mark.parametrize("change, message", REFUSED, ids=[next(iter(c)) + "=" + str(next(iter(c.values())))
                                                          for c, _ in REFUSED])
def test_a_config_value_megafp8_cannot_represent_is_refused_in_one_line(tmp_path, llama_dir, change, message):
    with pytest.raises(ConfigError) as err:
        load_hf(_edited(llama_dir, tmp_path / "hf", change))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_rope_scaling_in_its_older_spelling_beside_the_same_rope_parameters_imports(tmp_path, llama_dir):
    """`rope_scaling: {type: llama3, ...}` beside the same `rope_parameters: {rope_type: llama3, ...}` (transformers
    reads `type` as `rope_type`) was refused as a disagreement."""
    llama3 = dict(factor=2.0, original_max_position_embeddings=64, low_freq_factor=1.0, high_freq_factor=4.0)
    loaded = load_hf(_edited(llama_dir, tmp_path / "hf", dict(
        rope_scaling=dict(type="llama3", **llama3), rope_parameters=dict(rope_type="llama3", rope_theta=1e4, **llama3))))
    assert loaded.cfg.rope_scaling.type == "llama3" and loaded.cfg.rope_scaling.factor == 2.0


V2 = with_moe(dataclasses.replace(DEEPSEEK, mtp_depth=0), score_func="softmax", norm_topk_prob=False, n_group=1,
              topk_group=1, routed_scaling_factor=1.0, num_shared_experts=2)
DEEPSEEK_REFUSED = [
    (V2, dict(topk_method="group_limited_greedy", n_group=2, topk_group=1),
     "config.json: topk_method=group_limited_greedy with n_group=2 is not supported"),
    (V2, dict(norm_topk_prob=True), "config.json: norm_topk_prob=True is not supported (transformers' DeepSeek-V2 "
                                    "ignores it"),
    (V2, dict(num_nextn_predict_layers=1), "config.json: num_nextn_predict_layers=1 is not supported"),
    (DEEPSEEK, dict(rms_norm_eps=1e-5), "config.json: rms_norm_eps=1e-05 is not supported (DeepSeek's attention "
                                        "normalizes q and kv with eps 1e-6"),
    (DEEPSEEK, dict(scoring_func="softmax"), "config.json: scoring_func='softmax' is not supported"),
    (DEEPSEEK, dict(moe_layer_freq=2), "config.json: moe_layer_freq=2 is not supported"),
]


@pytest.mark.parametrize("cfg, change, message", DEEPSEEK_REFUSED,
                         ids=[f"{'v2' if c is V2 else 'v3'}-{next(iter(d))}" for c, d, _ in DEEPSEEK_REFUSED])
def test_deepseek_routing_and_norms_megafp8_lacks_are_refused(tmp_path, cfg, change, message):
    _exported(cfg, tmp_path / "hf")
    with pytest.raises(ConfigError) as err:
        load_hf(_edited(tmp_path / "hf", tmp_path / "edited", change))
    assert message in str(err.value)


def test_a_tensor_the_config_does_not_declare_is_refused(tmp_path, llama_dir):
    """A bias (Qwen2-style) in a file whose config.json says none: not dropped silently."""
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_text((llama_dir / "config.json").read_text())
    tensors = load_file(str(llama_dir / WEIGHTS_FILE))
    save_file({**tensors, "model.layers.0.self_attn.q_proj.bias": torch.zeros(256)}, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.0.self_attn.q_proj.bias' of the checkpoint has no "
                                          "place in the model its config.json describes"):
        load_hf(tmp_path)


def test_deepseek_mtp_copies_must_equal_the_shared_embedding_and_head(tmp_path):
    from safetensors.torch import load_file, save_file

    _exported(DEEPSEEK, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    tensors["model.layers.3.shared_head.head.weight"] = tensors["model.layers.3.shared_head.head.weight"] * 2
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(ConfigError, match="model.layers.3.shared_head.head.weight differs from the model's "
                                          "lm_head.weight: megafp8's MTP modules share"):
        load_hf(tmp_path)


def test_fp8_weights_with_partial_edge_blocks_are_dequantized(tmp_path):
    """DeepSeek-V3 ships kv_a (576 rows) in FP8 with ceil(576/128) row blocks: the last block is partial."""
    from safetensors.torch import load_file, save_file

    model = _exported(DEEPSEEK, tmp_path)
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 192 x 256: 2 x 2 blocks, the second half-full
    w = tensors[name].float()
    q, scale = quantize_128x128(torch.cat([w, torch.zeros(64, 256)]), E4M3)
    tensors[name], tensors[name + "_scale_inv"] = q[:192], scale
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    restored = load_hf(tmp_path).state["layers.0.attn.kv_a_proj.weight"]
    original = model.state_dict()["layers.0.attn.kv_a_proj.weight"]
    assert not torch.equal(restored, original) and (restored - original).abs().max() <= 2**-4 * original.abs().max()
    tensors[name + "_scale_inv"] = scale[:1]
    save_file(tensors, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(ConfigError, match=r"_scale_inv' has shape \(1, 2\), not the \(2, 2\) blocks of 128x128"):
        load_hf(tmp_path)


MLA_CFG = dataclasses.replace(CFG, attention=MlaConfig())


@pytest.mark.parametrize("cfg, message", [
    (with_moe(CFG, num_experts=4, score_func="softmax", first_dense_layers=0),
     "model.moe.num_shared_experts=1 has no place in the Mixtral layout"),
    (with_moe(CFG, num_experts=4, num_shared_experts=0, first_dense_layers=0),
     "model.moe.score_func='sigmoid' has no place in the Mixtral layout"),
    (dataclasses.replace(CFG, mtp_depth=1), "model.mtp_depth=1: only the DeepSeek-V3 layout"),
    # model.moe's defaults (DeepSeek-V3's routing) on GQA: every setting at once, not one per retraining
    (with_moe(CFG, num_experts=4),
     "model.moe.score_func='sigmoid', model.moe.num_shared_experts=1 and model.moe.first_dense_layers=1 have no place "
     "in the Mixtral layout this model converts to (it needs 'softmax', 0 and 0): train it with "
     "model.moe.score_func=softmax model.moe.num_shared_experts=0 model.moe.first_dense_layers=0 "
     "model.moe.bias_update_rate=0 (Mixtral has no selection bias)"),
    (dataclasses.replace(MLA_CFG, norm_eps=1e-5), "model.norm_eps=1e-05: DeepSeek's layout normalizes MLA's q and kv "
                                                  "with eps 1e-6"),
    (with_moe(dataclasses.replace(MLA_CFG, norm_eps=1e-6), num_experts=4, score_func="softmax"),
     "model.moe.norm_topk_prob=True has no place in the DeepSeek-V2 layout"),
    (dataclasses.replace(CFG, attention=dataclasses.replace(CFG.attention, qkv_bias=True, qk_norm=True)),
     "model.attention.qkv_bias=true exports as Qwen2, a dense layout without query/key norms"),
    # model.moe's defaults on Qwen3's attention: its dense layers may lead, its routing is softmax without sharing
    (with_moe(dataclasses.replace(CFG, attention=dataclasses.replace(CFG.attention, qk_norm=True)), num_experts=4),
     "model.moe.score_func='sigmoid' and model.moe.num_shared_experts=1 have no place in the Qwen3-MoE layout this "
     "model converts to (it needs 'softmax' and 0): train it with model.moe.score_func=softmax "
     "model.moe.num_shared_experts=0 model.moe.bias_update_rate=0 (Qwen3-MoE has no selection bias)"),
])
def test_a_model_without_an_exact_layout_is_not_exported(tmp_path, cfg, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        save_hf({}, cfg, 64, tmp_path / "hf", fp8=False)
    assert not (tmp_path / "hf").exists()  # nothing half-written


def test_a_trained_selection_bias_is_not_exported_to_a_layout_without_one(tmp_path):
    cfg = with_moe(CFG, num_experts=4, ffn_hidden_size=128, num_shared_experts=0, first_dense_layers=0,
                   score_func="softmax")
    state = tiny_model(cfg).state_dict()
    state["layers.1.mlp.router.expert_bias"][0] = 1e-3
    with pytest.raises(ConfigError, match=r"layers.1.mlp.router.expert_bias is non-zero .* train such models with "
                                          r"model.moe.bias_update_rate=0"):
        save_hf(state, cfg, 64, tmp_path / "hf", fp8=False)
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.router.expert_bias is non-zero .* the DeepSeek-V2 "):
        save_hf(_deepseek_model(V2).state_dict(), V2, 64, tmp_path / "hf", fp8=False)


@pytest.mark.parametrize("rope_scaling, expected", [
    (None, RopeScalingConfig()),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, RopeScalingConfig(type="llama3", factor=8.0,
                                                                   original_max_position_embeddings=8192)),
    ({"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
      "original_max_position_embeddings": 4096}, RopeScalingConfig(type="yarn", factor=40.0, mscale=0.707,
                                                                   mscale_all_dim=0.707)),
])
def test_configs_of_transformers_4_give_the_rope_settings_too(tmp_path, llama_dir, rope_scaling, expected):
    """Before transformers 5 the base was a top-level `rope_theta` and the scaling `rope_scaling` (`type` in
    DeepSeek's files); reading only `rope_parameters` would fall back to 10000 and no scaling."""
    config = json.loads((llama_dir / "config.json").read_text())
    del config["rope_parameters"]
    edited = _edited(llama_dir, tmp_path / "hf", {})  # then its config.json replaced: no rope_parameters
    (edited / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0, "rope_scaling": rope_scaling}))
    cfg = load_hf(edited).cfg
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == expected


@pytest.mark.parametrize("change, message", [
    (dict(num_key_value_heads=4), "tensor 'layers.0.attn.qkv_proj.weight' (from model.layers.0.self_attn.q_proj."
                                  "weight, model.layers.0.self_attn.k_proj.weight, model.layers.0.self_attn.v_proj."
                                  "weight) has shape (512, 256), but config.json describes (768, 256)"),
    (dict(vocab_size=256), "tensor 'embed.weight' (from model.embed_tokens.weight) has shape (384, 256), but "
                           "config.json describes (256, 256)"),
])
def test_a_config_that_does_not_match_the_tensors_is_refused_naming_the_tensor(tmp_path, llama_dir, change, message):
    """Before, the import wrote a checkpoint whose config and tensors disagreed; the run resuming it failed instead."""
    with pytest.raises(ConfigError) as err:
        load_hf(_edited(llama_dir, tmp_path / "hf", change))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_deepseek_config_that_does_not_match_the_tensors_is_refused_naming_the_tensor(tmp_path):
    """The rotary rows are permuted on import: before, a wrong width failed there with torch's view error."""
    _exported(DEEPSEEK, tmp_path / "hf")
    with pytest.raises(ConfigError, match=re.escape(
            "tensor 'layers.0.attn.q_b_proj.weight' (from model.layers.0.self_attn.q_b_proj.weight) has shape "
            "(512, 128), but config.json describes (384, 128): the config does not match the weights")):
        load_hf(_edited(tmp_path / "hf", tmp_path / "edited", dict(qk_rope_head_dim=32)))

