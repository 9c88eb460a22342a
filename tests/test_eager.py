"""`megafp8.precision.eager`: the package imports without torch's compiler, and its lazy `run_eagerly` and
`mark_static_address` do what `torch.compiler.disable` and `torch._dynamo.mark_static_address` do."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megafp8.precision.eager import mark_static_address, run_eagerly
from tests.conftest import REPO


def run_python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_the_trainer_and_its_model_import_without_the_compiler():
    """torch._dynamo costs ~2.5 s of CPU to import: each process that builds a model without compiling it (data
    and conversion tools, every rank of an eager run) paid it when a decorator or torch's pipelining imported it."""
    loaded = run_python("import sys, megafp8.train.trainer, megafp8.train.build, megafp8.checkpoint.convert; "
                        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    assert loaded == "[]"


# A training step of an FP8 MoE model (routing, permutation, grouped experts, FP8 quantizers, cross-entropy: the
# package's custom ops and its functions run eagerly), evaluated once under meta tensors' shapes.
EAGER_STEP = """
import sys, torch
from megafp8.config import load_config
from megafp8.precision import PrecisionRecipe
from megafp8.train.build import build_model
cfg = load_config("tiny_moe_fp8", ["model.vocab_size=384", "model.num_layers=2", "data.seq_len=32"])
model = build_model(cfg, cfg.model, PrecisionRecipe.from_config(cfg.precision), torch.device("cpu"))
tokens = torch.randint(0, 384, (2, 32))
model.loss_terms(tokens, tokens.roll(-1, 1)).total.backward()
grads = sum(p.grad is not None or getattr(p, "main_grad", None) is not None for p in model.parameters())
from megafp8.parallel.cross_entropy import _row_stats_op
meta = _row_stats_op(torch.empty(4, 8, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"))
print(grads, [tuple(t.shape) for t in meta], sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_an_eager_training_step_runs_without_loading_the_compiler():
    """Eager ranks and tools never compile: torch's lazy wrappers (a custom op's dispatch, `_disable_dynamo`) imported
    `torch._dynamo` at the first loss (~1-2.5 s a process). `run_eagerly` and `EagerCustomOp` call the functions
    themselves until it is loaded; a meta tensor still goes through the op (its fake function)."""
    out = run_python(EAGER_STEP).splitlines()[-1]
    assert out.endswith("[(4,), (4,), (4,)] []"), out
    assert int(out.split(" ")[0]) > 0


def _eager_seen(trace: list):
    def inner(x: torch.Tensor) -> torch.Tensor:  # called from the function run eagerly: eager too (recursive)
        trace.append(("inner", torch.compiler.is_compiling()))
        return x * 2

    def data_dependent(x: torch.Tensor) -> torch.Tensor:
        trace.append(("outer", torch.compiler.is_compiling()))
        return inner(x) if x.sum().item() > 0 else -x  # a host read: untraceable without a graph break

    return data_dependent


@pytest.mark.parametrize("decorate", [run_eagerly, torch.compiler.disable], ids=["run_eagerly", "torch"])
def test_a_function_run_eagerly_breaks_the_graph_and_runs_eagerly_inside_compiled_code(decorate):
    torch._dynamo.reset()
    trace: list = []
    eager = decorate(_eager_seen(trace))

    def f(x: torch.Tensor) -> torch.Tensor:
        return eager(torch.sin(x) + 1) * 3

    x = torch.rand(8) + 0.5
    explained = torch._dynamo.explain(f)(x)
    assert (explained.graph_count, explained.graph_break_count) == (2, 1)
    trace.clear()
    torch.testing.assert_close(torch.compile(f, backend="eager")(x), f(x))
    assert trace == [("outer", False), ("inner", False)] * 2  # the compiled call, then the eager one


def test_the_static_mark_made_before_the_compiler_is_loaded_is_the_compilers():
    marks = run_python(
        "import sys, torch; from megafp8.precision.eager import mark_static_address\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "ours, theirs = torch.zeros(2), torch.zeros(2); mark_static_address(ours)\n"
        "import torch._dynamo; torch._dynamo.mark_static_address(theirs, guard=False)\n"
        "print(ours.__dict__ == theirs.__dict__ != {})")
    assert marks == "True"
    loaded, theirs = torch.zeros(2), torch.zeros(2)  # with the compiler loaded (as in this process): its own call
    mark_static_address(loaded)
    torch._dynamo.mark_static_address(theirs, guard=False)
    assert loaded.__dict__ == theirs.__dict__ != {}
