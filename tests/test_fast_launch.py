"""`FastLaunch` (`megafp8.precision.kernels.launch`) hands Triton's launcher exactly what Triton's JIT path hands it.

Without a GPU: Triton compiles the kernels for SM90 (its wheel's `ptxas`) under a driver that records each launch
instead of making it, every TMA descriptor as the values it would be encoded from. Each case launches once with
fresh operands through a warmed `FastLaunch` (the fast path) and once through a new one (Triton's JIT path), and
the two records must be equal: the same compiled kernel, grid, stream, scalars, pointers and descriptors. Covered:
the warp-specialized GEMM in six configurations, the Gluon row + column quantizer (plain, RMSNorm, gathered,
gathered and scaled), RoPE's backward quantizer and SwiGLU backward's column kernel, the weight's quantization and
transpose, RMSNorm's inverse RMS, the MoE permutation's gather-sum, combine, combine-backward and row-copy kernels, the
cross-entropy's row and gradient kernels.
A signature the cache has not seen (another alignment) goes through the JIT path. Needs Triton with Gluon (skipped
where it is not installed)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")


class _RecordingDriver:
    """Triton's driver interface as far as a launch needs it: SM90 device 0, stream 7, nothing launched."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)
        self.launches: list[tuple] = []
        self.utils = self
        self.launcher_cls = self._launcher

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 7

    def get_device_capability(self, device=0):
        return (9, 0)

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132}

    def load_binary(self, name, kernel, shared, device):
        return 0, ("function", name), 0, 0, 1024

    def fill_tma_descriptor(self, ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
        return ("tma", ptr, swizzle, elem_size, elem_type, tuple(block), tuple(shape), tuple(strides), padding)

    def _launcher(self, src, metadata):
        from triton.backends.nvidia import driver as nvidia
        signature = dict(src.signature.items())
        record = self.launches.append

        def launch(*args):
            record(tuple(_comparable(a) for a in args))
        wrapped = nvidia.wrap_handle_tensordesc(launch, signature, getattr(metadata, "tensordesc_meta", None))

        def run(grid_x, grid_y, grid_z, stream, function, *args):
            wrapped(grid_x, grid_y, grid_z, stream, function, False, False, None, None, *args)
        return run


def _comparable(arg):
    """A launch argument as the record keeps it: tensors by address, launch metadata (a new object per launch) by
    content, launch hooks by identity."""
    from triton.compiler.compiler import LazyDict
    if isinstance(arg, torch.Tensor):
        return ("tensor", arg.data_ptr())
    if isinstance(arg, LazyDict):
        return ("metadata", tuple(sorted(arg.get().items())))
    return arg


@pytest.fixture
def recording(monkeypatch):
    """The recording driver, active while the test runs, and empty JIT caches for the kernels the tests launch: the
    real driver and caches come back after it (on a GPU machine, a later test must not find a kernel whose launcher
    records instead of launching)."""
    from collections import defaultdict
    from triton import knobs
    from triton.runtime.driver import driver
    from megafp8.precision.kernels import producers, quantize, rows_cols_gluon, swiglu_cols_gluon, ws_gemm
    fake = _RecordingDriver()
    monkeypatch.setattr(driver, "_active", fake)
    # a launch hook, as a profiler installs: both paths then hand the launcher the launch's metadata
    hook = knobs.HookChain()
    hook.add(lambda metadata: None)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    for kernel in (ws_gemm._ws_gemm_kernel, rows_cols_gluon.kernel_for(False), rows_cols_gluon.kernel_for(True),
                   rows_cols_gluon._rope_backward_quantize_gluon_kernel, quantize._transpose_blocks_kernel,
                   quantize._quantize_weight_kernel, producers._rms_inverse_kernel,
                   swiglu_cols_gluon._swiglu_backward_cols_kernel, swiglu_cols_gluon._swiglu_backward_cols_tma_kernel,
                   swiglu_cols_gluon._swiglu_backward_rows_cols_kernel, *_one_token_twins(), *_permutation_kernels(),
                   *_loss_kernels(), _routing_kernel()):
        monkeypatch.setattr(kernel, "device_caches", defaultdict(kernel.create_binder))
    return fake


def _one_token_twins() -> tuple:
    from megafp8.precision.kernels import rows_cols_gluon, swiglu_cols_gluon
    launches = (*rows_cols_gluon._LAUNCHES.values(), rows_cols_gluon._ROPE_LAUNCH, swiglu_cols_gluon._LAUNCH)
    return tuple(launch.one_token_kernel for launch in launches)


def _permutation_kernels() -> tuple:
    from megafp8.parallel import permute_kernels as pk
    return pk._gather_sum_kernel, pk._combine_kernel, pk._combine_backward_kernel, pk._gather_rows_kernel


def _routing_kernel():
    from megafp8.parallel import routing_kernels
    return routing_kernels._group_limited_topk_kernel


def _loss_kernels() -> tuple:
    from megafp8.parallel import cross_entropy_kernels as ce
    return ce._row_stats_kernel, ce._logits_grad_kernel


def _fast_and_jit(recording, get, put, call) -> tuple:
    """What the launcher got from `call(1)` on a warmed FastLaunch (after `call(0)`) and from `call(1)` on a new one.
    `get()` is the FastLaunch the code under test uses, `put(f)` replaces it."""
    from megafp8.precision.kernels.launch import FastLaunch
    warm = FastLaunch(get().kernel)
    put(warm)
    call(0)
    assert len(warm._compiled) == 1, "the first call's signature is kept"
    recording.launches.clear()
    call(1)
    fast = recording.launches[:]
    assert len(warm._compiled) == 1, "the second call has the first one's signature"
    put(FastLaunch(warm.kernel))
    recording.launches.clear()
    call(1)
    return fast, recording.launches[:]


def _attribute(owner, name: str) -> tuple:
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


_KEPT: dict = {}  # tensors by (seed, what): call(1) reads the same tensors, at the same addresses, both times


@pytest.fixture(autouse=True)
def _fresh_operands():
    _KEPT.clear()
    yield
    _KEPT.clear()


def _kept(seed: int, what, make):
    if (seed, what) not in _KEPT:
        _KEPT[seed, what] = make()
    return _KEPT[seed, what]


def _operands(seed: int, *shapes_dtypes) -> list[torch.Tensor]:
    def make():
        torch.manual_seed(seed)
        return [torch.randn(shape).to(dtype) for shape, dtype in shapes_dtypes]
    return _kept(seed, shapes_dtypes, make)


@pytest.mark.parametrize("case", ["dense fprop", "dense wgrad into main_grad", "grouped rows", "grouped K",
                                  "stores from registers", "interleaved FFMAs"])
def test_the_fast_path_launches_the_warp_specialized_gemm_as_the_jit_path_does(recording, monkeypatch, case):
    from megafp8.precision.kernels import ws_gemm
    monkeypatch.setattr(ws_gemm, "_sm_count", lambda device: 132)
    monkeypatch.setattr(ws_gemm, "_LAUNCH", ws_gemm._LAUNCH)  # restored after the test
    fp8, f32, bf16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16

    def call(seed):
        if case == "dense wgrad into main_grad":
            a, a_s, b, b_s, c = _operands(seed, ((256, 512), fp8), ((4, 256), f32), ((384, 512), fp8), ((4, 384), f32),
                                          ((256, 384), f32))
            ws_gemm.ws_gemm(a, a_s.t(), b, b_s.t(), c, b_blockwise=False, accumulate=True)
        elif case == "grouped K":
            a, a_s, b, b_s, c = _operands(seed, ((256, 512), fp8), ((4, 256), f32), ((384, 512), fp8), ((4, 384), f32),
                                          ((2, 256, 384), bf16))
            start, count = _kept(seed, "groups", lambda: (torch.tensor([0, 1], dtype=torch.int32),
                                                          torch.tensor([1, 3], dtype=torch.int32)))
            ws_gemm.ws_gemm(a, a_s.t(), b, b_s.t(), c, b_blockwise=False, k_start=start, k_count=count)
        else:
            a, a_s, b, b_s, c = _operands(seed, ((256, 512), fp8), ((4, 256), f32), ((2 * 384, 512), fp8),
                                          ((2, 3, 4), f32), ((256, 384), bf16))
            experts = _kept(seed, "experts", lambda: torch.tensor([1, -1], dtype=torch.int32)) \
                if case == "grouped rows" else None
            ws_gemm.ws_gemm(a, a_s.t(), b, b_s if experts is not None else b_s[0], c, b_blockwise=True,
                            tile_expert=experts, tma_store=False if case == "stores from registers" else None,
                            interleave_ffma=case == "interleaved FFMAs")
    fast, jit = _fast_and_jit(recording, *_attribute(ws_gemm, "_LAUNCH"), call)
    assert len(fast) == 1 and fast == jit


@pytest.mark.parametrize("case", ["plain", "rmsnorm", "gathered", "gathered and scaled", "rope backward"])
def test_the_fast_path_launches_the_gluon_quantizers_as_the_jit_path_does(recording, monkeypatch, case):
    from megafp8.precision import E4M3
    from megafp8.precision.kernels import rows_cols_gluon, tiles
    launches = dict(rows_cols_gluon._LAUNCHES)
    monkeypatch.setattr(rows_cols_gluon, "_LAUNCHES", launches)
    monkeypatch.setattr(rows_cols_gluon, "_ROPE_LAUNCH", rows_cols_gluon._ROPE_LAUNCH)

    def call(seed):
        x, rstd, weight = _operands(seed, ((200, 256), torch.bfloat16), ((200,), torch.float32),
                                    ((256,), torch.bfloat16))
        index, factor = _kept(seed, "index", lambda: (torch.randperm(300) % 250 - 50, torch.rand(300)))
        rows = 300 if case.startswith("gathered") else 200
        out = _kept(seed, case, lambda: tiles.rows_cols_outputs(rows, 384 if case == "rope backward" else 256, E4M3,
                                                                x.device))
        if case == "rope backward":
            cos, sin = _operands(seed, ((64, 64), torch.float32), ((64, 64), torch.float32))
            rows_cols_gluon.launch_rope_backward(x[:, :128], x[:, 128:], x[:, :128], cos, sin, 64, 64, out, E4M3,
                                                 False)
            return
        norm = case in ("rmsnorm", "gathered and scaled")
        rows_cols_gluon.launch(x, rstd if case == "rmsnorm" else factor if norm else None,
                               weight if norm else None, out, E4M3, True,
                               index=index if case.startswith("gathered") else None)

    if case == "rope backward":
        get, put = _attribute(rows_cols_gluon, "_ROPE_LAUNCH")
    else:
        norm_kernel = case == "rmsnorm"  # (the gathered and scaled rows run the plain quantizer's kernel)
        get, put = (lambda: launches[norm_kernel]), (lambda value: launches.__setitem__(norm_kernel, value))
    fast, jit = _fast_and_jit(recording, get, put, call)
    assert len(fast) == 1 and fast == jit


@pytest.mark.parametrize("case", ["quantizer", "swiglu columns"])
def test_one_token_launches_the_twin_that_keeps_the_token_count_at_runtime(recording, monkeypatch, case):
    """A kernel that converts its column tiles tokens first runs one token through its twin compiled with M a
    runtime value (ptxas 12.8 miscompiles the M = 1 specialization: `gluon_tiles.TokenCountLaunch`), and every
    other token count through the kernel Triton specializes as usual; each keeps its compiled signature."""
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import gluon_tiles, rows_cols_gluon, swiglu_cols_gluon, tiles
    if case == "quantizer":
        fresh = gluon_tiles.TokenCountLaunch(rows_cols_gluon.kernel_for(False))
        monkeypatch.setattr(rows_cols_gluon, "_LAUNCHES", {False: fresh, True: fresh})

        def call(m):
            x = torch.randn(m, 256).to(torch.bfloat16)
            rows_cols_gluon.launch(x, None, None, tiles.rows_cols_outputs(m, 256, E4M3, x.device), E4M3, False)
    else:
        fresh = gluon_tiles.TokenCountLaunch(swiglu_cols_gluon._swiglu_backward_cols_kernel)
        monkeypatch.setattr(swiglu_cols_gluon, "_LAUNCH", fresh)

        def call(m):
            gu, da = torch.randn(m, 512).to(torch.bfloat16), torch.randn(m, 256).to(torch.bfloat16)
            qt, st = tiles.rows_cols_outputs(m, 512, E5M2, gu.device)[2:]
            at, ats = tiles.rows_cols_outputs(m, 256, E4M3, gu.device)[2:]
            swiglu_cols_gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, E4M3, E5M2, False)
    specialized, twin = fresh._launches  # (the twins' flags: tests/test_ws_gemm_compiles.py)
    call(1)
    assert (len(specialized._compiled), len(twin._compiled)) == (0, 1)
    ((compiled, _, _),) = twin._compiled.values()
    assert compiled.src.signature["M"] != "constexpr"  # M = 1 stays a runtime value
    call(2)
    call(1)
    assert (len(specialized._compiled), len(twin._compiled)) == (1, 1)
    ((compiled, _, _),) = specialized._compiled.values()
    assert compiled.src.signature["M"] != "constexpr"
    assert len(recording.launches) == 3
    # without the twin, Triton's JIT compiles one token in as a constant: the compile ptxas 12.8 gets wrong
    monkeypatch.setattr(fresh, "_launches", (specialized, specialized))
    call(1)
    assert sorted(c.src.signature["M"] for c, _, _ in specialized._compiled.values()) == ["constexpr", "i32"]


