"""The dense decoder: shapes, causality, GQA, init determinism, FLOP counts, and that it can learn."""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megafp8.config import AttentionConfig, GqaConfig, ModelConfig
from megafp8.model import Transformer, init_weights, training_flops_per_token
from megafp8.model.rope import RotaryEmbedding
from megafp8.parallel import ColumnParallelLinear, RowParallelLinear
from megafp8.precision import PrecisionRecipe
from tests.conftest import REPO

CFG = ModelConfig(vocab_size=384, hidden_size=128, num_layers=2, num_heads=4, attention=GqaConfig(num_kv_heads=2),
                  ffn_hidden_size=256)


def build(cfg=CFG, recipe="fp32", seq_len=32, seed=0):
    model = Transformer(cfg, PrecisionRecipe.from_name(recipe), seq_len)
    init_weights(model, cfg, seed)
    return model


def test_logits_shape_and_dtype():
    model = build(recipe="bf16")
    tokens = torch.randint(0, 384, (3, 32))
    logits = model(tokens)
    assert logits.shape == (3, 32, 384) and logits.dtype == torch.bfloat16
    loss = model(tokens, tokens)
    assert loss.dtype == torch.float32 and loss.ndim == 0


def test_gemm_layers_go_through_the_parallel_seam():
    model = build()
    kinds = {type(m) for m in model.modules()}
    assert ColumnParallelLinear in kinds and RowParallelLinear in kinds
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    qkv = model.layers[0].attn.qkv_proj.weight
    assert qkv.shape == ((4 + 2 * 2) * 32, 128)  # 4 query heads + 2 kv heads x (k, v), head_dim 32


def test_attention_is_causal():
    model = build()
    tokens = torch.randint(0, 384, (1, 32))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 384
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_same_seed_same_weights_different_seed_different():
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_init_scales_residual_outputs():
    model = build(dataclasses.replace(CFG, num_layers=8, init_std=0.02))
    std_in = model.layers[0].attn.qkv_proj.weight.std().item()
    std_out = model.layers[0].attn.out_proj.weight.std().item()
    assert std_in == pytest.approx(0.02, rel=0.05)
    assert std_out == pytest.approx(0.02 / 4, rel=0.05)  # 1/sqrt(2 * 8)
    assert torch.all(model.final_norm.weight == 1)


def test_rope_matches_complex_rotation():
    rope = RotaryEmbedding(head_dim=8, max_seq_len=16, theta=10000.0)
    q = torch.randn(1, 16, 2, 8)
    rotated, _ = rope(q, q)
    # Reference: pair (x_i, x_{i+d/2}) as a complex number rotated by position * freq_i.
    freqs = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    angles = torch.outer(torch.arange(16).float(), freqs)[None, :, None, :]
    z = torch.complex(q[..., :4], q[..., 4:]) * torch.polar(torch.ones_like(angles), angles)
    assert torch.allclose(rotated, torch.cat([z.real, z.imag], dim=-1), atol=1e-5)


def test_a_meta_model_s_rope_tables_are_shapes_without_importing_the_compiler():
    """The planner and the checkpoint code build models on the meta device for names and shapes; computing RoPE's
    tables there ran torch's Python reference of `arange`, which imported `torch._dynamo` (~1.5-3.5 s a process)."""
    code = ("import sys, torch; from megafp8.model.rope import RotaryEmbedding; "
            "rope = RotaryEmbedding(head_dim=8, max_seq_len=16, theta=1e4, device=torch.device('meta')); "
            "assert rope.cos.shape == rope.sin.shape == (16, 8) and rope.cos.is_meta and rope.cos.dtype == torch.float32; "
            "assert 'torch._dynamo' not in sys.modules, 'the meta tables imported torch._dynamo'")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


