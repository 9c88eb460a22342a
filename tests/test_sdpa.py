"""`model.attention_backend`: which SDPA kernel runs the attention core, for GQA and MLA, eagerly and compiled."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend

from megafp8.config import ConfigError, GqaConfig, MlaConfig, ModelConfig, load_config
from megafp8.model import Transformer, init_weights
from megafp8.model.sdpa import ATTENTION_BACKENDS, sdpa_backends, sdpa_backends_for
from megafp8.precision import PrecisionRecipe

GQA = ModelConfig(vocab_size=256, hidden_size=128, num_layers=1, num_heads=4, attention=GqaConfig(num_kv_heads=2),
                  ffn_hidden_size=256)
MLA = dataclasses.replace(GQA, attention=MlaConfig(q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
                                                   qk_rope_head_dim=16, v_head_dim=32))
CPU_FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"  # the CPU build's flash kernel, an op of its own


def test_auto_prefers_cudnn_on_hopper_only():
    hopper = sdpa_backends("auto", "cuda", (9, 0))
    assert hopper[0] == SDPBackend.CUDNN_ATTENTION
    assert set(hopper) == {SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.MATH}  # every other backend stays, for shapes cuDNN does not take
    for device_type, capability, hip in (("cuda", (8, 0), False), ("cuda", (10, 0), False), ("cuda", (12, 0), False),
                                         ("cuda", (9, 4), True), ("cpu", None, False)):
        assert sdpa_backends("auto", device_type, capability, hip) is None, (device_type, capability, hip)
    assert sdpa_backends("torch", "cuda", (9, 0)) is None
    assert sdpa_backends("cudnn", "cuda", (8, 0)) == (SDPBackend.CUDNN_ATTENTION,)
    assert sdpa_backends("math", "cuda", (9, 0)) == (SDPBackend.MATH,)
    assert sdpa_backends_for("auto", torch.device("meta")) is None
    with pytest.raises(ConfigError, match="attention_backend='fast'"):
        sdpa_backends("fast", "cuda", (9, 0))


def test_a_wrong_backend_name_is_one_config_error():
    with pytest.raises(ConfigError) as err:
        load_config("tiny_dense", ["model.attention_backend=fa3"])
    message = str(err.value)
    assert "model.attention_backend" in message and all(name in message for name in ATTENTION_BACKENDS), message


def _model(cfg: ModelConfig, backend: str) -> Transformer:
    cfg = dataclasses.replace(cfg, attention_backend=backend)
    model = Transformer(cfg, PrecisionRecipe.from_name("fp32"), 64)
    init_weights(model, cfg, 0)
    return model


def _ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.name for event in prof.events()}


def test_the_chosen_backend_runs_eagerly_and_compiled():
    """On CPU, `flash` runs the CPU flash kernel and `math` never does, forward and backward, also inside a block
    compiled with no graph break (the backend context is traced into the graph). Both give the same losses."""
    cfg = GQA
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = {}
    for backend in ("flash", "math"):
        model = _model(cfg, backend)
        block = model.layers[0]
        x = torch.randn(2 * 64, cfg.hidden_size, requires_grad=True)
        explained = torch._dynamo.explain(block._forward)(x, model.rope, 2, 64)
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(block._forward, backend="aot_eager", fullgraph=True)
        for run in (lambda: model(tokens, tokens).backward(),
                    lambda: compiled(x, model.rope, 2, 64)[0].float().sum().backward()):
            ops = _ops_run(run)
            assert (CPU_FLASH in ops) == (backend == "flash"), (backend, sorted(o for o in ops if "attention" in o))
        losses[backend] = model(tokens, tokens).item()
    assert losses["flash"] == pytest.approx(losses["math"], rel=1e-5)


def test_latent_attention_takes_the_choice_too():
    """MLA's values are narrower than its queries and keys, which FlashAttention does not take: `flash` alone fails
    with SDPA's reason, `math` compiles into one graph and gives torch's order's loss."""
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="[Nn]o available kernel"), pytest.warns(UserWarning, match="last dimension"):
        _model(MLA, "flash")(tokens, tokens)
    model = _model(MLA, "math")
    x = torch.randn(2 * 64, MLA.hidden_size, requires_grad=True)
    explained = torch._dynamo.explain(model.layers[0]._forward)(x, model.rope, 2, 64)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert model(tokens, tokens).item() == pytest.approx(_model(MLA, "torch")(tokens, tokens).item(), rel=1e-5)


