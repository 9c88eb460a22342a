"""The MoE row permutations (`megafp8.parallel.permute`) and the FP8 quantizer that gathers rows into the padded
expert layout: their pure-torch definitions against plain autograd, on CPU. Their Triton kernels are checked
against these twins in tests/test_moe_gpu.py."""
from __future__ import annotations

import pytest
import torch

from megafp8.parallel.permute import (
    RowSource, combine_backward_reference, combine_reference, gather_rows, gather_sum_reference, weighted_combine,
)
from megafp8.precision.backends import backend_by_name
from megafp8.precision.formats import E4M3
from megafp8.precision.grouped import expert_rows, padded_source_index


def _rows(tokens: int, k: int, hidden: int, dtype=torch.float64, seed: int = 0) -> RowSource:
    g = torch.Generator().manual_seed(seed)
    source = torch.randn(tokens, hidden, generator=g, dtype=torch.float64).to(dtype)
    row_to_source = torch.randperm(tokens * k, generator=g) // k
    return RowSource(source, row_to_source, torch.argsort(row_to_source, stable=True).view(tokens, k))


def test_gather_rows_matches_indexing_and_its_backward_sums_each_token_once():
    rows = _rows(7, 3, 5)
    source = rows.source.clone().requires_grad_()
    out = gather_rows(RowSource(source, rows.row_to_source, rows.source_to_rows))
    assert torch.equal(out, rows.source[rows.row_to_source])
    torch.autograd.gradcheck(lambda s: gather_rows(RowSource(s, rows.row_to_source, rows.source_to_rows)),
                             (source,))


@pytest.mark.parametrize("by_blocks", [True, False])
def test_the_gather_as_one_op_gives_indexing_and_compiles_as_one_graph(monkeypatch, by_blocks):
    """With `permute.GATHER_ROWS_BY_BLOCKS` (the default since job GG) the dispatch's gather is the op
    `megafp8::gather_rows` (on CUDA the Triton copy walking row blocks first; its bytes are checked in
    tests/test_moe_gpu.py), without it `index_select`: either way the rows and the gradient of indexing, eagerly
    and compiled without a graph break."""
    from megafp8.parallel import permute
    monkeypatch.setattr(permute, "GATHER_ROWS_BY_BLOCKS", by_blocks)
    rows = _rows(40, 8, 256, dtype=torch.bfloat16, seed=1)
    run = lambda s: gather_rows(RowSource(s, rows.row_to_source, rows.source_to_rows))  # noqa: E731
    for fn in (run, torch.compile(run, backend="aot_eager", fullgraph=True)):
        source = rows.source.clone().requires_grad_()
        out = fn(source)
        assert torch.equal(out, rows.source[rows.row_to_source])
        dout = torch.randn_like(out)
        out.backward(dout)
        assert torch.equal(source.grad, gather_sum_reference(dout, rows.source_to_rows))


def test_gather_sum_adds_in_fp32_in_slot_order_and_rounds_once():
    rows = _rows(64, 4, 32, torch.bfloat16)
    d = torch.randn(256, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = gather_sum_reference(d, rows.source_to_rows)
    acc = torch.zeros(64, 32)
    for j in range(4):
        acc = acc + d[rows.source_to_rows[:, j]].float()
    assert torch.equal(got, acc.bfloat16())
    assert not torch.equal(got, sum(d[rows.source_to_rows[:, j]] for j in range(4)))  # BF16 adds would differ


def test_weighted_combine_is_the_weighted_sum_and_its_gradient():
    """Forward against the formula; both gradients by gradcheck (FP64); rows no token names get zero gradient."""
    g = torch.Generator().manual_seed(2)
    y = torch.randn(40, 6, generator=g, dtype=torch.float64, requires_grad=True)  # 30 rows used, 10 padding
    pos = torch.randperm(40, generator=g)[:30].view(10, 3)
    weights = torch.rand(10, 3, generator=g, dtype=torch.float64, requires_grad=True)
    out = weighted_combine(y, pos, weights)
    torch.testing.assert_close(out, (y[pos] * weights.unsqueeze(-1)).sum(dim=1))
    torch.autograd.gradcheck(lambda a, w: weighted_combine(a, pos, w), (y, weights))
    out.sum().backward()
    unused = torch.ones(40, dtype=torch.bool)
    unused[pos.reshape(-1)] = False
    assert not y.grad[unused].any() and y.grad[~unused].all()


def test_weighted_combine_in_bf16_sums_in_fp32():
    g = torch.Generator().manual_seed(4)
    y = torch.randn(24, 16, generator=g).bfloat16()
    pos = torch.randperm(24, generator=g).view(8, 3)
    weights = torch.rand(8, 3, generator=g)
    exact = (y[pos].double() * weights.double().unsqueeze(-1)).sum(dim=1)
    assert torch.equal(combine_reference(y, pos, weights), combine_reference(y, pos, weights))
    assert (combine_reference(y, pos, weights).double() - exact).abs().max() <= exact.abs().max() * 2**-8
    dout = torch.randn(8, 16, generator=g).bfloat16()
    dy, dweights = combine_backward_reference(dout, y, pos, weights)
    assert dy.dtype == torch.bfloat16 and dweights.dtype == torch.float32
    assert torch.equal(dy[pos[:, 1]], (dout.float() * weights[:, 1:2]).bfloat16())


@pytest.mark.parametrize("counts", [[5, 0, 130], [128, 1, 0, 256]])
def test_the_gathering_quantizer_gives_the_quantizer_of_the_padded_rows(counts):
    """Rows gathered from their tokens straight into the padded expert layout (zero rows between experts) and
    quantized both ways: the same bytes and scales as quantizing the padded copy."""
    k = 2 if sum(counts) % 2 == 0 else 1
    rows = _rows(sum(counts) // k, k, 256, torch.bfloat16)
    layout = expert_rows(counts, torch.device("cpu"))
    index = padded_source_index(layout, rows.row_to_source)
    assert index.shape == (layout.total,) and int((index < 0).sum()) == layout.total - sum(counts)
    padded = rows.source.new_zeros(layout.total, 256).index_copy_(0, layout.index,
                                                                  rows.source[rows.row_to_source])
    backend = backend_by_name("reference")
    got = backend.gather_quantize_rows_cols(rows.source, index, E4M3, False)
    want = backend.quantize_rows_cols(padded, E4M3, False)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
