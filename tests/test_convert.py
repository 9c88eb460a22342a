"""Hugging Face Llama safetensors export/import, FP8 export, bad files, and the conversion tool."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megafp8.config import ConfigError, ModelConfig, load_config
from megafp8.model import Transformer, init_weights
from megafp8.parallel import ParallelDims
from megafp8.precision import E4M3, PrecisionRecipe
from megafp8.train import Trainer
from tests.conftest import REPO, torchrun_env

pytest.importorskip("safetensors")
from megafp8.checkpoint import load_checkpoint
from megafp8.checkpoint.hf import WEIGHTS_FILE, load_hf, save_hf  # noqa: E402

CFG = ModelConfig(vocab_size=384, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=512)


def tiny_model(cfg=CFG, seed=0):
    model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), 64)
    init_weights(model, cfg, seed)
    return model


def test_round_trip_gives_identical_logits(tmp_path):
    model = tiny_model()
    save_hf(model.state_dict(), CFG, 64, tmp_path / "hf", fp8=False)
    cfg, state = load_hf(tmp_path / "hf")
    assert (cfg.hidden_size, cfg.num_kv_heads, cfg.ffn_hidden_size, cfg.vocab_size) == (256, 2, 512, 384)
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
    _, state = load_hf(tmp_path / "hf8")
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


def test_truncated_or_incomplete_files_give_clear_errors(tmp_path):
    model = tiny_model()
    save_hf(model.state_dict(), CFG, 64, tmp_path / "hf", fp8=False)
    path = tmp_path / "hf" / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="model.safetensors is not a readable safetensors file"):
        load_hf(tmp_path / "hf")
    from safetensors.torch import load_file, save_file
    path.write_bytes(data)
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(ConfigError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_hf(tmp_path / "hf")
    with pytest.raises(ConfigError, match="config.json not found"):
        load_hf(tmp_path)


def test_tool_exports_a_training_checkpoint_and_imports_it_for_training(tiny_overrides, tmp_path):
    ckpt = tmp_path / "ckpt"
    cfg = load_config("tiny_dense", tiny_overrides + [f"checkpoint.dir={ckpt}", "checkpoint.interval=6"])
    trainer = Trainer(cfg, ParallelDims.single(), torch.device("cpu"))
    trainer.fit()

    def tool(*args):
        result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", *map(str, args)], cwd=REPO,
                                env=torchrun_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result.stdout

    listing = tool("inspect", ckpt / "step_00000006")
    assert "step: 6" in listing and "| layers.1.attn.qkv_proj.weight | (256, 128) | bfloat16 | yes | yes |" in listing
    assert "form: sharded (torch.distributed.checkpoint: 1 shard file(s)" in listing
    # Between the two on-disk forms and back: the same tensors and state.
    tool("consolidate", ckpt / "step_00000006", "--out", tmp_path / "one")
    assert "form: full (one state.pt)" in tool("inspect", tmp_path / "one" / "step_00000006")
    tool("shard", tmp_path / "one" / "step_00000006", "--out", tmp_path / "sharded")
    original, back = (load_checkpoint(ckpt / "step_00000006"), load_checkpoint(tmp_path / "sharded" / "step_00000006"))
    assert original["loader"] == back["loader"] and original["optimizer"]["step"] == back["optimizer"]["step"] == 6
    for kind in ("masters", "exp_avg", "exp_avg_sq"):
        assert all(torch.equal(t, back["optimizer"][kind][n]) for n, t in original["optimizer"][kind].items())
    tool("to-hf", ckpt / "step_00000006", "--out", tmp_path / "hf")
    assert "step_00000000" in tool("from-hf", tmp_path / "hf", "--out", tmp_path / "imported")
    resumed = Trainer(load_config("tiny_dense", tiny_overrides + [
        f"checkpoint.resume={tmp_path / 'imported' / 'step_00000000'}", "run_name=imported"]),
        ParallelDims.single(), torch.device("cpu"))
    assert resumed.step == 0 and resumed.optimizer.step_count == 0
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name  # masters rounded to BF16 are the model weights
    losses = [r["loss"] for r in resumed.fit() if r["kind"] == "train"]
    assert losses[0] < 5.0  # starts from the trained weights, not from scratch (ln 384 = 5.95)
    bad = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "inspect", str(tmp_path / "nope")],
                         cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "not found" in bad.stderr


def test_export_runs_in_hugging_face_transformers_with_identical_logits(tmp_path):
    """Optional (needs `transformers`, not installed by `make test`): the exported directory is a valid
    LlamaForCausalLM whose FP32 logits equal ours."""
    transformers = pytest.importorskip("transformers")
    model = Transformer(CFG, PrecisionRecipe.from_name("fp32"), 64)
    init_weights(model, CFG, 0)
    save_hf(model.state_dict(), CFG, 64, tmp_path / "hf", fp8=False)
    _, state = load_hf(tmp_path / "hf")
    model.load_state_dict(state)  # the export is BF16: compare the model that the file actually holds
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    tokens = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


DEEPSEEK = ModelConfig(vocab_size=384, hidden_size=256, num_layers=3, num_heads=4, attention="mla", q_lora_rank=128,
                       kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, ffn_hidden_size=512,
                       moe_num_experts=8, moe_top_k=2, moe_ffn_hidden_size=128, moe_num_shared_experts=1,
                       moe_first_dense_layers=1, moe_n_group=4, moe_topk_group=2, moe_routed_scaling_factor=2.5,
                       mtp_depth=1, norm_eps=1e-6)


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
    cfg, restored = load_hf(tmp_path / "hf")
    assert cfg == DEEPSEEK
    assert restored.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(restored[name], t.float()), name


def test_deepseek_export_runs_in_hugging_face_transformers_with_identical_logits(tmp_path):
    """Optional (needs `transformers`): the export loads as DeepseekV3ForCausalLM (interleaved rotary rows, group-
    limited sigmoid routing with the correction bias, per-expert weights) and its FP32 logits equal ours."""
    transformers = pytest.importorskip("transformers")
    model = _deepseek_model()
    save_hf(model.state_dict(), DEEPSEEK, 64, tmp_path / "hf", fp8=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    tokens = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(3))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-4, atol=1e-4)


def test_deepseek_fp8_export_dequantizes_within_the_e4m3_bound(tmp_path):
    model = _deepseek_model()
    save_hf(model.state_dict(), DEEPSEEK, 64, tmp_path / "hf", fp8=True)
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "hf" / WEIGHTS_FILE))
    assert tensors["model.layers.1.mlp.experts.3.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # the router stays FP32
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.bfloat16  # 192 rows: unaligned
    _, restored = load_hf(tmp_path / "hf")
    w = model.state_dict()["layers.1.mlp.experts.gate_up_proj.weight"]
    assert (restored["layers.1.mlp.experts.gate_up_proj.weight"] - w).abs().max() <= 2**-3 * w.abs().max()


@pytest.mark.parametrize("change, message", [
    (dict(attention="gqa", num_kv_heads=2), "needs MLA attention"),
    (dict(moe_score_func="softmax"), "scores with sigmoid"),
])
def test_models_without_a_hugging_face_layout_are_refused_clearly(tmp_path, change, message):
    import dataclasses

    with pytest.raises(ConfigError, match=message):
        save_hf({}, dataclasses.replace(DEEPSEEK, **change), 64, tmp_path / "hf", fp8=False)
    assert not (tmp_path / "hf").exists()  # nothing half-written