def test_a_backend_this_device_lacks_is_a_config_error():
    """`cudnn` (or `efficient`) on a CPU: one error at build time naming the setting, not SDPA's "no viable backend"
    at the first step."""
    for backend, needs in (("cudnn", "NVIDIA GPUs"), ("efficient", "GPUs")):
        with pytest.raises(ConfigError, match=f"model.attention_backend={backend} runs on {needs} only.*cpu"):
            _model(GQA, backend)
    with pytest.raises(ConfigError, match="ROCm"):
        sdpa_backends("cudnn", "cuda", (9, 4), hip=True)
    assert sdpa_backends("efficient", "cuda", (9, 4), hip=True) == (SDPBackend.EFFICIENT_ATTENTION,)  # AOTriton's


def test_torch_keeps_its_own_order():
    model = _model(GQA, "torch")
    assert model.layers[0].attn.sdpa_backends is None
    assert CPU_FLASH in _ops_run(lambda: model(torch.zeros(1, 64, dtype=torch.long)))  # torch's first choice on CPU


def _is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper = pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU")


def _attention_and_grads(q, k, v, dout, backends):
    from megafp8.model.sdpa import attention_kernels
    with attention_kernels(backends):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               enable_gqa=k.shape[1] != q.shape[1])
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("d_qk,d_v,kv_heads", [(128, 128, 8), (128, 128, 2), (192, 128, 8)],
                         ids=["dense_heads", "grouped_query_heads", "mla_heads"])
def test_auto_attention_on_hopper_is_as_accurate_as_torchs_choice(d_qk, d_v, kv_heads):
    """`auto` (cuDNN first on Hopper) against torch's own choice, both against FP64 math on the same BF16 inputs:
    output and all three input gradients at most 1.5x torch's choice's error (plus 1e-4), in the layout our modules
    pass, for 8 query heads sharing 8 or 2 key/value heads and for MLA's narrower values."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(dim, heads=8):
        return torch.randn(2, 1024, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    q, dout = make(d_qk).requires_grad_(), make(d_v)
    k, v = make(d_qk, kv_heads).requires_grad_(), make(d_v, kv_heads).requires_grad_()
    want = _attention_and_grads(*(t.detach().double().requires_grad_() for t in (q, k, v)), dout.double(),
                                (SDPBackend.MATH,))

    def errors(backends):
        return [((got.double() - w).norm() / w.norm()).item()
                for got, w in zip(_attention_and_grads(q, k, v, dout, backends), want)]
    auto, torch_choice = errors(sdpa_backends_for("auto", torch.device("cuda"))), errors(None)
    assert all(a <= 1.5 * t + 1e-4 for a, t in zip(auto, torch_choice)), (auto, torch_choice)


def _attention_kernels_of_a_compiled_block(backend: str) -> tuple[list[str], list[str]]:
    """(cuDNN's, the others') attention kernels that a block compiled by Inductor with `backend` runs, forward and
    backward."""
    cfg = ModelConfig(vocab_size=256, hidden_size=512, num_layers=1, num_heads=4, ffn_hidden_size=1024,
                      attention_backend=backend)  # heads of 128
    model = Transformer(cfg, PrecisionRecipe.from_name("bf16"), 256, device=torch.device("cuda"))
    init_weights(model, cfg, 0)
    torch._dynamo.reset()
    compiled = torch.compile(model.layers[0]._forward, fullgraph=True)
    x = torch.randn(2 * 256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled(x, model.rope, 2, 256)[0].float().sum().backward()  # compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x, model.rope, 2, 256)[0].float().sum().backward()
        torch.cuda.synchronize()
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    attention = sorted(n for n in kernels if any(w in n.lower() for w in ("cudnn", "flash", "fmha", "sdpa")))
    cudnn = [n for n in attention if "cudnn" in n.lower()]  # cuDNN's own kernels are named "...flash..." too
    return cudnn, [n for n in attention if n not in cudnn]


@pytest.mark.gpu
@hopper
def test_the_choice_is_traced_into_a_compiled_block_on_hopper():
    """A block compiled by Inductor runs the chosen backend's kernels forward and backward: cuDNN's alone under `auto`,
    FlashAttention's and no cuDNN kernel under `flash` (so the choice is in the graph, not torch's own)."""
    cudnn, others = _attention_kernels_of_a_compiled_block("auto")
    assert len(cudnn) >= 2 and not others, (cudnn, others)
    cudnn, others = _attention_kernels_of_a_compiled_block("flash")
    assert not cudnn and any("flash" in n.lower() for n in others), (cudnn, others)
