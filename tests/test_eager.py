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
