"""Gluon kernels compiled for SM90 without a GPU, through Triton's compiler and the wheel's `ptxas`/`cuobjdump`.

- The warp-specialized GEMM (`megafp8.precision.kernels.ws_gemm`), every configuration the backends launch: its
  MMAs not serialized by the assembler, its accumulators not spilled, its shared memory within SM90's, and where
  its epilogue goes by TMA, the bulk store (or reduction) and no store from registers. A change that makes ptxas
  serialize the wgmma pipeline (notes C7511/C7514) or spill the FP32 accumulators runs correctly on the GPU, only
  much slower.
- SwiGLU backward's column kernel (`swiglu_cols_gluon`): its instruction count (it is bound by the instructions
  it issues), vector widths and spills.
- RoPE's backward quantizer: the Triton kernel without spills in any configuration its autotuner may pick, and
  the Gluon kernel SM90 runs (`rows_cols_gluon.launch_rope_backward`): vector loads, no spills, its instruction count.

A regression in any of them runs correctly, only slower, so no CPU test of the numerics would notice it. Needs
Triton with Gluon (skipped where it is not installed)."""
from __future__ import annotations

import itertools
import os
import re
import subprocess

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

CONFIGS = {  # name -> (constexpr flags, C's element type)
    "grouped fprop/dgrad": (dict(GROUPED_ROWS=True, GROUPED_K=False, B_BLOCKWISE=True, ACCUMULATE=False,
                                 TMA_STORE=True), "*bf16"),
    "grouped fprop/dgrad, stores from registers": (dict(GROUPED_ROWS=True, GROUPED_K=False, B_BLOCKWISE=True,
                                                        ACCUMULATE=False, TMA_STORE=False), "*bf16"),
    "grouped wgrad into main_grad": (dict(GROUPED_ROWS=False, GROUPED_K=True, B_BLOCKWISE=False, ACCUMULATE=True,
                                          TMA_STORE=True), "*fp32"),
    "grouped wgrad into main_grad, from registers": (dict(GROUPED_ROWS=False, GROUPED_K=True, B_BLOCKWISE=False,
                                                          ACCUMULATE=True, TMA_STORE=False), "*fp32"),
    "grouped wgrad into main_grad, 256 experts": (dict(GROUPED_ROWS=False, GROUPED_K=True, B_BLOCKWISE=False,
                                                       ACCUMULATE=True, TMA_STORE=True, BLOCK_E=256), "*fp32"),
    "grouped wgrad into main_grad, every group's tiles": (dict(GROUPED_ROWS=False, GROUPED_K=True, COMPACT=False,
                                                                B_BLOCKWISE=False, ACCUMULATE=True, TMA_STORE=True),
                                                           "*fp32"),
    "grouped wgrad": (dict(GROUPED_ROWS=False, GROUPED_K=True, B_BLOCKWISE=False, ACCUMULATE=False, TMA_STORE=True),
                      "*bf16"),
    "dense wgrad": (dict(GROUPED_ROWS=False, GROUPED_K=False, B_BLOCKWISE=False, ACCUMULATE=False, TMA_STORE=True),
                    "*bf16"),
    "dense wgrad into main_grad": (dict(GROUPED_ROWS=False, GROUPED_K=False, B_BLOCKWISE=False, ACCUMULATE=True,
                                        TMA_STORE=True), "*fp32"),
    "dense fprop/dgrad": (dict(GROUPED_ROWS=False, GROUPED_K=False, B_BLOCKWISE=True, ACCUMULATE=False,
                               TMA_STORE=True), "*bf16"),
}
# Spill bytes ptxas may report: the per-row-scale kernels keep a few tile coordinates on the stack outside the K
# loop (measured 16-48 bytes); the accumulators alone are 256 bytes a thread per 128-column slice.
MAX_SPILL_BYTES = 64


