"""FFMA interleaving: a post-pass over a compiled kernel's SASS that lets the warp scheduler switch warps inside the
warp-specialized GEMM's promotion (DeepGEMM's technique, its `interleave_ffma`; our own implementation).

Why: each K step a consumer warpgroup scales its FP32 product into the accumulator with a run of 64 FFMAs (one per
register of its 64 x 128 product). ptxas sets the same yield flag on nearly every FFMA of such a run and has each
keep its shared scale operand in the operand reuse cache; by DeepGEMM's reading (which we did not measure
directly) a warp then issues the whole run before the scheduler turns to another warp, and the other consumer's
next wgmma waits behind it. This pass clears the reuse flag and flips the yield flag on every other FFMA of the
first ~9/16 of each long run, so the scheduler may issue another warp's instructions between them. Both flags are
scheduling hints, not semantics: the reuse cache is only a read-bandwidth saving (without the flag the operand is
read from the register file) and yielding only lets other warps in, so the kernel computes the same bits (GPU
test).

How: the cubin is an ELF file; `cuobjdump -sass` lists each function's instructions with their offsets in its
`.text.<function>` section and their two 64-bit words. The control flags are bits of the high word (Volta and
later: 4 stall bits at 41, yield at 45, barriers, then the operand reuse flags at 58-61; the run's shared operand
is the second source, bit 59). Each patched word is checked against the listing before it is written.

`patching_ffma(marker)` installs the pass around a launch: a Triton pipeline hook that patches the cubin of any
kernel whose PTX holds `marker` (a comment the kernel's own inline assembly carries only in its interleaved
variant, a distinct constexpr and so a distinct Triton cache entry). Kernels compiled outside it are not patched.
Where the pass cannot run (no cuobjdump, a listing it does not understand) the kernel keeps ptxas's cubin and a
warning says so: the same results, only without the gain.
"""
from __future__ import annotations

import contextlib
import os
import re
import struct
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from typing import Iterator

REUSE_B = 1 << 59  # operand reuse flag of the second source operand, in the high word
YIELD = 1 << 45  # the yield flag, in the high word
MIN_RUN = 8  # FFMA runs shorter than this are left alone (DeepGEMM: 16 listing lines)
FRACTION = (9, 16)  # the share of each run patched (DeepGEMM found 9/16 ~0.5% faster than the whole run)

_INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")
_HIGH_WORD = re.compile(r"^\s+/\*\s*(0x[0-9a-f]{16})\s*\*/\s*$")


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction of a function: its byte offset in the function's text section, its text, its words."""
    offset: int
    text: str
    low: int
    high: int

    @property
    def opcode(self) -> str:
        words = self.text.split()
        return words[1] if words[0].startswith("@") else words[0]

    @property
    def second_source(self) -> str:
        """The register of the second source operand (b of `FFMA d, a, b, c`), without modifiers; "" if none."""
        operands = self.text.split(None, 2 if self.text.startswith("@") else 1)[-1].split(",")
        register = re.search(r"R\d+|RZ", operands[2]) if len(operands) > 2 else None
        return register.group(0) if register else ""


def parse_sass(listing: str) -> dict[str, list[Instruction]]:
    """cuobjdump -sass's listing -> {function name: its instructions in order}."""
    functions: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []
    lines = listing.splitlines()
    for i, line in enumerate(lines):
        if "Function :" in line:
            current = functions.setdefault(line.split("Function :", 1)[1].strip(), [])
            continue
        match = _INSTRUCTION.match(line)
        if match and i + 1 < len(lines):
            high = _HIGH_WORD.match(lines[i + 1])
            if high:
                current.append(Instruction(int(match.group(1), 16), match.group(2).rstrip(" ;"),
                                           int(match.group(3), 16), int(high.group(1), 16)))
    return functions


def ffma_runs(instructions: list[Instruction], min_run: int = MIN_RUN) -> list[list[Instruction]]:
    """Maximal runs of consecutive FFMAs, at least `min_run` long."""
    runs, current = [], []
    for instruction in instructions + [None]:
        if instruction is not None and instruction.opcode.startswith("FFMA"):
            current.append(instruction)
            continue
        if len(current) >= min_run:
            runs.append(current)
        current = []
    return runs


