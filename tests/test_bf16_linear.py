"""The high-precision linear (`megafp8.precision.bf16_linear`): its weight gradient goes into the weight's FP32
`main_grad` inside backward (by the GEMM itself on CUDA; the product, then the add, on the CPU), deferred to a
queue, or, traced by torch.compile, into the alias a `MainGradSlot` hands out."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megafp8.config import load_config
from megafp8.parallel import ColumnParallelLinear, ParallelDims, RowParallelLinear
from megafp8.precision import MainGradSlot, PrecisionRecipe, WeightGradQueue, linear
from megafp8.precision.bf16_linear import accumulate_product_, fused_accumulation_reason
from megafp8.train import Trainer

CPU = torch.device("cpu")


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(96, 64, generator=g) * 0.05).bfloat16()
    xs = [torch.randn(2, 40, 64, generator=g).bfloat16() for _ in range(2)]
    dys = [torch.randn(2, 40, 96, generator=g).bfloat16() for _ in range(2)]
    return w0, xs, dys


def _autograd_reference(w0, xs, dys):
    """What autograd and the gradient buffer's hook did before: BF16 dw per micro-batch, added into FP32."""
    w = torch.nn.Parameter(w0.clone())
    main_grad, dxs = torch.zeros(w.shape), []
    for x, dy in zip(xs, dys):
        x = x.clone().requires_grad_(True)
        F.linear(x, w).backward(dy)
        main_grad.add_(w.grad)
        w.grad = None
        dxs.append(x.grad)
    return main_grad, dxs


def test_the_weight_gradient_goes_into_main_grad_with_autograds_bits_on_the_cpu():
    """Eagerly, two micro-batches: no gradient returned to autograd, main_grad holds exactly what autograd's BF16
    dw added by the hook held (the CPU keeps that path), and the input gradients are autograd's."""
    w0, xs, dys = _operands()
    want_main_grad, want_dxs = _autograd_reference(w0, xs, dys)
    w = torch.nn.Parameter(w0.clone())
    w.main_grad = torch.zeros(w.shape)
    for x, dy, want_dx in zip(xs, dys, want_dxs):
        x = x.clone().requires_grad_(True)
        linear(x, w).backward(dy)
        assert torch.equal(x.grad, want_dx)
    assert w.grad is None
    assert torch.equal(w.main_grad, want_main_grad)


def test_a_queue_defers_the_accumulation_until_it_runs():
    w0, xs, dys = _operands(1)
    want_main_grad, _ = _autograd_reference(w0, xs, dys)
    w = torch.nn.Parameter(w0.clone())
    w.main_grad = torch.zeros(w.shape)
    queue = WeightGradQueue()
    for x, dy in zip(xs, dys):
        linear(x.clone().requires_grad_(True), w, queue).backward(dy)
    assert len(queue) == 2 and not w.main_grad.any() and w.grad is None
    queue.take()()
    assert torch.equal(w.main_grad, want_main_grad)


def test_without_main_grad_the_gradient_goes_to_autograd():
    w0, xs, dys = _operands(2)
    w = torch.nn.Parameter(w0.clone())
    linear(xs[0], w).backward(dys[0])
    want = torch.nn.Parameter(w0.clone())
    F.linear(xs[0], want).backward(dys[0])
    assert torch.equal(w.grad, want.grad)


def test_compiled_it_adds_into_the_slots_alias_inside_the_graph():
    """Traced (fullgraph): a refreshed slot's alias receives the weight gradient inside the backward graph, across
    two micro-batches run forward, forward, backward, backward (each forward its own alias); main_grad ends with
    the eager bits and autograd gets no gradient. An unrefreshed slot leaves dw to autograd."""
    w0, xs, dys = _operands(3)
    want_main_grad, _ = _autograd_reference(w0, xs, dys)

    def run(refresh: bool) -> torch.nn.Parameter:
        w = torch.nn.Parameter(w0.clone())
        w.main_grad = torch.zeros(w.shape)
        slot = MainGradSlot()
        fn = torch.compile(lambda x: linear(x, w, None, slot), backend="aot_eager", fullgraph=True)
        outputs = []
        for x in xs:
            if refresh:
                slot.refresh(w)
            outputs.append(fn(x.clone().requires_grad_(True)))
        for y, dy in zip(outputs, dys):
            y.backward(dy)
        return w
    torch._dynamo.reset()
    w = run(refresh=True)
    assert w.grad is None and torch.equal(w.main_grad, want_main_grad)
    torch._dynamo.reset()
    w = run(refresh=False)
    assert w.grad is not None and not w.main_grad.any()
    torch._dynamo.reset()