def _compile(flags: dict, c_type: str, block_n: int, interleave_ffma: bool = False):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from megafp8.precision.kernels import ffma_interleave, ws_gemm
    from megafp8.precision.kernels.ws_tiles import walk_lanes

    fp8 = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    scales = torch.empty(2, 256).t()  # (rows, K/128), stored rows-first as the quantizers write them
    c = torch.empty(256, 256, dtype=torch.bfloat16 if c_type == "*bf16" else torch.float32)
    signature = {"a_desc": mangle_type(ws_gemm._descriptor(fp8, (64, 128)).checked()),
                 "b_desc": mangle_type(ws_gemm._descriptor(fp8, (128, 128)).checked()),
                 "as_desc": mangle_type(ws_gemm._scale_descriptor(scales, 64).checked()),
                 "bs_desc": mangle_type(ws_gemm._scale_descriptor(scales, 128).checked()),
                 "c_desc": mangle_type(ws_gemm._descriptor(c if flags["TMA_STORE"] else fp8, (64, 128)).checked()),
                 "c_ptr": c_type,
                 "bs_ptr": "*fp32", "tile_expert_ptr": "*i32", "k_start_ptr": "*i32", "k_count_ptr": "*i32"}
    signature.update({name: "i32" for name in ("M", "N", "K_BLOCKS", "num_groups", "stride_ce", "stride_cm",
                                               "stride_bs_e", "stride_bs_n", "stride_bs_k")})
    buffers = ws_gemm.epilogue_buffers(c, block_n) if flags["TMA_STORE"] else 0
    # The launcher walks only busy groups' tiles wherever it accumulates K-grouped products (`ws_gemm`)
    constants = dict(dict(COMPACT=flags["GROUPED_K"] and flags["ACCUMULATE"]), **flags)
    constants.setdefault("BLOCK_E", walk_lanes(64))
    constants.update(C_BUFS=max(buffers, 1), BLOCK_N=block_n, GROUP_M=8, INTERLEAVE=interleave_ffma,
                     STAGES=ws_gemm._stages(block_n, 2 * buffers * 64 * 128 * c.element_size()))
    signature.update({name: "constexpr" for name in constants})
    with ffma_interleave.patching_ffma(ws_gemm.INTERLEAVE_MARKER):  # (patches only the kernel carrying it)
        return triton.compile(GluonASTSource(ws_gemm._ws_gemm_kernel, signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "maxnreg": ws_gemm._MAXNREG})


def _ptxas_report(compiled) -> str:
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    ptx = compiled.asm["ptx"]
    result = subprocess.run([ptxas, "-v", "-arch=sm_90a", "-", "-o", os.devnull], input=ptx, capture_output=True,
                            text=True, check=True)
    return result.stdout + result.stderr


@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_warp_specialized_gemm_compiles_for_sm90_without_serialized_mmas_or_spilled_accumulators(name, block_n):
    flags, c_type = CONFIGS[name]
    compiled = _compile(flags, c_type, block_n)
    assert compiled.metadata.shared <= 232448, compiled.metadata.shared  # SM90's shared memory per block
    ptx = compiled.asm["ptx"]
    if flags["TMA_STORE"]:  # the epilogue by TMA: stored, or added into main_grad by the TMA unit's reduction
        op = "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" if flags["ACCUMULATE"] else \
            "cp.async.bulk.tensor.2d.global.shared::cta"
        assert op in ptx and not re.search(r"^\s*(@%p\d+\s+)?st\.global", ptx, re.M)  # no store from registers
    report = _ptxas_report(compiled)
    assert "C7511" not in report and "C7514" not in report, report  # "wgmma ... serialized"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    # Branch ws-scales-tma: with the scales read from shared memory, the 256-column wgrad that adds into main_grad
    # spills a few loop registers (104 bytes measured on the CPU); not the accumulators (256 bytes a slice).
    allowed = 2 * MAX_SPILL_BYTES if name.startswith("grouped wgrad into main_grad") and block_n == 256 \
        else MAX_SPILL_BYTES
    assert spills and max(spills) <= allowed, report


@pytest.mark.parametrize("name", ["grouped fprop/dgrad", "grouped fprop/dgrad, stores from registers"])
def test_the_interleaved_variant_differs_only_in_its_promotions_reuse_and_yield_flags(name):
    """`ws_gemm(interleave_ffma=True)` compiles to the plain kernel's instructions with, in each long FFMA run of
    the promotion, every other FFMA of its first 9/16 no longer keeping the scale in the reuse cache and its yield
    flag flipped (`ffma_interleave`): the marker reaches the PTX, the pipeline hook patches that cubin and not the
    plain one compiled under the same hook, and ptxas keeps the wgmma pipeline."""
    from megafp8.precision.kernels import ffma_interleave as fi, ws_gemm
    flags, c_type = CONFIGS[name]
    plain, interleaved = _compile(flags, c_type, 256), _compile(flags, c_type, 256, interleave_ffma=True)
    assert ws_gemm.INTERLEAVE_MARKER in interleaved.asm["ptx"] and ws_gemm.INTERLEAVE_MARKER not in plain.asm["ptx"]
    before = fi.parse_sass(fi.disassemble(plain.asm["cubin"]))["_ws_gemm_kernel"]
    after = fi.parse_sass(fi.disassemble(interleaved.asm["cubin"]))["_ws_gemm_kernel"]
    assert [i.low for i in before] == [i.low for i in after]
    changed = [(old, new) for old, new in zip(before, after) if old.high != new.high]
    assert changed and all(old.opcode == "FFMA" and old.high ^ new.high == fi.REUSE_B | fi.YIELD
                           for old, new in changed)
    assert len(changed) == fi.interleave_ffma(plain.asm["cubin"])[1]  # the plain cubin left as ptxas made it
    report = _ptxas_report(interleaved)
    assert "C7511" not in report and "C7514" not in report, report


def _ptxas_and_sass(ptx: str) -> tuple[str, str]:
    """(ptxas -v's report, cuobjdump's SASS) of `ptx` assembled for sm_90a with the Triton wheel's tools."""
    import tempfile
    import triton
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        report = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "-arch=sm_90a", "-", "-o", cubin], input=ptx,
                                capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    return report.stdout + report.stderr, sass


