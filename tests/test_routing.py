"""The MoE router's group-limited top-k (`megafp8.parallel.routing`): the Triton kernel, run by Triton's CPU
interpreter and on the GPU, against its pure-torch twin; the twin against a plain per-token definition; where the
kernel runs. The router's use of it: `tests/test_moe.py`."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megafp8.parallel.routing import group_limited_topk, group_limited_topk_reference, kernel_fits
from tests.scripts import run_in_triton_interpreter

REPO = Path(__file__).resolve().parents[1]
# (experts, n_group, topk_group, top_k): the MoE benchmark's, DeepSeek-V3's, the tiny configs', ungrouped, and
# groups of one expert (a group scores its best alone)
CASES = [(64, 8, 4, 8), (256, 8, 4, 8), (8, 4, 2, 2), (64, 1, 1, 6), (16, 16, 4, 2)]


def _by_definition(choice: torch.Tensor, n_group: int, topk_group: int, top_k: int) -> torch.Tensor:
    """Token by token, in plain Python: what the routing means (no ties in `choice`)."""
    rows = []
    for scores in choice.tolist():
        per_group = len(scores) // n_group
        groups = [sorted(scores[g * per_group:(g + 1) * per_group], reverse=True) for g in range(n_group)]
        group_score = [sum(g[:2]) for g in groups] if n_group > 1 else [0.0]
        kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group] if n_group > 1 else [0]
        allowed = [e for e in range(len(scores)) if e // per_group in kept]
        rows.append(sorted(allowed, key=lambda e: -scores[e])[:top_k])
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_the_twin_chooses_as_the_definition_says(case):
    e, n_group, topk_group, top_k = case
    assert group_limited_topk_reference(torch.empty(0, e), n_group, topk_group, top_k).shape == (0, top_k)
    choice = torch.rand(40, e, generator=torch.Generator().manual_seed(e + n_group))
    torch.testing.assert_close(group_limited_topk_reference(choice, n_group, topk_group, top_k),
                               _by_definition(choice, n_group, topk_group, top_k), rtol=0, atol=0)
    # off CUDA the op is the twin
    assert torch.equal(group_limited_topk(choice, n_group, topk_group, top_k),
                       group_limited_topk_reference(choice, n_group, topk_group, top_k))


def test_the_kernel_takes_only_the_shapes_it_is_written_for(monkeypatch):
    """Powers of two of experts (up to 1024) in groups of a power of two, FP32 with unit column stride, on CUDA:
    anything else runs the twin."""
    from megafp8.parallel import routing
    monkeypatch.setattr(routing, "triton_runs_on", lambda device: True)

    class _Cuda:  # the attributes kernel_fits reads, of a CUDA tensor
        def __init__(self, shape, dtype=torch.float32, column_stride=1, cuda=True):
            self.shape, self.dtype, self.is_cuda, self.device = shape, dtype, cuda, "cuda"
            self._stride = column_stride

        def dim(self):
            return len(self.shape)

        def stride(self, dim):
            return self._stride

    assert kernel_fits(_Cuda((5, 64)), 8) and kernel_fits(_Cuda((5, 256)), 1) and kernel_fits(_Cuda((5, 16)), 16)
    for tensor, n_group in [(_Cuda((5, 96)), 8), (_Cuda((5, 64)), 3), (_Cuda((5, 192)), 3),
                            (_Cuda((5, 2048)), 8), (_Cuda((5, 64), torch.bfloat16), 8),
                            (_Cuda((5, 64), column_stride=2), 8), (_Cuda((5, 64), cuda=False), 8),
                            (_Cuda((5, 0)), 1)]:
        assert not kernel_fits(tensor, n_group), (tensor.shape, tensor.dtype, n_group)


INTERPRETED = r'''
import torch
from megafp8.parallel import routing_kernels as k
from megafp8.parallel.routing import group_limited_topk_reference

CASES = %s
for e, n_group, topk_group, top_k in CASES:
    torch.manual_seed(e + top_k)
    rows = 2 * max(1, k.ELEMENTS_PER_PROGRAM // e) + 3  # two whole blocks of tokens and a masked one
    choice = torch.randn(rows, e)
    got = k.group_limited_topk(choice, n_group, topk_group, top_k)
    want = group_limited_topk_reference(choice, n_group, topk_group, top_k)
    assert got.dtype == torch.int64 and torch.equal(got, want), (e, n_group, (got != want).nonzero()[:5])
    # a strided view (a row stride past the experts)
    wide = torch.randn(rows, 2 * e)
    assert torch.equal(k.group_limited_topk(wide[:, :e], n_group, topk_group, top_k),
                       group_limited_topk_reference(wide[:, :e], n_group, topk_group, top_k))

e, n_group, topk_group, top_k = 64, 8, 4, 8
# ties: equal scores go to the lower group and the lower expert, best first
equal = torch.full((3, e), 0.25)
assert torch.equal(k.group_limited_topk(equal, n_group, topk_group, top_k), torch.arange(top_k).expand(3, top_k))
# a group's two best may be one value twice; the group with the larger sum still wins
twice = torch.zeros(1, e)
twice[0, 8:10] = 0.5  # group 1: 0.5 + 0.5
twice[0, 0] = 0.9  # group 0: 0.9 + 0
chosen = k.group_limited_topk(twice, n_group, 1, 2)
assert chosen.tolist() == [[8, 9]], chosen
# nan ranks above every number (as torch.topk ranks it); -inf rows still give distinct experts
odd = torch.rand(3, e)
odd[0, 37] = float("nan")
odd[1] = float("-inf")
odd[2, :] = -0.0
odd[2, 5] = 0.0
chosen = k.group_limited_topk(odd, n_group, topk_group, top_k)
assert chosen[0, 0].item() == 37, chosen[0]
assert torch.equal(group_limited_topk_reference(odd[:1], n_group, topk_group, top_k)[0, 0], chosen[0, 0])
for row in chosen.tolist():
    assert len(set(row)) == top_k and all(0 <= c < e for c in row), row
assert chosen[2, 0].item() == 5  # +0.0 above -0.0
# a real -inf in a kept group ranks above the experts of dropped groups
minus_inf = torch.tensor([[1.0, 1.0, 1.0, 1.0, 5.0, 4.0, float("-inf"), 3.0]])  # group 0 dropped
assert k.group_limited_topk(minus_inf, 2, 1, 4).tolist() == [[4, 5, 7, 6]]
assert k.group_limited_topk(torch.empty(0, e), n_group, topk_group, top_k).shape == (0, top_k)
print("ok")
'''


def test_the_kernel_chooses_as_its_twin_in_the_interpreter(tmp_path):
    """The Triton kernel, run by Triton's CPU interpreter, against the twin on every case (whole and partial blocks
    of tokens, a row stride past the experts), and its own rules where the twin leaves them open: ties to the lower
    index, nan first, distinct experts from rows of -inf."""
    run_in_triton_interpreter(tmp_path, INTERPRETED % (CASES,))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_the_kernel_on_the_gpu_chooses_as_its_twin(case):
    """On CUDA the router runs the kernel: the twin's choice on 16k tokens of sigmoid scores plus a bias (as the
    router makes them), also under torch.compile. Where a token's scores tie, `torch.topk` may order the equal
    experts otherwise: there the chosen scores must still be the twin's, best first."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    e, n_group, topk_group, top_k = case
    g = torch.Generator(device="cuda").manual_seed(e)
    choice = (torch.randn(16384, e, device="cuda", generator=g).sigmoid()
              + torch.randn(e, device="cuda", generator=g) * 1e-3)
    assert kernel_fits(choice, n_group)
    want = group_limited_topk_reference(choice, n_group, topk_group, top_k)
    compiled = torch.compile(lambda c: group_limited_topk(c + 0.0, n_group, topk_group, top_k), fullgraph=True)
    for got in (group_limited_topk(choice, n_group, topk_group, top_k), compiled(choice)):
        differing = (got != want).any(dim=1)
        assert differing.sum() <= 16, int(differing.sum())  # ties are rare in these scores
        assert torch.equal(choice[differing].gather(1, got[differing]), choice[differing].gather(1, want[differing]))
