"""The FFMA interleaving pass (`megafp8.precision.kernels.ffma_interleave`) on a synthetic cubin and listing: which
instructions it changes, that it changes only their reuse and yield flags, and that it refuses a cubin whose bytes
are not the listing's. (The real kernel's cubin: `tests/test_ws_gemm_compiles.py`; its bits on a GPU:
`tests/test_moe_gpu.py`.)"""
from __future__ import annotations

import struct

import pytest

from megafp8.precision.kernels import ffma_interleave as fi

STALLS = 0x000fe20000000000  # a high word's plain control bits (stall count, barriers), no reuse, no yield


def _listing(function: str, instructions: list[tuple[str, int, int]]) -> str:
    """cuobjdump -sass's layout: a function header, then each instruction's text and low word, its high word on the
    next line."""
    lines = ["\tcode for sm_90a", f"\t\tFunction : {function}", "\t.headerflags\t@\"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
    for i, (text, low, high) in enumerate(instructions):
        lines.append(f"        /*{16 * i:04x}*/                   {text} ;     /* {low:#018x} */")
        lines.append(f"                                                          /* {high:#018x} */")
    return "\n".join(lines) + "\n"


def _elf(sections: dict[str, bytes]) -> bytes:
    """A minimal 64-bit little-endian ELF file holding `sections` (and the section-name table)."""
    names = b"\0" + b"".join(name.encode() + b"\0" for name in [*sections, ".shstrtab"])
    body, offsets = b"", {}
    for name, data in sections.items():
        offsets[name] = 64 + len(body)
        body += data
    shstr_at = 64 + len(body)
    body += names
    shoff = 64 + len(body)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(sections) + 2, len(sections) + 1)
    table = bytes(64)  # section 0: null
    for name, data in [*sections.items(), (".shstrtab", names)]:
        at = shstr_at if name == ".shstrtab" else offsets[name]
        table += struct.pack("<IIQQQQ", names.index(name.encode() + b"\0"), 1, 0, 0, at, len(data)) + bytes(24)
    return bytes(header) + body + table


def _function(instructions: list[tuple[str, int, int]]) -> bytes:
    return b"".join(struct.pack("<QQ", low, high) for _, low, high in instructions)


def _promotion(count: int, scale: str = "R4", first: int = 100) -> list[tuple[str, int, int]]:
    """A promotion's run of FFMAs `acc = t * scale + acc`, each keeping the scale in the reuse cache."""
    return [(f"FFMA R{first + i}, R{20 + i}, {scale}.reuse, R{first + i}", 0x7223 + (i << 16),
             STALLS | fi.REUSE_B | fi.YIELD) for i in range(count)]


def test_every_other_ffma_of_the_first_nine_sixteenths_of_a_long_run_gets_its_reuse_cleared_and_yield_flipped():
    other = [("WARPGROUP.DEPBAR.LE gsb0, 0x0", 0x79a7, STALLS | fi.YIELD)]
    short = _promotion(7, first=200)  # too short to touch
    run = _promotion(32)
    code = other + run + other + short + [("EXIT", 0x794d, STALLS)]
    cubin = _elf({".text._k": _function(code), ".nv.info": b"\x04\x2f" * 8})
    patched, changed = fi.interleave_ffma(cubin, _listing("_k", code))
    assert changed == 9  # the first 18 of 32 (9/16): the 1st, 3rd, ... 17th
    start = fi.text_sections(cubin)[".text._k"][0]
    words = [struct.unpack_from("<QQ", patched, start + 16 * i) for i in range(len(code))]
    for i, ((_, low, high), (new_low, new_high)) in enumerate(zip(code, words)):
        in_run = 1 <= i <= 32
        expected = high ^ (fi.REUSE_B | fi.YIELD) if in_run and (i - 1) < 18 and (i - 1) % 2 == 0 else high
        assert (new_low, new_high) == (low, expected), i
    assert patched[:start] == cubin[:start] and patched[start + 16 * len(code):] == cubin[start + 16 * len(code):]


def test_a_run_switching_between_scale_registers_restarts_the_pattern_on_each_new_register():
    run = _promotion(8, "R4") + _promotion(8, "R5", first=150)
    changed = fi.interleaved_high_words([fi.Instruction(16 * i, text.replace(";", ""), low, high)
                                         for i, (text, low, high) in enumerate(run)])
    assert sorted(offset // 16 for offset in changed) == [0, 2, 4, 6, 8]  # the first 9 of 16: R4 x 8, R5 x 1


def test_instructions_without_a_reused_scale_are_left_alone():
    run = [(f"FFMA R{100 + i}, R{20 + i}, R{60 + i}, R{100 + i}", 0x7223, STALLS | fi.YIELD) for i in range(16)]
    cubin = _elf({".text._k": _function(run)})
    patched, changed = fi.interleave_ffma(cubin, _listing("_k", run))
    assert changed == 0 and patched == cubin


def test_a_cubin_whose_bytes_are_not_the_listings_is_refused():
    run = _promotion(16)
    cubin = _elf({".text._k": _function(run)})
    listing = _listing("_k", [(text, low + 1, high) for text, low, high in run])
    with pytest.raises(ValueError, match="not the listing's"):
        fi.interleave_ffma(cubin, listing)
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        fi.interleave_ffma(b"\x7fELF\x01\x01" + cubin[6:], _listing("_k", run))


def test_the_pipeline_hook_is_restored_and_patches_only_marked_kernels():
    knobs = pytest.importorskip("triton").knobs
    before = knobs.runtime.add_stages_inspection_hook
    run = _promotion(16)
    cubin = _elf({".text._k": _function(run)})
    listing = _listing("_k", run)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fi, "disassemble", lambda binary: listing)
        with fi.patching_ffma("marker-1"):
            stages = {"cubin": lambda src, metadata: cubin}
            knobs.runtime.add_stages_inspection_hook(None, stages, None, None, 90)
            assert stages["cubin"]("// marker-1\n", {}) != cubin
            assert stages["cubin"]("// another kernel\n", {}) == cubin
    assert knobs.runtime.add_stages_inspection_hook is before


def test_a_kernel_the_pass_cannot_patch_keeps_its_cubin_with_a_warning():
    """No cuobjdump (or a listing the pass does not understand) must not stop the kernel from compiling: the
    marked kernel keeps ptxas's cubin, and a warning says the interleaving was skipped."""
    knobs = pytest.importorskip("triton").knobs
    cubin = _elf({".text._k": _function(_promotion(16))})

    def no_cuobjdump(binary):
        raise FileNotFoundError("cuobjdump")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fi, "disassemble", no_cuobjdump)
        with fi.patching_ffma("marker-1"):
            stages = {"cubin": lambda src, metadata: cubin}
            knobs.runtime.add_stages_inspection_hook(None, stages, None, None, 90)
            with pytest.warns(UserWarning, match="FFMA interleaving skipped.*FileNotFoundError"):
                assert stages["cubin"]("// marker-1\n", {}) == cubin
