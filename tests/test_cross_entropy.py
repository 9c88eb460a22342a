"""The loss without an FP32 copy of the logits (`megafp8.parallel.cross_entropy`): against `F.cross_entropy` on the
CPU (its pure-torch twins), its Triton kernels in Triton's CPU interpreter and on the GPU. Tensor parallelism
against TP=1: `tests/test_tensor_parallel.py::test_vocab_parallel_embedding_and_loss_match_unsharded`."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megafp8.parallel import IGNORE_INDEX, vocab_parallel_cross_entropy
from megafp8.parallel.cross_entropy import logits_grad_reference, row_stats_reference
from tests.scripts import run_in_triton_interpreter

REPO = Path(__file__).resolve().parents[1]


def _inputs(rows: int, vocab: int, dtype: torch.dtype, device="cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).to(device)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[::7] = IGNORE_INDEX
    return logits, targets.to(device)


def _loss_and_grad(fn, logits, targets):
    x = logits.clone().requires_grad_(True)
    loss = fn(x, targets)
    loss.backward()
    return loss.detach(), x.grad


def _torch_loss(x, targets):
    return F.cross_entropy(x.float(), targets, ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loss_and_gradient_match_torchs_cross_entropy(dtype):
    """Mean loss over the counted targets within FP32 rounding; the gradient within one rounding to the logits'
    dtype (1,100 rows: the twins' row chunks end mid-batch; every seventh target ignored)."""
    logits, targets = _inputs(1100, 515, dtype)
    loss, grad = _loss_and_grad(vocab_parallel_cross_entropy, logits, targets)
    ref_loss, ref_grad = _loss_and_grad(_torch_loss, logits, targets)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=rtol, atol=1e-9)
    assert torch.all(grad[targets == IGNORE_INDEX] == 0)


def test_every_target_ignored_gives_zero_loss_and_no_gradient():
    logits, targets = _inputs(16, 300, torch.bfloat16)
    loss, grad = _loss_and_grad(vocab_parallel_cross_entropy, logits, torch.full_like(targets, IGNORE_INDEX))
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0


def test_a_confident_prediction_keeps_its_small_loss():
    """Logits near 3e4 whose target leads the other 999 by 10: the loss is log(1 + 999 exp(-10)) = 0.0444. Written as
    log(sum) + (max - x_target) it keeps FP32's relative precision; lse - x_target, both ~30010, would keep only
    their 0.002 spacing (4% of the loss)."""
    logits = torch.full((4, 1000), 30000.0)
    logits[:, 3] += 10.0
    targets = torch.full((4,), 3)
    expected = torch.log1p(999 * torch.exp(torch.tensor(-10.0, dtype=torch.float64))).item()
    loss = vocab_parallel_cross_entropy(logits, targets)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_minus_inf_logits_count_nothing_and_a_nan_logit_makes_the_loss_nan():
    logits, targets = _inputs(8, 300, torch.float32)
    logits[:, :100] = float("-inf")  # e.g. a masked vocabulary: whole chunks of -inf
    targets = targets.clamp(min=100)
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, targets), _torch_loss(logits, targets),
                               rtol=1e-6, atol=0)
    logits[2, 150] = float("nan")
    assert torch.isnan(vocab_parallel_cross_entropy(logits, targets))


def test_keeps_the_logits_and_a_few_numbers_per_token_not_an_fp32_softmax():
    """What autograd keeps for backward: the BF16 logits and 13 bytes a token (targets, log-sum-exp, the mask), where
    F.cross_entropy on FP32 logits keeps their log-softmax (4 bytes a logit)."""
    logits, targets = _inputs(64, 4096, torch.bfloat16)
    x = logits.clone().requires_grad_(True)
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_cross_entropy(x, targets)
    assert sum(kept.values()) <= x.numel() * 2 + 64 * 13 + 64, kept


def test_the_kernels_run_only_where_triton_supports_the_gpu(monkeypatch):
    """Compute capability 8.0 and up with Triton installed: the kernels; the FP16 recipe's V100s and T4s, ROCm, or
    no Triton: the twins."""
    import importlib.util
    from megafp8.precision import triton_support
    cuda = torch.device("cuda", 0)
    cases = [((9, 0), None, True, True), ((8, 0), None, True, True), ((7, 5), None, True, False),
             ((7, 0), None, True, False), ((9, 0), "6.2", True, False), ((9, 0), None, False, False)]
    for capability, hip, has_triton, expected in cases:
        triton_support.triton_runs_on.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, t=has_triton: object() if t else None)
        assert triton_support.triton_runs_on(cuda) is expected, (capability, hip, has_triton)
    triton_support.triton_runs_on.cache_clear()


INTERPRETED = r'''
import sys
import torch
from megafp8.parallel import cross_entropy_kernels as k
from megafp8.parallel.cross_entropy import logits_grad_reference, row_stats_reference

torch.manual_seed(0)
rows, vocab = 6, k.STATS_BLOCK + 904  # a whole chunk and a masked one
x = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
x[1, :k.STATS_BLOCK] = float("-inf")  # a first chunk of -inf only
target = torch.tensor([5, vocab - 1, -3, vocab, 0, k.STATS_BLOCK])  # two outside this rank's columns
got, want = k.row_stats(x, target), row_stats_reference(x, target)
for name, a, b in zip(("max", "sum", "target logit"), got, want):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=name)
lse = want[0] + want[1].log()
dloss = torch.linspace(0.5, 2.0, rows)
g, r = k.logits_grad(x, lse, target, dloss), logits_grad_reference(x, lse, target, dloss)
assert g.dtype == torch.bfloat16
torch.testing.assert_close(g.float(), r.float(), rtol=2 ** -7, atol=1e-12)
print("ok")
'''


def test_the_kernels_give_their_twins_results_in_the_interpreter(tmp_path):
    """Both Triton kernels, run by Triton's CPU interpreter, against their pure-torch twins: a row longer than one
    chunk with a masked tail, a chunk of -inf only, targets outside the rank's columns, per-token loss gradients."""
    run_in_triton_interpreter(tmp_path, INTERPRETED)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32768, 50257])
def test_the_kernels_on_the_gpu_match_their_twins_and_torch(vocab):
    """On CUDA the loss runs the Triton kernels: their per-row numbers and gradient against the twins (FP32 sums
    in another order, the exponential's last bits), and the mean loss and gradient against F.cross_entropy."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megafp8.parallel import cross_entropy_kernels as k
    logits, targets = _inputs(2048, vocab, torch.bfloat16, "cuda")
    local = targets.masked_fill(targets == IGNORE_INDEX, 0)
    for name, a, b in zip(("max", "sum", "target logit"), k.row_stats(logits, local),
                          row_stats_reference(logits, local)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0, msg=name)
    stats = row_stats_reference(logits, local)
    lse = stats[0] + stats[1].log()
    dloss = torch.rand(2048, device="cuda")
    torch.testing.assert_close(k.logits_grad(logits, lse, local, dloss).float(),
                               logits_grad_reference(logits, lse, local, dloss).float(), rtol=2 ** -7, atol=1e-12)
    loss, grad = _loss_and_grad(vocab_parallel_cross_entropy, logits, targets)
    ref_loss, ref_grad = _loss_and_grad(_torch_loss, logits, targets)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2 ** -7, atol=1e-10)