@pytest.mark.parametrize("hooks", [True, False], ids=["launch hook", "no hook"])
@pytest.mark.parametrize("kernel", ["transpose", "quantize"])
def test_the_fast_path_launches_the_weight_kernels_as_the_jit_path_does(recording, monkeypatch, hooks, kernel):
    """The weight's transpose and its quantization (with its transpose), also without launch hooks, where the fast
    path makes no launch metadata (the JIT path makes it for none)."""
    from triton import knobs
    from megafp8.precision import E4M3
    from megafp8.precision.kernels import quantize
    name = "_TRANSPOSE_BLOCKS" if kernel == "transpose" else "_QUANTIZE_WEIGHT"
    monkeypatch.setattr(quantize, name, getattr(quantize, name))
    if not hooks:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())

    def call(seed):
        w, q, s, qt, st = _operands(seed, ((256, 384), torch.bfloat16), ((256, 384), torch.float8_e4m3fn),
                                    ((2, 3), torch.float32), ((384, 256), torch.float8_e4m3fn), ((3, 2), torch.float32))
        if kernel == "transpose":
            quantize.transpose_blocks(q, s, qt, st)
        else:
            quantize.quantize_weight_(w, q, s, qt, st, E4M3, True)
    fast, jit = _fast_and_jit(recording, *_attribute(quantize, name), call)
    if not hooks:
        jit = [tuple(None if isinstance(a, tuple) and a[:1] == ("metadata",) else a for a in launch) for launch in jit]
    assert len(fast) == 1 and fast == jit