def _sass_instructions(sass: str) -> int:
    """How many instructions a SASS listing holds (one thread's, for kernels without loops; a loop body once)."""
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M))


def _packs_one_register_twice(sass: str) -> list:
    """The FP8 pair conversions whose two sources are one register: ptxas 12.8 emits them where it proved two
    consecutive tokens equal (M compiled in as 1, the padding rows known zeros) and merged such pairs with a half
    register nothing wrote (`gluon_tiles.TokenCountLaunch`). With M a runtime value no two products are provably
    equal, so none should appear."""
    return re.findall(r"F2FP\S*\s+R\d+, (R\d+), \1,", sass)


def _assert_wide_shared_accesses(sass: str) -> None:
    """The row + column quantizer's and RoPE's tiles exchange their row maxima and scales through shared memory in
    a few 16-byte (or matrix) accesses a thread (`rows_cols_gluon._row_scales`: 6 stores and 6 loads when written).
    Triton's own cross-warp reduction stored each thread's 16 row partials as scalar stores 16 bytes apart and read
    them back so: 6-way bank conflicts, half the kernel's L1 wavefronts (Nsight Compute, docs/benchmarks.md job FB),
    which no numerics test would notice. (With x^T in 128x128 blocks, the block's one max crosses the warps as one
    scalar store and load a thread, twice.)"""
    stores = re.findall(r"\bSTS(?:\.\d+)? \[", sass)
    loads = re.findall(r"\bLDS(?:\.\d+)? R\d+, \[", sass)
    scalar = re.findall(r"\bSTS \[|\bLDS R\d+, \[", sass)
    assert len(stores) <= 8 and len(loads) <= 8 and len(scalar) <= 4, (len(stores), len(loads), scalar)


