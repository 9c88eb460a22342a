"""`run_eagerly` and `eager_custom_op`: `torch.compiler.disable` and `torch.library.custom_op` without importing
`torch._dynamo` in processes that never compile.

`torch.compiler.disable` imports `torch._dynamo` at once, and a dozen of the package's functions carry it as a
decorator: so every process that imported a model paid for the compiler (~1-2.5 s of CPU on a 2-core machine),
whether it compiled or not, and most never do (data tools, conversion, every rank of an eager run, each test's
subprocesses). `torch._disable_dynamo` is torch's own lazy form of the same decorator: its first call imports
`torch._dynamo` and wraps the function with `torch._dynamo.disable`; compiled code that reaches the wrapper breaks
its graph there and runs the function, and everything it calls, eagerly, as under `torch.compiler.disable`
(`tests/test_eager.py` compiles the same function with each and compares the graphs, the breaks and what ran
eagerly). The dispatcher runs every custom op's Python function under that lazy wrapper too, so the first loss of an
eager run still imported the compiler. Both wrappers here call the function itself while the compiler is not loaded
(`compiler_may_run`): then no frame can be traced or run compiled, so there is nothing to turn off.

`mark_static_address` is `torch._dynamo.mark_static_address(t, guard=False)` for tensors marked before anything
was compiled (FP8 weight caches, made with the model): the mark is an attribute Dynamo reads when it traces, set
the way Dynamo sets it. `tests/test_eager.py` holds them: the package imports, and an FP8 MoE training step runs,
without the compiler; a wrapped function runs eagerly inside compiled code; and the mark is Dynamo's.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, TypeVar

import torch

_F = TypeVar("_F", bound=Callable)


def compiler_may_run() -> bool:
    """Whether Dynamo may be tracing or running compiled code now: it is (constant-folded while tracing), or the
    compiler is loaded. Where it is not loaded, no frame can be traced and nothing needs turning off."""
    return torch.compiler.is_compiling() or "torch._dynamo" in sys.modules


def run_eagerly(fn: _F) -> _F:
    """`fn` run eagerly (Dynamo off, recursively) wherever it is called, also from compiled code: a graph break at
    the call. Use it as `torch.compiler.disable` without arguments. Until the compiler is loaded it calls `fn`
    itself (torch's lazy wrapper would import `torch._dynamo` at the first call, ~1-2.5 s of CPU)."""
    disabled = torch._disable_dynamo(fn, recursive=True)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return disabled(*args, **kwargs) if compiler_may_run() else fn(*args, **kwargs)

    return run  # type: ignore[return-value]


class EagerCustomOp:
    """A `torch.library.custom_op` whose calls, until the compiler is loaded, run its Python function directly.

    The dispatcher runs a custom op's function under torch's lazy `_disable_dynamo`, whose first call imports
    `torch._dynamo` (~1-2.5 s of CPU), so every eager process paid for the compiler at its first loss. Where no
    graph can be traced (the compiler not loaded, no dispatch mode such as fake tensors active, no meta tensor) the
    dispatcher would only call the function: this calls it, without gradient tracking, as the op records none (no
    op here registers an autograd formula; callers differentiate them in `autograd.Function`s). Elsewhere the op."""

    def __init__(self, name: str, fn: Callable, mutates_args: tuple[str, ...]) -> None:
        self.fn = fn
        self.op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if compiler_may_run() or torch._C._len_torch_dispatch_stack() or any(
                isinstance(a, torch.Tensor) and a.is_meta for a in (*args, *kwargs.values())):
            return self.op(*args, **kwargs)
        with torch.no_grad():
            return self.fn(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        """The op's shapes-only function, as `CustomOpDef.register_fake`."""
        return self.op.register_fake(fake)


def eager_custom_op(name: str, *, mutates_args: tuple[str, ...] | str = ()) -> Callable[[Callable], EagerCustomOp]:
    """`torch.library.custom_op(name, mutates_args=...)` as a decorator, giving an `EagerCustomOp`."""
    return lambda fn: EagerCustomOp(name, fn, mutates_args)


def mark_static_address(t: torch.Tensor) -> None:
    """`torch._dynamo.mark_static_address(t, guard=False)`: compiled code (CUDA graphs) uses `t`'s address as it is
    instead of copying `t` into a buffer of its own, and a new address re-records rather than recompiles."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.mark_static_address(t, guard=False)
    else:  # nothing compiled yet: the attribute torch._dynamo.mark_static_address sets (guard=False)
        t._dynamo_static_input_type = "unguarded"