def test_a_new_alignment_takes_the_jit_path(recording, monkeypatch):
    """The static signature tells apart what Triton specializes on: a tensor 16-byte aligned or not, an integer 1 or
    not, an integer from a bool or a float."""
    from megafp8.precision.kernels import launch, quantize
    fresh = launch.FastLaunch(quantize._TRANSPOSE_BLOCKS.kernel)
    monkeypatch.setattr(quantize, "_TRANSPOSE_BLOCKS", fresh)
    q, qt = torch.zeros(256 * 384 + 16, dtype=torch.float8_e4m3fn), torch.empty(384 * 256, dtype=torch.float8_e4m3fn)
    s, st = torch.ones(2, 3), torch.empty(3, 2)
    quantize.transpose_blocks(q[:256 * 384].view(256, 384), s, qt.view(384, 256), st)
    quantize.transpose_blocks(q[16:].view(256, 384), s, qt.view(384, 256), st)  # another 16-byte aligned start
    assert len(fresh._compiled) == 1
    quantize.transpose_blocks(q[8:256 * 384 + 8].view(256, 384), s, qt.view(384, 256), st)  # 8 bytes off
    assert len(fresh._compiled) == 2
    assert launch._signature((1,)) != launch._signature((True,)) and launch._signature((1,)) != launch._signature((17,))
    assert launch._signature((2.0,)) != launch._signature((2,))