def _rows_cols_compiled(norm: bool, gather: bool, one_token: bool = False, masked: bool = True,
                        col_blocks: bool = False, rows_first: bool = False):
    """The row + column quantizer compiled for sm_90 as its launches specialize it (M = 1 compiled in where
    `one_token`, as Triton's JIT would without `TokenCountLaunch`'s twin; `masked`: M not a multiple of 128;
    `col_blocks`: x^T in 128x128 blocks)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from megafp8.precision.kernels import rows_cols_gluon as r

    signature = {"x_ptr": "*bf16", "rstd_ptr": "*fp32", "w_ptr": "*bf16", "idx_ptr": "*i64", "q_ptr": "*fp8e4nv",
                 "s_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32"}
    signature.update({name: "i32" for name in ("M", "stride_xm", "stride_qm", "stride_sm", "stride_sk", "stride_qt",
                                               "stride_st_k", "stride_st_m")})
    load, store_t, rows, cols = r.tile_layouts()
    constants = dict(FP8_MAX=448.0, POW2=False, NORM=norm, GATHER=gather, LOAD=load, STORE_T=store_t, ROWS=rows,
                     COLS=cols, MASKED=masked or one_token, COL_BLOCKS=col_blocks, ROWS_FIRST=rows_first,
                     stride_sm=1, stride_st_k=1, **(dict(M=1) if one_token else {}))
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    aligned = ["x_ptr", "rstd_ptr", "w_ptr", "idx_ptr", "q_ptr", "s_ptr", "qt_ptr", "st_ptr", "stride_xm",
               "stride_qm", "stride_sk", "stride_qt", "stride_st_m"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # as the launch specializes them
    return triton.compile(GluonASTSource(r.kernel_for(norm), signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": r.WARPS})


def test_one_token_runs_through_a_twin_because_ptxas_miscompiles_the_token_count_compiled_in():
    """Triton's JIT compiles an integer argument equal to 1 in as a constant; with M = 1 ptxas 12.8 packs pairs
    of the transposed padding with a register half nothing wrote (garbage bytes past the one token on an H200).
    Every Gluon kernel that converts its column tiles tokens first launches through `TokenCountLaunch`, whose twin
    keeps M a runtime value. Should a later ptxas stop emitting those pairs for M = 1, the twin can go."""
    from megafp8.precision.kernels import rows_cols_gluon as r, swiglu_cols_gluon as g

    for launch in (*r._LAUNCHES.values(), r._ROPE_LAUNCH, g._LAUNCH):
        assert launch.one_token_kernel.fn is launch.kernel.fn
        for kernel, runtime in ((launch.kernel, False), (launch.one_token_kernel, True)):
            assert [p.do_not_specialize for p in kernel.params if p.name == "M"] == [runtime], kernel.fn.__name__
    assert _packs_one_register_twice(_ptxas_and_sass(_rows_cols_compiled(False, False, True).asm["ptx"])[1])


@pytest.mark.parametrize("warps, a_blocks", [(4, False), (8, False), (4, True)],
                         ids=["4_warps", "8_warps", "4_warps_a_in_blocks"])
def test_the_gluon_swiglu_column_kernel_compiles_for_sm90_lean_and_without_spills(warps, a_blocks):
    """SwiGLU backward's Gluon column kernel (`swiglu_cols_gluon`, the one SM90 runs) is bound by the instructions
    it issues, not by memory (Nsight Compute, `docs/benchmarks.md`): compiled for SM90 it must stay near 47
    instructions per (token, feature) at 4 warps, against 143 for the Triton kernel it replaced. What this guards: a
    nan-propagating max written as compare-and-select (5 instructions, not 1), a clamp before the saturating FP8
    conversion, or divisions repeated on every lane instead of shared out, each of which cost 10-25 instructions
    per element and no numerics test would notice. It also reads whole row segments, writes 8-byte column runs,
    keeps its shared memory to the few bytes that return the scales to every lane, and spills at most a few bytes.
    With a^T in 128x128 blocks (`precision.fp8_wgrad_input_blocks`) a's block maxima come from the forward's tile
    maxima (stored tokens first: vector loads), instead of a's columns: no more instructions than the tiles."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from megafp8.precision.kernels import gluon_tiles as gt, swiglu_cols_gluon as g

    signature = {"gu_ptr": "*bf16", "da_ptr": "*bf16", "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32", "at_ptr": "*fp8e4nv",
                 "ats_ptr": "*fp32", "amax_ptr": "*fp32"}
    ints = ["M", "F", "stride_gm", "stride_dm", "stride_qt", "stride_st_k", "stride_st_m", "stride_at",
            "stride_ats_k", "stride_ats_m", "stride_ab"]
    signature.update({name: "i32" for name in ints})
    block_n, load, store = gt.block_layouts(g.TOKENS_PER_THREAD, g.FEATURES_PER_THREAD, warps)
    # a^T's block scales (F/128, M_pad/128) are column-major as well: stride_ats_k 1, stride_ats_m F/128
    constants = dict(GRAD_MAX=448.0, FP8_MAX=448.0, POW2=False, A_BLOCKS=a_blocks, BLOCK_N=block_n, LOAD=load,
                     STORE=store, SPREAD=gt.spread_layout(block_n // warps, warps), stride_st_k=1, stride_ats_k=1)
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    aligned = [0, 1, 2, 3, 4, 5, 6] + [names.index(n) for n in ("F", "stride_gm", "stride_dm", "stride_qt",
                                                                 "stride_at", "stride_st_m", "stride_ats_m",
                                                                 "stride_ab")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}  # as the launch specializes them
    compiled = triton.compile(GluonASTSource(g._swiglu_backward_cols_kernel, signature, constexprs=constants,
                                             attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.shared <= 64 * warps
    # gate, up, da: 2 bytes x FEATURES_PER_THREAD of each of a thread's rows in one load (8 bytes: v2.b32)
    assert len(re.findall(r"ld\.global\.v2\.b32", ptx)) == 3 * g.TOKENS_PER_THREAD
    # a thread's 8 tokens of each of its columns as one 8-byte store, for each of the 3 results
    assert len(re.findall(r"st\.global\.v2\.b32", ptx)) == 3 * g.FEATURES_PER_THREAD
    assert ptx.count("div.rn.f32") <= 6  # 2 correctly rounded divisions per result and lane, no more
    report, sass = _ptxas_and_sass(ptx)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) <= 16, report
    assert not _packs_one_register_twice(sass)
    instructions = _sass_instructions(sass)
    per_element = instructions * 32 * warps / (128 * block_n)  # over the block's 128 tokens x block_n features
    assert 30 < per_element <= (48 if a_blocks else 56), f"{instructions} SASS instructions a thread, " \
                                                          f"{per_element:.1f} per element"


@pytest.mark.parametrize("a_blocks", [False, True], ids=["a_in_tiles", "a_in_blocks"])
def test_the_swiglu_column_kernel_reading_by_tma_compiles_for_sm90_without_thread_loads(a_blocks):
    """The column kernel's TMA form (`_swiglu_backward_cols_tma_kernel`, what SM90 runs where M % 8 == 0) was made
    to take gu and da off the LSU's global path (Nsight Compute: each 32-byte sector looked up twice, job FB). It
    must issue no global load of gu or da, bring each tensor's block in by TMA (one 3-D box),
    read each thread's row segments from shared memory as 8-byte vectors (3 x 8 of them, as the pointer kernel
    loads them), rename the slabs into token order for free (`_in_token_order` asserts it), keep the 8-byte
    transposed stores, and cost no more instructions per element than the pointer kernel's bound."""
    from megafp8.precision.kernels import gluon_tiles as gt, swiglu_cols_gluon as g

    warps = 4
    block_n = gt.block_layouts(g.TOKENS_PER_THREAD, g.FEATURES_PER_THREAD, warps)[0]
    compiled = _swiglu_tma_compiled(g._swiglu_backward_cols_tma_kernel, a_blocks, rows=False)
    assert compiled.metadata.shared <= 3 * 2 * 128 * block_n + 64 * warps + 64  # the three blocks, a few scales
    report, sass = _ptxas_and_sass(compiled.asm["ptx"])
    # global loads only of a's tile maxima, with a^T in blocks (a thread's 8 tokens' of its block)
    assert len(re.findall(r"\bLDG\b", sass)) <= (2 if a_blocks else 0)
    assert len(re.findall(r"\bUTMALDG\.3D\b", sass)) == 3
    assert len(re.findall(r"\bLDS\.64\b", sass)) == 3 * g.TOKENS_PER_THREAD
    assert len(re.findall(r"\bSTG\.E\.64\b", sass)) == 3 * g.FEATURES_PER_THREAD
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) <= 16, report
    per_element = _sass_instructions(sass) * 32 * warps / (128 * block_n)
    assert 30 < per_element <= 48, f"{per_element:.1f} SASS instructions per element"


def _swiglu_tma_compiled(kernel, a_blocks: bool, rows: bool):
    """A SwiGLU backward kernel reading gu and da by TMA (`swiglu_cols_gluon`: the column kernel, or with `rows` the
    rows and columns in one launch) compiled for SM90 at 4 warps, as its launcher specializes it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    from megafp8.precision.kernels import gluon_tiles as gt, swiglu_cols_gluon as g

    warps = 4
    block_n, load, store = gt.block_layouts(g.TOKENS_PER_THREAD, g.FEATURES_PER_THREAD, warps)
    shared, box = g.slab_shared_layout(block_n), (8, 16, block_n)
    gu, da = torch.empty(256, 512, dtype=torch.bfloat16), torch.empty(256, 256, dtype=torch.bfloat16)
    signature = {"gu_desc": mangle_type(g.Descriptor(g._slab_view(gu, 512), box, shared).checked()),
                 "da_desc": mangle_type(g.Descriptor(g._slab_view(da, 256), box, shared).checked())}
    row_ptrs = ["gu_ptr", "da_ptr", "q_ptr", "s_ptr"] if rows else []
    signature.update({name: "*bf16" if name in ("gu_ptr", "da_ptr") else "*fp32" if name == "s_ptr" else "*fp8e4nv"
                      for name in row_ptrs})
    signature.update({"qt_ptr": "*fp8e4nv", "st_ptr": "*fp32", "at_ptr": "*fp8e4nv", "ats_ptr": "*fp32",
                      "amax_ptr": "*fp32"})
    ints = ["M", "F", "stride_gm", "stride_dm"] + (["stride_qm", "stride_sm", "stride_sk"] if rows else []) + [
        "stride_qt", "stride_st_k", "stride_st_m", "stride_at", "stride_ats_k", "stride_ats_m", "stride_ab"]
    signature.update({name: "i32" for name in ints})
    constants = dict(GRAD_MAX=448.0, FP8_MAX=448.0, POW2=False, A_BLOCKS=a_blocks, BLOCK_N=block_n, LOAD=load,
                     STORE=store, SPREAD=gt.spread_layout(block_n // warps, warps), SLABS=g.slab_layout(load),
                     stride_st_k=1, stride_ats_k=1)
    if rows:
        constants.update(ROWS=g.row_layout(warps), ROW_M=g.ROW_M, stride_sm=1)
    signature.update({name: "constexpr" for name in constants})
    names = list(signature)
    aligned = [names.index(n) for n in (*row_ptrs, "qt_ptr", "st_ptr", "at_ptr", "ats_ptr", "amax_ptr", "M", "F",
                                        "stride_gm", "stride_dm", *(["stride_qm", "stride_sk"] if rows else []),
                                        "stride_qt", "stride_at", "stride_st_m", "stride_ats_m", "stride_ab")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}  # as the launch specializes them
    return triton.compile(GluonASTSource(kernel, signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


@pytest.mark.parametrize("a_blocks", [False, True], ids=["a_in_tiles", "a_in_blocks"])
def test_swiglu_backward_rows_and_columns_in_one_launch_compile_for_sm90_as_lean_as_their_kernels(a_blocks):
    """The one-launch form (`_swiglu_backward_rows_cols_kernel`) exists to move fewer HBM bytes than the Triton row
    kernel and the TMA column kernel (the second reader of a unit's gu and da finds them in L2), not to cost more
    per program: its column programs keep the TMA column kernel's loads, shared memory, stores and spills, and its
    row programs read 16-byte row segments (8 BF16, a thread's 4 tokens of gate, up and da) and write 8-byte FP8
    runs, with no shared memory of their own beyond the row maxima's reduction."""
    from megafp8.precision.kernels import gluon_tiles as gt, swiglu_cols_gluon as g

    block_n = gt.block_layouts(g.TOKENS_PER_THREAD, g.FEATURES_PER_THREAD, 4)[0]
    compiled = _swiglu_tma_compiled(g._swiglu_backward_rows_cols_kernel, a_blocks, rows=True)
    assert compiled.metadata.shared <= 3 * 2 * 128 * block_n + 64 * 4 + 64  # the column programs' blocks
    report, sass = _ptxas_and_sass(compiled.asm["ptx"])
    tokens_a_thread = g.ROW_M // (2 * 4)  # 2 tokens a warp, 4 warps
    # the row programs: gate, up and da as 16-byte loads, 4 tokens a thread; with a^T in blocks, the column programs'
    # block maxima too (a thread's 8 tokens, two 16-byte loads); no other global load
    loads = 3 * tokens_a_thread + (2 if a_blocks else 0)
    assert len(re.findall(r"\bLDG\.E\.128\b", sass)) == len(re.findall(r"\bLDG\b", sass)) == loads
    assert len(re.findall(r"\bUTMALDG\.3D\b", sass)) == 3
    assert len(re.findall(r"\bLDS\.64\b", sass)) == 3 * g.TOKENS_PER_THREAD
    assert len(re.findall(r"\bSTG\.E\.64\b", sass)) == 3 * g.FEATURES_PER_THREAD + 2 * tokens_a_thread
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) <= 16, report


@pytest.mark.parametrize("norm, gather, masked, col_blocks",
                         [(False, False, True, False), (True, False, True, False), (False, True, True, False),
                          (True, False, False, False), (True, False, False, True), (False, True, True, True)],
                         ids=["dy", "rmsnorm_partial_last_tile", "gather", "rmsnorm_whole_tiles",
                              "rmsnorm_whole_tiles_x_in_blocks", "gather_x_in_blocks"])
def test_the_gluon_rows_cols_kernel_compiles_for_sm90_lean_and_without_spills(norm, gather, masked, col_blocks):
    """The row + column quantizer (`rows_cols_gluon`, what SM90 runs for dy, RMSNorm's output and the MoE dispatch)
    exists to issue fewer instructions than the Triton kernel's 23 per element, which is what held that kernel to
    55-66% of copy speed: compiled for SM90 it must stay under 16 (12.3 plain, 14.8 with the norm, 13.4 gathering
    rows for the MoE dispatch, with a partial last token block), not spill, read 16-byte row segments and write
    8-byte FP8 row runs and 16-byte transposed runs. RMSNorm's tiles on whole token blocks (M a multiple of 128,
    what training runs) need no predicates on their loads and row stores: no more instructions than a partial
    one. (dy and the gather keep their predicates there: unmasked, dy's kernel was slower, job EN.) With x^T in
    128x128 blocks (`precision.fp8_wgrad_input_blocks`) the block's max costs one more reduction a tile."""
    from megafp8.precision.kernels import rows_cols_gluon as r

    compiled = _rows_cols_compiled(norm, gather, masked=masked, col_blocks=col_blocks)
    ptx = compiled.asm["ptx"]
    assert set(re.findall(r"ld\.global\.v\S+", ptx)) == {"ld.global.v4.b32"}
    assert {"st.global.v2.b32", "st.global.v4.b32"} <= set(re.findall(r"st\.global\.\S+", ptx))
    report, sass = _ptxas_and_sass(ptx)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    # RMSNorm's whole tiles and dy's (training's cases) spill nothing; a partial last tile or the gather's blocks
    # 4 bytes since the row maxima cross the warps through shared memory of their own (`_row_scales`)
    assert spills and max(spills) <= (0 if not masked or not (norm or gather) else 8), report
    assert not _packs_one_register_twice(sass)
    _assert_wide_shared_accesses(sass)
    per_element = _sass_instructions(sass) * 32 * r.WARPS / (128 * 128)
    assert 8 < per_element <= 16, f"{per_element:.1f} SASS instructions per element"
    if not masked:
        partial = _sass_instructions(_ptxas_and_sass(_rows_cols_compiled(norm, gather).asm["ptx"])[1])
        assert per_element <= partial * 32 * r.WARPS / (128 * 128), (per_element, partial)


def test_walking_the_token_blocks_first_changes_only_which_program_takes_which_tile():
    """`rows_cols_gluon.launch(rows_first=True)` (the gather's grid with its token blocks on the first axis) swaps
    the two program ids and nothing else: as many instructions as the default walk, the same memory accesses,
    shuffles, conversions and arithmetic (ptxas may pick other integer opcodes for the addresses)."""
    import collections

    def opcodes(rows_first: bool) -> collections.Counter:
        listing = _ptxas_and_sass(_rows_cols_compiled(False, True, rows_first=rows_first).asm["ptx"])[1]
        return collections.Counter(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+([A-Z][A-Z0-9.]*)", listing, re.M))

    walked, default = opcodes(True), opcodes(False)
    assert sum(walked.values()) == sum(default.values())
    work = ("LDG", "STG", "LDS", "STS", "SHFL", "F2FP", "FMNMX", "FMUL", "FFMA", "MUFU", "BAR")
    assert {op: n for op, n in walked.items() if op.startswith(work)} == \
        {op: n for op, n in default.items() if op.startswith(work)}


@pytest.mark.parametrize("masked", [False, True], ids=["whole_tiles", "partial_last_tile"])
def test_the_gluon_rope_backward_kernel_compiles_for_sm90_lean_and_without_spills(masked):
    """RoPE's backward quantizer as SM90 runs it (`rows_cols_gluon.launch_rope_backward`, its default layout), for
    heads of 128 and 64: 16-byte loads only (each feature's rotation partner is written as an offset the compiler
    can follow: through an XOR it loaded one element per instruction), no spills (a few bytes with masked loads),
    and fewer instructions than the Triton kernel's ~32 per element at 4 warps (26.8, and 31.1 masked, when
    written): the kernel is bound by the instructions it issues, as the row + column quantizer is."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from megafp8.precision.kernels import rows_cols_gluon as r

    signature = {name: "*bf16" for name in ("dq_ptr", "dk_ptr", "dv_ptr")}
    signature.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                      "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32"})
    signature.update({name: "i32" for name in ("M", "NQ", "NK", "seq_len", "stride_dq", "stride_dk", "stride_dv",
                                               "stride_cos", "stride_sin", "stride_qm", "stride_sm", "stride_sk",
                                               "stride_qt", "stride_st_k", "stride_st_m")})
    aligned = [n for n in signature if n.endswith("_ptr")] + [
        "NQ", "NK", "stride_dq", "stride_dk", "stride_dv", "stride_cos", "stride_sin", "stride_qm", "stride_sk",
        "stride_qt", "stride_st_m"]
    load, store_t, rows, cols = r.tile_layouts()
    for head_dim in (128, 64):
        constants = dict(HEAD_DIM=head_dim, MASKED=masked, FP8_MAX=448.0, POW2=False, LOAD=load, STORE_T=store_t,
                         ROWS=rows, COLS=cols, stride_sm=1, stride_st_k=1)
        config_signature = dict(signature, **{name: "constexpr" for name in constants})
        names = list(config_signature)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # as the launch specializes them
        compiled = triton.compile(GluonASTSource(r._rope_backward_quantize_gluon_kernel, config_signature,
                                                 constexprs=constants, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": r.WARPS})
        ptx = compiled.asm["ptx"]
        assert set(re.findall(r"ld\.global\S*", ptx)) == {"ld.global.v4.b32"}, head_dim
        report, sass = _ptxas_and_sass(ptx)
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
        # masked (a partial last tile, never in training): 4 bytes when written, 48 since `_row_scales`
        assert spills and max(spills) <= (64 if masked else 0), (head_dim, report)
        _assert_wide_shared_accesses(sass)
        per_element = _sass_instructions(sass) * 32 * r.WARPS / (128 * 128)
        assert 15 < per_element <= (32 if masked else 28), f"heads of {head_dim}: {per_element:.1f} per element"


def test_the_rope_backward_quantizer_compiles_for_sm90_without_spills_in_every_configuration():
    """RoPE's backward quantizer (`producers._rope_backward_quantize_kernel`, a Triton kernel) first held a whole
    128x128 FP32 tile and four loads per element: 255 registers at 8 warps, spilling, and 0.36 TB/s on the GPU;
    then its loads went one element per instruction. Every configuration its autotuner may pick must compile for
    SM90 without spilling, and read only 16-byte vectors."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megafp8.precision.kernels import producers

    kernel = producers._rope_backward_quantize_kernel
    signature = {name: "*bf16" for name in ("dq_ptr", "dk_ptr", "dv_ptr")}
    signature.update({"cos_ptr": "*fp32", "sin_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                      "qt_ptr": "*fp8e4nv", "st_ptr": "*fp32"})
    signature.update({name: "i32" for name in ("M", "N", "NQ", "NK", "seq_len", "stride_dq", "stride_dk", "stride_dv",
                                               "stride_cos", "stride_sin", "stride_qm", "stride_sm", "stride_sk",
                                               "stride_qt", "stride_st_k", "stride_st_m")})
    aligned = [name for name in signature if name.endswith("_ptr")] + [
        "N", "NQ", "NK", "stride_dq", "stride_dk", "stride_dv", "stride_cos", "stride_sin", "stride_qm", "stride_sk",
        "stride_qt", "stride_st_m"]
    for head_dim, config in itertools.product((128, 64), kernel.configs):  # Llama's and DeepSeek-V2-Lite-like heads
        constants = dict(HEAD_DIM=head_dim, FP8_MAX=448.0, POW2=False, stride_sm=1, stride_st_k=1, **config.kwargs)
        config_signature = dict(signature, **{name: "constexpr" for name in constants})
        names = list(config_signature)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # as the launch specializes them
        compiled = triton.compile(ASTSource(kernel.fn, config_signature, constexprs=constants, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps})
        assert set(re.findall(r"ld\.global\S*", compiled.asm["ptx"])) == {"ld.global.v4.b32"}, config
        report, _ = _ptxas_and_sass(compiled.asm["ptx"])
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
        assert spills and max(spills) == 0, (config, report)


def test_scales_reach_tma_rows_first_and_aligned_as_given_or_copied():
    """TMA reads each K step's scales as one row of 16-byte-aligned rows: scales already laid out so (our
    quantizers' rows-first scales over whole tiles) are used as given; any other layout (row-major, or a row count
    not a multiple of 4, one K step's scales expanded over several) is copied into one, with the same values."""
    from megafp8.precision.kernels.ws_gemm import _tma_scales

    def rows_first(rows: int, steps: int) -> torch.Tensor:
        return torch.randn(steps, rows).t()

    kept = rows_first(256, 5)
    assert _tma_scales(kept) is kept
    for scale in (torch.randn(391, 5), rows_first(391, 5), rows_first(256, 5)[1:], torch.randn(6, 1),
                  torch.randn(256, 1).expand(256, 4)):
        got = _tma_scales(scale)
        assert torch.equal(got, scale)
        assert got.stride(0) == 1 and got.stride(1) >= got.shape[0] and got.stride(1) % 4 == 0
        assert got.data_ptr() % 16 == 0


def test_outputs_leave_by_tma_only_where_tma_writes_what_the_register_epilogue_would(monkeypatch):
    """The warp-specialized kernel stores (or adds into FP32 main_grad, by TMA's reduction) its output tiles by TMA
    only where TMA writes what the register epilogue would (`ws_gemm.tma_store_fits`): BF16 or FP32, rows and
    start 16-byte aligned, a per-expert stack only when each expert's rows are whole 128-row tiles (TMA clips at the
    stacked matrix's edges, not at each expert's) and the stack is one matrix; asking for it elsewhere is an
    error. Shared memory holds the epilogue's buffers beside the stages (`_stages`)."""
    from megafp8.precision.kernels import ws_gemm

    c = torch.empty(256, 384, dtype=torch.bfloat16)
    assert ws_gemm.tma_store_fits(c, grouped_k=False, rows=256)
    assert ws_gemm.tma_store_fits(c.float(), grouped_k=False, rows=256)
    assert not ws_gemm.tma_store_fits(c.half().to(torch.float8_e4m3fn), grouped_k=False, rows=256)
    assert not ws_gemm.tma_store_fits(torch.empty(256, 388, dtype=torch.bfloat16)[:, :380], grouped_k=False,
                                      rows=256)  # rows 776 bytes apart
    assert not ws_gemm.tma_store_fits(torch.empty(256 * 384 + 4, dtype=torch.bfloat16)[4:].view(256, 384),
                                      grouped_k=False, rows=256)  # starts 8 bytes off
    stack = torch.empty(4, 256, 384)
    assert ws_gemm.tma_store_fits(stack, grouped_k=True, rows=256)
    assert not ws_gemm.tma_store_fits(torch.empty(4, 200, 384), grouped_k=True, rows=200)  # experts mid-tile
    assert not ws_gemm.tma_store_fits(torch.empty(4, 512, 384)[:, :256], grouped_k=True, rows=256)  # gaps
    assert ws_gemm.tma_reduce_available()  # the Triton this project runs (3.6) builds TMA's reduction
    assert ws_gemm.tma_store_fits(stack, grouped_k=True, rows=256, accumulate=True)
    monkeypatch.setattr(ws_gemm, "tma_reduce_available", lambda: False)  # a Triton without the reduction
    assert not ws_gemm.tma_store_fits(stack, grouped_k=True, rows=256, accumulate=True)
    assert ws_gemm.tma_store_fits(stack, grouped_k=True, rows=256)
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="tma_store_fits"):
        ws_gemm.ws_gemm(torch.empty(128, 128, dtype=torch.float8_e4m3fn), torch.ones(128, 1),
                        torch.empty(128, 128, dtype=torch.float8_e4m3fn), torch.ones(128, 1),
                        torch.empty(128, 128, dtype=torch.float16), b_blockwise=False, tma_store=True)
    # Stages beside the epilogue's buffers (the compile test checks the kernel's shared memory against SM90's):
    # from registers 4 (256 columns) and 6 (128); by TMA 3 and 5 in BF16, 3 and 4 in FP32.
    stages = {}
    for block_n in (128, 256):
        stages[block_n, None] = ws_gemm._stages(block_n)
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.empty(256, 384, dtype=dtype)
            buffers = 2 * ws_gemm.epilogue_buffers(out, block_n) * 64 * 128 * out.element_size()
            stages[block_n, dtype] = ws_gemm._stages(block_n, buffers)
    assert stages == {(128, None): 6, (128, torch.bfloat16): 5, (128, torch.float32): 4,
                      (256, None): 4, (256, torch.bfloat16): 3, (256, torch.float32): 3}
    assert not ws_gemm.tma_store_fits(torch.empty(256, 1).expand(256, 384), grouped_k=False, rows=256)  # stride 0
    from megafp8.precision.kernels import gemm
    fp8 = torch.empty(128, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="tma_store=True chooses the warp-specialized kernel's epilogue"):
        gemm.grouped_gemm(fp8, torch.ones(128, 1), fp8.view(1, 128, 128), torch.ones(1, 1, 1),
                          torch.zeros(1, dtype=torch.int32), torch.bfloat16, kernel="tma", tma_store=True)
