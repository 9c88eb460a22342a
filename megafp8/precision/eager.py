"""`run_eagerly`: `torch.compiler.disable` without importing `torch._dynamo` when the package is imported.

`torch.compiler.disable` imports `torch._dynamo` at once, and a dozen of the package's functions carry it as a
decorator: so every process that imported a model paid for the compiler (~2.5 s of CPU on a 2-core machine, half
of the import), whether it compiled or not, and most never do (data tools, conversion, every rank of an eager run,
each test's subprocesses). `torch._disable_dynamo` is torch's own lazy form of the same decorator (torch applies it
to its functions for this reason): the first call imports `torch._dynamo` and wraps the function with
`torch._dynamo.disable`; compiled code that reaches the wrapper breaks its graph there and runs the function, and
everything it calls, eagerly, as under `torch.compiler.disable` (`tests/test_eager.py` compiles the same function
with each and compares the graphs, the breaks and what ran eagerly).

`mark_static_address` is `torch._dynamo.mark_static_address(t, guard=False)` for tensors marked before anything
was compiled (FP8 weight caches, made with the model): the mark is an attribute Dynamo reads when it traces, set
the way Dynamo sets it. `tests/test_eager.py` holds all three: the package imports without the compiler, a wrapped
function runs eagerly inside compiled code, and the mark is Dynamo's.
"""
from __future__ import annotations

import sys
from typing import Callable, TypeVar

import torch

_F = TypeVar("_F", bound=Callable)


def run_eagerly(fn: _F) -> _F:
    """`fn` run eagerly (Dynamo off, recursively) wherever it is called, also from compiled code: a graph break at
    the call. Use it as `torch.compiler.disable` without arguments."""
    return torch._disable_dynamo(fn, recursive=True)


def mark_static_address(t: torch.Tensor) -> None:
    """`torch._dynamo.mark_static_address(t, guard=False)`: compiled code (CUDA graphs) uses `t`'s address as it is
    instead of copying `t` into a buffer of its own, and a new address re-records rather than recompiles."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.mark_static_address(t, guard=False)
    else:  # nothing compiled yet: the attribute torch._dynamo.mark_static_address sets (guard=False)
        t._dynamo_static_input_type = "unguarded"