YARN = ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4"]  # from 4096 tokens: dims 0-9 kept, 23-31 scaled


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_rope_scaling_reaches_the_model_that_trains(attention):
    """model.rope_scaling builds the training model's tables: frequencies scaled (YaRN: low ones divided by the factor,
    high ones kept), cos/sin times YaRN's attention factor m(mscale)/m(mscale_all_dim), and under MLA the softmax
    scale times m(mscale_all_dim)^2, m(s) = 0.1 s ln(factor) + 1."""
    from megafp8.config import load_config
    from megafp8.train.build import build_model

    mla = ["model.attention.kind=mla", "model.attention.q_lora_rank=null", "model.attention.kv_lora_rank=128",
           "model.attention.qk_nope_head_dim=32", "model.attention.qk_rope_head_dim=32",
           "model.attention.v_head_dim=32"] if attention == "mla" else []
    scaled = YARN + ["model.rope_scaling.mscale=1", "model.rope_scaling.mscale_all_dim=0.5"]

    def model(*overrides):
        cfg = load_config("tiny_dense", ["model.vocab_size=384", "model.num_layers=1", *mla, *overrides])
        return build_model(cfg, cfg.model, PrecisionRecipe.from_name("fp32"), torch.device("cpu"))

    plain, yarn = model(), model(*scaled)
    dim = plain.rope.head_dim
    m = lambda s: 0.1 * s * math.log(4) + 1  # noqa: E731
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    def frequencies(rope):  # the angle at position 1
        return torch.atan2(rope.sin[1, :dim // 2], rope.cos[1, :dim // 2])

    assert torch.allclose(frequencies(plain.rope), inv, rtol=1e-5)
    assert torch.allclose(frequencies(yarn.rope)[:2], inv[:2], rtol=1e-5)  # fast dims kept
    assert torch.allclose(frequencies(yarn.rope)[-2:], inv[-2:] / 4, rtol=1e-5)  # slow dims interpolated
    magnitude = yarn.rope.cos[:, 0] ** 2 + yarn.rope.sin[:, 0] ** 2
    assert torch.allclose(magnitude, torch.full_like(magnitude, (m(1) / m(0.5)) ** 2))
    if attention == "mla":
        assert yarn.layers[0].attn.scale == pytest.approx(plain.layers[0].attn.scale * m(0.5) ** 2, rel=1e-12)


def test_every_attention_kind_has_a_module():
    """A kind is its settings (megafp8/config/attention.py) plus its module: a kind without one cannot be built."""
    from megafp8.model.transformer import ATTENTION_MODULES

    assert set(ATTENTION_MODULES) == set(AttentionConfig.kinds())


def test_rope_rejects_too_long_sequences():
    model = build(seq_len=16)
    with pytest.raises(ValueError, match="exceeds the RoPE table"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_flops_per_token_counts_gemm_params():
    cfg = dataclasses.replace(CFG)
    gemm_params = sum(p.numel() for n, p in build(cfg).named_parameters() if n.endswith("proj.weight") or n == "lm_head.weight")
    attention = 2 * 3 * 2 * 2 * 16 * 4 * 32  # layers x fwd+bwd x 2 GEMMs x 2 FLOPs x T/2 x heads x head_dim
    assert training_flops_per_token(cfg, 32) == 6 * gemm_params + attention


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_overfits_a_repeated_batch(recipe):
    torch.manual_seed(0)
    model = build(recipe=recipe)
    params = [p for p in model.parameters()]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=3e-3, weight_decay=0.0)
    tokens = torch.randint(0, 384, (4, 33))
    first = None
    for _ in range(30):  # below 0.5 from step 17 on, ~0.05 at step 30 (fp32 and bf16 alike)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        first = first if first is not None else loss.item()
    assert first > 5.5  # ln(384) = 5.95 at init
    assert loss.item() < 0.5, f"{recipe}: loss {first:.3f} -> {loss.item():.3f}"


# Frames that put a call inside an OpenMP parallel region (libgomp's worker start, its fork, an outlined body)
OPENMP_FRAMES = ("gomp_thread_start", "GOMP_parallel", "._omp_fn")
ROPE_LIKE_TABLE = "import torch; torch.outer(torch.arange(64.0), torch.rand(64)).cos()"


def _first_vector_math_dispatch(code: str) -> str:
    """The backtrace where MKL's vector math first picks its kernels (`mkl_vml_serv_cpu_detect`) in `python -c
    code` with two OpenMP threads, under gdb."""
    gdb = shutil.which("gdb")
    if gdb is None:
        pytest.skip("gdb is not installed")
    cmd = [gdb, "-batch", "-nx", "-ex", "set breakpoint pending on", "-ex", "break mkl_vml_serv_cpu_detect",
           "-ex", "run", "-ex", "bt 60", "-ex", "kill", "--args", sys.executable, "-c", code]
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    out = result.stdout + result.stderr
    if "hit Breakpoint 1" not in out:
        pytest.skip(f"no MKL vector-math dispatch seen (another BLAS, or gdb cannot trace here): {out[-300:]}")
    return out.split("hit Breakpoint 1", 1)[1]


def test_mkl_vector_math_picks_its_kernels_on_one_thread_once_rope_is_imported():
    """MKL fills its kernel choice in on the first call with two unsynchronised stores; a second thread reading it
    between them computes its part of the tensor at ~11-bit accuracy (`settle_cpu_vector_math`). Alone, a RoPE-sized
    table's cos makes that first call inside an OpenMP region (the check sees it); after importing the RoPE module
    the first call is its one-element cos, on one thread."""
    alone = _first_vector_math_dispatch(ROPE_LIKE_TABLE)
    assert any(frame in alone for frame in OPENMP_FRAMES), alone[:3000]
    settled = _first_vector_math_dispatch("import megafp8.model.rope; " + ROPE_LIKE_TABLE)
    assert not any(frame in settled for frame in OPENMP_FRAMES), settled[:3000]
    assert "wrapper_CPU_cos" in settled, settled[:3000]  # the one-element cos