def test_the_cpu_and_unsupported_dtypes_take_the_product_then_the_add():
    """Where no fused accumulation exists the product is rounded to the operands' dtype and then added: the bits of
    autograd's dw plus the hook's add."""
    assert fused_accumulation_reason(CPU, torch.bfloat16) is not None
    assert fused_accumulation_reason(torch.device("cuda"), torch.int8) is not None
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(24, 40, generator=g).bfloat16(), torch.randn(40, 16, generator=g).bfloat16()
    out = torch.randn(24, 16, generator=g)
    want = out + (a @ b).float()
    accumulate_product_(out, a, b)
    assert torch.equal(out, want)


@pytest.mark.parametrize("layer_type", [ColumnParallelLinear, RowParallelLinear])
def test_a_bf16_parallel_linear_points_its_slot_at_a_fresh_alias_of_main_grad(layer_type):
    layer = layer_type(128, 256, PrecisionRecipe.from_name("bf16"))
    layer.prepare_for_compiled()
    assert layer.main_grad_slot.alias is None  # no main_grad yet
    layer.weight.main_grad = torch.zeros(layer.weight.shape)
    layer.prepare_for_compiled()
    alias = layer.main_grad_slot.alias
    assert alias is not None and alias.data_ptr() == layer.weight.main_grad.data_ptr()
    version = alias._version
    layer.weight.main_grad.add_(1.0)  # another micro-batch's backward: the alias keeps its own version counter
    assert alias._version == version and alias is not layer.weight.main_grad
    assert bool((alias == 1.0).all())  # over the same memory


def test_a_compiled_bf16_training_run_gives_the_eager_runs_gradients(tiny_overrides, monkeypatch):
    """Whole BF16 steps with compiled blocks (CPU Inductor), where every block linear adds into its slot's alias:
    the same losses and gradient norms as eager steps, four micro-batches a step, and every linear's weight
    gradient added into main_grad by `accumulate_product_` (inside the graphs for the blocks' linears) once per
    micro-batch, as eagerly."""
    import megafp8.precision.bf16_linear as linear_module
    from megafp8.parallel import ParallelLinear
    runs, calls = {}, []
    real = linear_module.accumulate_product_
    monkeypatch.setattr(linear_module, "accumulate_product_", lambda *args: calls.append(1) or real(*args))
    for compiled in (False, True):
        cfg = load_config("tiny_dense", tiny_overrides + [
            "precision.recipe=bf16", "training.steps=3", "training.eval_interval=0",
            f"training.compile={str(compiled).lower()}"])
        torch._dynamo.reset()
        calls.clear()
        trainer = Trainer(cfg, ParallelDims.single(), CPU)
        runs[compiled] = [r for r in trainer.fit() if r["kind"] == "train"]
        linears = [m for m in trainer.model.modules() if isinstance(m, ParallelLinear)]
        micro_batches = cfg.training.global_batch_size // cfg.training.micro_batch_size
        assert len(calls) == 3 * micro_batches * len(linears), (compiled, len(calls), len(linears))
        if compiled:
            block_slots = [m.main_grad_slot for block in trainer.model.layers.values()
                           for m in block.prepared_linears]
            assert block_slots and all(s.alias is not None for s in block_slots)
    torch._dynamo.reset()
    for eager, compiled in zip(runs[False], runs[True]):
        assert compiled["loss"] == pytest.approx(eager["loss"], rel=5e-3)
        assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=2e-2)


@pytest.mark.parametrize("worker_thread", [False, True])
def test_the_training_step_runs_backward_where_configured(tiny_overrides, worker_thread):
    """`training.backward_on_worker_thread` reaches autograd: backward sees multithreading disabled (it then runs on
    the training loop's thread; on a CPU it always does) unless the option asks for torch's worker threads."""
    cfg = load_config("tiny_dense", tiny_overrides + [
        "training.steps=1", "optimizer.warmup_steps=1", "training.eval_interval=0",
        f"training.backward_on_worker_thread={str(worker_thread).lower()}"])
    trainer = Trainer(cfg, ParallelDims.single(), CPU)
    seen = []
    trainer.model.layers[0].mlp_norm.weight.register_hook(
        lambda g: seen.append(torch._C._is_multithreading_enabled()))
    before = torch._C._is_multithreading_enabled()
    trainer.train_step()
    assert seen and set(seen) == {worker_thread}
    assert torch._C._is_multithreading_enabled() == before  # restored after the step
