"""Launching our Triton and Gluon kernels with less host time: Triton's JIT once per static signature, then the
compiled kernel directly.

A launch through Triton's JIT (`kernel[grid](*args, **constexprs)`) specializes every argument again, builds the
cache key, checks the globals the kernel read and validates each TMA descriptor: ~100-140 us of host time a call for
our warp-specialized GEMM, 4-5 times `F.scaled_mm`'s launch (`benchmarks/fp8_launch_cost.py`; ~58 us this way,
`docs/performance.md`). Eagerly, a small FP8 layer is bound by that. `FastLaunch` runs the JIT path the first time
it sees a call's static signature and keeps the compiled kernel it returns; later calls with the same signature
launch that kernel with the same arguments (Triton's `CompiledKernel.run`, what the JIT path ends in), with their
descriptors made without the checks the first call's passed.

The static signature is finer than Triton's specialization, so two calls that share it get the same compiled
kernel from Triton too: Triton's active driver and device; every integer's value (Triton specializes on 1, on
divisibility by 16 and on the integer's width); other plain arguments by type and value (a bool is not 1); every
tensor's dtype and address modulo 16 (Triton's only pointer specialization, its 16-byte alignment); every
descriptor's dtype, shape, strides, address modulo 16, box and layout; every constexpr and launch option, numbers,
bools and strings by value and other objects (layouts, dtypes) by identity; and the Triton knobs the JIT path reads
per launch (debug, instrumentation). A cache entry holds the objects whose identities its key uses (driver,
layouts, constexprs) alive, so an identity cannot be reused; a kernel stops adding signatures past
`FastLaunch.MAX_SIGNATURES` (a caller making an equal layout anew at each call only misses the cache). The grid is
an argument of each launch, not part of the signature. Launch hooks (a profiler's) get their metadata as on the JIT
path; without hooks none is made.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, ContextManager, NamedTuple, Optional

import torch
from triton import knobs
from triton.runtime.driver import driver


class Descriptor(NamedTuple):
    """A TMA descriptor argument as `FastLaunch` takes it: the tensor, its box and its shared-memory layout (a Gluon
    `TensorDescriptor` is made from them: checked on the JIT path, unchecked on the fast one)."""

    tensor: torch.Tensor
    block: tuple[int, ...]
    layout: Any

    def checked(self):
        """The Gluon `TensorDescriptor`, made (and checked) as Triton's JIT path is given it. A shared layout made
        for another element width than the tensor's is refused here (the driver would only say "invalid argument"
        when it fills the tensor map)."""
        bits = getattr(self.layout, "element_bitwidth", None)
        if bits is not None and bits != 8 * self.tensor.element_size():
            raise ValueError(f"a TMA descriptor's shared layout is for {bits}-bit elements, its tensor holds "
                             f"{self.tensor.dtype}: make the layout for the tensor's dtype or convert the tensor")
        descriptor_class, _ = _descriptor_class()
        return descriptor_class.from_tensor(self.tensor, list(self.block), self.layout)


@functools.cache
def _descriptor_class():
    """Gluon's host-side TensorDescriptor, and whether its fields are the ones `_unchecked` sets (a later Triton
    that adds one gets checked descriptors on every launch, never a half-made one)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    fields = tuple(f.name for f in dataclasses.fields(TensorDescriptor))
    return TensorDescriptor, fields == ("base", "shape", "strides", "block_shape", "layout", "padding")


def _unchecked(descriptor_class, d: Descriptor, shape: tuple, strides: tuple):
    """The descriptor `Descriptor.checked` makes, without `__post_init__`'s checks: for a tensor whose dtype,
    shape, strides, alignment, box and layout (the static signature) passed them on the JIT path."""
    made = object.__new__(descriptor_class)
    made.base, made.shape, made.strides = d.tensor, list(shape), list(strides)
    made.block_shape, made.layout, made.padding = list(d.block), d.layout, "zero"
    return made