def test_the_fast_path_launches_rmsnorms_inverse_rms_as_the_jit_path_does(recording, monkeypatch):
    """A float among the runtime arguments (eps) and an integer constexpr made anew at each call (K = 512, past the
    integers Python keeps one object of): both keyed by value, so the second call takes the fast path."""
    from megafp8.precision.kernels import producers
    monkeypatch.setattr(producers, "_RMS_INVERSE", producers._RMS_INVERSE)

    def call(seed):
        h, rstd = _operands(seed, ((200, 512), torch.bfloat16), ((200,), torch.float32))
        k = int("512")  # a new int object
        producers._RMS_INVERSE.launch((-(-200 // producers.RMS_BLOCK_M),), (h, rstd, 200, 1e-5, h.stride(0)),
                                      dict(K=k, BLOCK_M=producers.RMS_BLOCK_M, num_warps=producers.RMS_WARPS))
    fast, jit = _fast_and_jit(recording, *_attribute(producers, "_RMS_INVERSE"), call)
    assert len(fast) == 1 and fast == jit


@pytest.mark.parametrize("use_tma", [False, True], ids=["loads", "tma"])
def test_the_fast_path_launches_swiglu_backwards_column_kernel_as_the_jit_path_does(recording, monkeypatch, use_tma):
    """Both forms of the Gluon column kernel: the threads' loads, and TMA (its two descriptors over slab views)."""
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import swiglu_cols_gluon, tiles
    name = "_TMA_LAUNCH" if use_tma else "_LAUNCH"
    monkeypatch.setattr(swiglu_cols_gluon, name, getattr(swiglu_cols_gluon, name))

    def call(seed):
        gu, da = _operands(seed, ((200, 512), torch.bfloat16), ((200, 256), torch.bfloat16))
        qt, st = _kept(seed, "d(gu)^T", lambda: tiles.rows_cols_outputs(200, 512, E5M2, gu.device)[2:])
        at, ats = _kept(seed, "a^T", lambda: tiles.rows_cols_outputs(200, 256, E4M3, gu.device)[2:])
        swiglu_cols_gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, E4M3, E5M2, False, use_tma=use_tma)
    fast, jit = _fast_and_jit(recording, *_attribute(swiglu_cols_gluon, name), call)
    assert len(fast) == 1 and fast == jit


def test_the_fast_path_launches_swiglu_backwards_rows_and_columns_in_one_launch_as_the_jit_path_does(recording,
                                                                                                   monkeypatch):
    """The row and column programs in one launch (`swiglu_backward_rows_cols`): both TMA descriptors, the row
    programs' plain pointers, and one program per column chunk and per 32-token row slice of each 128-token block
    and 128 features (2 blocks x 2 units x (4 + 4) programs for 200 tokens, F = 256)."""
    from megafp8.precision import E4M3, E5M2
    from megafp8.precision.kernels import swiglu_cols_gluon, tiles
    monkeypatch.setattr(swiglu_cols_gluon, "_ROWS_COLS_LAUNCH", swiglu_cols_gluon._ROWS_COLS_LAUNCH)

    def call(seed):
        gu, da = _operands(seed, ((200, 512), torch.bfloat16), ((200, 256), torch.bfloat16))
        q, s, qt, st = _kept(seed, "d(gu)", lambda: tiles.rows_cols_outputs(200, 512, E5M2, gu.device))
        at, ats = _kept(seed, "a^T", lambda: tiles.rows_cols_outputs(200, 256, E4M3, gu.device)[2:])
        swiglu_cols_gluon.swiglu_backward_rows_cols(gu, da, q, s, qt, st, at, ats, E4M3, E5M2, False)
    fast, jit = _fast_and_jit(recording, *_attribute(swiglu_cols_gluon, "_ROWS_COLS_LAUNCH"), call)
    assert len(fast) == 1 and fast == jit
    assert fast[0][:3] == (2 * 2 * 8, 1, 1)


def test_swiglu_backward_quantize_takes_the_one_launch_where_tma_reads_its_inputs_and_two_kernels_elsewhere(
        recording, monkeypatch):
    """`producers.swiglu_backward_quantize` on SM90: one launch of `_swiglu_backward_rows_cols_kernel` where TMA can
    read gu and da, the Triton row kernel then the column kernel's thread loads where it cannot (an FP32 da), and
    the two kernels again with the switch off (`ROWS_COLS_ONE_LAUNCH`)."""
    from megafp8.precision import E4M3
    from megafp8.precision.kernels import producers, swiglu_cols_gluon, tiles

    # The Triton row kernel autotunes (which the recording driver cannot time): its launches are noted, not made.
    monkeypatch.setattr(producers, "swiglu_backward_rows",
                        lambda *args: recording.launches.append((("function", "_swiglu_backward_rows_kernel"),)))
    monkeypatch.setattr(tiles, "hopper_gluon", lambda device, module: swiglu_cols_gluon)

    def kernels(da_dtype=torch.bfloat16, one_launch=True):
        monkeypatch.setattr(swiglu_cols_gluon, "ROWS_COLS_ONE_LAUNCH", one_launch)
        gu, da = _operands(0, ((256, 512), torch.bfloat16), ((256, 256), da_dtype))
        recording.launches.clear()
        producers.swiglu_backward_quantize(gu, da, E4M3, E4M3, False)
        return [a[1] for launch in recording.launches for a in launch if isinstance(a, tuple) and a[:1] == ("function",)]
    assert kernels() == ["_swiglu_backward_rows_cols_kernel"]
    assert kernels(torch.float32) == ["_swiglu_backward_rows_kernel", "_swiglu_backward_cols_kernel"]
    assert kernels(one_launch=False) == ["_swiglu_backward_rows_kernel", "_swiglu_backward_cols_tma_kernel"]


def test_an_fp32_da_takes_swiglu_backwards_loads_and_a_descriptor_of_the_wrong_width_is_refused(recording,
                                                                                                  monkeypatch):
    """SwiGLU's backward given an FP32 da (a dgrad written in FP32): the column kernel reads it with the threads'
    loads (its TMA slabs are 64-byte rows of BF16; job GM's GPU failed filling such a tensor map), and a descriptor
    whose shared layout is for 16-bit elements over an FP32 tensor is refused before any driver sees it."""
    from megafp8.precision import E4M3
    from megafp8.precision.kernels import swiglu_cols_gluon, tiles
    from megafp8.precision.kernels.launch import Descriptor
    for name in ("_TMA_LAUNCH", "_LAUNCH"):
        monkeypatch.setattr(swiglu_cols_gluon, name, getattr(swiglu_cols_gluon, name))
    gu, da = _operands(0, ((256, 512), torch.bfloat16), ((256, 256), torch.float32))
    assert not swiglu_cols_gluon.tma_fits(gu, da) and swiglu_cols_gluon.tma_fits(gu, da.bfloat16())
    qt, st = tiles.rows_cols_outputs(256, 512, E4M3, gu.device)[2:]
    at, ats = tiles.rows_cols_outputs(256, 256, E4M3, gu.device)[2:]
    swiglu_cols_gluon.swiglu_backward_cols(gu, da, qt, st, at, ats, E4M3, E4M3, False)
    kernels = [a[1] for a in recording.launches[0] if isinstance(a, tuple) and a[:1] == ("function",)]
    assert kernels == ["_swiglu_backward_cols_kernel"], kernels  # the loads kernel, not `..._tma_kernel`
    wrong = Descriptor(da.view(8, 32, 256), (8, 16, 32), swiglu_cols_gluon.slab_shared_layout(32))
    with pytest.raises(ValueError, match="16-bit elements.*float32"):
        wrong.checked()


@pytest.mark.parametrize("case", ["gather_sum", "combine", "combine backward", "combine weights' gradient",
                                  "gather rows", "gather rows, features first"])
def test_the_fast_path_launches_the_moe_permutation_kernels_as_the_jit_path_does(recording, monkeypatch, case):
    """The MoE dispatch's and combine's Triton kernels (`megafp8.parallel.permute_kernels`), a compile option among
    their launch options (`enable_fp_fusion`); the dispatch's row copy in both walks."""
    from megafp8.parallel import permute_kernels as pk
    name = {"gather_sum": "_GATHER_SUM", "combine": "_COMBINE"}.get(case, "_COMBINE_BACKWARD")
    name = "_GATHER_ROWS" if case.startswith("gather rows") else name
    monkeypatch.setattr(pk, name, getattr(pk, name))

    def call(seed):
        d, dout, w = _operands(seed, ((300, 256), torch.bfloat16), ((100, 256), torch.bfloat16),
                               ((100, 3), torch.float32))
        index = _kept(seed, "slots", lambda: (torch.randperm(300) % 300).view(100, 3))
        if case == "gather_sum":
            pk.gather_sum(d, index)
        elif case == "combine":
            pk.combine(d, index, w)
        elif case == "combine backward":
            pk.combine_backward(dout, d, index, w, _kept(seed, "combine dy", lambda: torch.zeros_like(d)))
        elif case.startswith("gather rows"):
            pk.gather_rows(d, index.flatten()[:250], rows_first=case == "gather rows")
        else:
            pk.combine_weights_grad(dout, d, index)
    fast, jit = _fast_and_jit(recording, *_attribute(pk, name), call)
    # Each call allocates its outputs, which may sit at different addresses on the two paths: tensors are compared
    # by which kept operand they are, "fresh" for the outputs.
    assert len(fast) == 1 and _by_operand(fast) == _by_operand(jit)


def test_the_fast_path_launches_the_routing_kernel_as_the_jit_path_does(recording, monkeypatch):
    """The router's group-limited top-k (`megafp8.parallel.routing_kernels`): a partial last block of tokens."""
    from megafp8.parallel import routing_kernels as rk
    monkeypatch.setattr(rk, "_LAUNCH", rk._LAUNCH)

    def call(seed):
        (choice,) = _operands(seed, ((100, 64), torch.float32))
        rk.group_limited_topk(choice, 8, 4, 8)
    fast, jit = _fast_and_jit(recording, *_attribute(rk, "_LAUNCH"), call)
    assert len(fast) == 1 and _by_operand(fast) == _by_operand(jit)


@pytest.mark.parametrize("case", ["row stats", "logits gradient"])
def test_the_fast_path_launches_the_loss_kernels_as_the_jit_path_does(recording, monkeypatch, case):
    """The cross-entropy's two Triton kernels (`megafp8.parallel.cross_entropy_kernels`): int64 targets, a vocabulary
    that is not a multiple of the chunk (a runtime integer and, for the row pass, the constexpr chunk count)."""
    from megafp8.parallel import cross_entropy_kernels as ce
    name = "_ROW_STATS" if case == "row stats" else "_LOGITS_GRAD"
    monkeypatch.setattr(ce, name, getattr(ce, name))

    def call(seed):
        logits, lse, dloss = _operands(seed, ((64, 5000), torch.bfloat16), ((64,), torch.float32),
                                       ((64,), torch.float32))
        target = _kept(seed, "targets", lambda: torch.randint(0, 5000, (64,)))
        if case == "row stats":
            ce.row_stats(logits, target)
        else:
            ce.logits_grad(logits, lse, target, dloss)
    fast, jit = _fast_and_jit(recording, *_attribute(ce, name), call)
    assert len(fast) == 1 and _by_operand(fast) == _by_operand(jit)


def _by_operand(launches: list) -> list:
    names = {t.data_ptr(): f"{key}[{i}]" for key, kept in _KEPT.items()
             for i, t in enumerate(kept if isinstance(kept, (list, tuple)) else [kept]) if isinstance(t, torch.Tensor)}
    return [tuple(names.get(a[1], "fresh") if isinstance(a, tuple) and a[:1] == ("tensor",) else a for a in launch)
            for launch in launches]