def interleaved_high_words(run: list[Instruction], fraction: tuple[int, int] = FRACTION) -> dict[int, int]:
    """{offset: new high word} for one FFMA run (DeepGEMM's rule): within its first `fraction`, an FFMA that keeps
    its second source (the scale) in the reuse cache gets that flag cleared and its yield flag flipped where the
    register is new to the run, or where the FFMA before read the same register and kept its flag. Along a run
    sharing one scale register this changes every other FFMA."""
    changed: dict[int, int] = {}
    seen: set[str] = set()
    last_reused, last_register = False, ""
    for instruction in run[:len(run) * fraction[0] // fraction[1]]:
        register = instruction.second_source
        reused = bool(instruction.high & REUSE_B)
        if reused and (register not in seen or (last_reused and register == last_register)):
            changed[instruction.offset] = instruction.high ^ (REUSE_B | YIELD)
            reused = False
        seen.add(register)
        last_reused, last_register = reused, register
    return changed


def text_sections(cubin: bytes) -> dict[str, tuple[int, int]]:
    """{section name: (file offset, size)} of a 64-bit little-endian ELF file's sections."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file (a cubin)")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]

    def name(index: int) -> str:
        end = cubin.index(b"\0", names_at + index)
        return cubin[names_at + index:end].decode()
    return {name(h[0]): (h[4], h[5]) for h in headers}


def disassemble(cubin: bytes) -> str:
    """cuobjdump -sass of `cubin` (Triton's bundled cuobjdump)."""
    from triton import knobs
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", path], capture_output=True, text=True,
                              check=True).stdout


def interleave_ffma(cubin: bytes, listing: str | None = None,
                    fraction: tuple[int, int] = FRACTION) -> tuple[bytes, int]:
    """(patched cubin, number of FFMAs changed): every function's long FFMA runs interleaved
    (`interleaved_high_words`). `listing`: cuobjdump -sass of `cubin` (made here if not given)."""
    functions = parse_sass(listing if listing is not None else disassemble(cubin))
    sections = text_sections(cubin)
    patched = bytearray(cubin)
    count = 0
    for function, instructions in functions.items():
        start, size = sections[f".text.{function}"]
        for run in ffma_runs(instructions):
            for offset, high in interleaved_high_words(run, fraction).items():
                at = start + offset
                instruction = next(i for i in run if i.offset == offset)
                if offset + 16 > size or struct.unpack_from("<QQ", patched, at) != (instruction.low,
                                                                                    instruction.high):
                    raise ValueError(f"{function}+{offset:#x}: the cubin's bytes are not the listing's")
                struct.pack_into("<Q", patched, at + 8, high)
                count += 1
    return bytes(patched), count


@contextlib.contextmanager
def patching_ffma(marker: str) -> Iterator[None]:
    """While inside: Triton compiles the cubin of every kernel whose PTX contains `marker` with its FFMA runs
    interleaved (`interleave_ffma`). Installs a pipeline-stage hook (chaining any hook already set) and restores
    the previous one on exit; kernels already compiled, or found in Triton's cache, are not recompiled."""
    from triton import knobs
    previous = knobs.runtime.add_stages_inspection_hook

    def hook(backend, stages, options, language, capability):
        if previous is not None:
            previous(backend, stages, options, language, capability)
        make_cubin = stages["cubin"]

        def cubin_stage(src, metadata):
            cubin = make_cubin(src, metadata)
            if marker not in src:
                return cubin
            try:
                return interleave_ffma(cubin)[0]
            except (OSError, RuntimeError, subprocess.CalledProcessError, ValueError,
                    KeyError) as error:  # no cuobjdump, or a listing this pass does not understand
                warnings.warn(f"FFMA interleaving skipped, the kernel runs as ptxas made it (the same results, "
                              f"slightly slower): {type(error).__name__}: {error}", stacklevel=2)
                return cubin
        stages["cubin"] = cubin_stage

    knobs.runtime.add_stages_inspection_hook = hook
    try:
        yield
    finally:
        knobs.runtime.add_stages_inspection_hook = previous