def _signature(args: tuple) -> tuple:
    """What of the runtime arguments the static signature holds (see the module docstring): one loop, the common
    cases first (it runs at every launch)."""
    out = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            out.append(arg)
        elif kind is Descriptor:
            t = arg.tensor
            out.append((t.dtype, t.shape, t.stride(), t.data_ptr() & 15, arg.block, id(arg.layout)))
        elif isinstance(arg, torch.Tensor):
            out.append((arg.dtype, arg.data_ptr() & 15))
        else:  # bool (not 1), float, None: by type and value
            out.append((kind, arg))
    return tuple(out)


def _constexpr_signature(constexprs: dict) -> tuple:
    """The constexprs' part of the static signature: integers by value, other plain values by type and value,
    objects (layouts, dtypes) by identity (the cache entry keeps them alive)."""
    return tuple(value if type(value) is int else (type(value), value) if type(value) in _PLAIN
                 else (object, id(value)) for value in constexprs.values())


_PLAIN = (bool, float, str, type(None))


def _hooks_on() -> bool:
    """Whether a launch hook is installed (a profiler's): only then does a launch need its metadata."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)


class FastLaunch:
    """`kernel[grid](*args, **constexprs)` for a `@gluon.jit` or `@triton.jit` kernel (not an autotuned one) whose
    runtime parameters come first (all given positionally, `Descriptor`s where it takes TMA descriptors) and whose
    constexprs come last (all given by name). A memo of compiled kernels, as Triton's own cache is: one entry per
    static signature."""

    MAX_SIGNATURES = 256  # past this many (a caller making new constexpr objects per call?), launches stay on the JIT

    def __init__(self, kernel) -> None:
        from triton.runtime.interpreter import InterpretedFunction
        self.kernel = kernel
        self._compiled: dict[tuple, tuple] = {}
        self._interpreted = isinstance(kernel, InterpretedFunction)  # TRITON_INTERPRET=1: no driver, no compiling

    def launch(self, grid: tuple[int, ...], args: tuple, constexprs: dict,
               compiling: Optional[Callable[[], ContextManager]] = None) -> None:
        """Launch the kernel on `grid` with `args` and `constexprs` (launch options such as `num_warps` among
        them). `compiling`: a context to enter around the JIT path (where a new signature compiles)."""
        if self._interpreted:
            self.kernel[grid](*(a.checked() if isinstance(a, Descriptor) else a for a in args), **constexprs)
            return
        active = driver.active
        device = active.get_current_device()
        key = (id(active), device, _signature(args), tuple(constexprs), _constexpr_signature(constexprs),
               knobs.runtime.debug, knobs.compilation.instrumentation_mode)
        entry = self._compiled.get(key)
        descriptor_class, fast = _descriptor_class()
        if entry is None or not fast:
            with compiling() if compiling is not None else contextlib.nullcontext():
                compiled = self.kernel[grid](*(a.checked() if isinstance(a, Descriptor) else a for a in args),
                                             **constexprs)
            names = self.kernel.arg_names
            if fast and hasattr(compiled, "packed_metadata") and len(self._compiled) < self.MAX_SIGNATURES \
                    and all(name in constexprs for name in names[len(args):]):
                # the compiled kernel, the constexprs' values in parameter order, and the driver, constexpr and
                # layout objects themselves (kept alive so that their identities in the key stay theirs)
                tail = tuple(constexprs[name] for name in names[len(args):])
                layouts = tuple(a.layout for a in args if isinstance(a, Descriptor))
                self._compiled[key] = (compiled, tail, (active, *constexprs.values(), *layouts))
            return
        compiled, tail, _ = entry
        signature = key[2]  # (a descriptor's entry holds its shape and strides)
        values = [_unchecked(descriptor_class, a, static[1], static[2]) if type(a) is Descriptor else a
                  for a, static in zip(args, signature)]
        values.extend(tail)
        stream = active.get_current_stream(device)
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        metadata = compiled.launch_metadata(grid, stream, *values) if _hooks_on() else None
        compiled.run(grid[0], grid_y, grid_z, stream, compiled.function, compiled.packed_metadata, metadata,
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)
