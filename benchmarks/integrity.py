#!/usr/bin/env python
"""What the integrity guarantees cost on this machine: checkpoint checksums, the finite check, the step guard.

    python benchmarks/integrity.py [--gib 1] [--dir /tmp]

Prints two markdown tables. Checkpoints (seconds per GiB and GiB/s): xxh3_64 (the checkpoint checksum) and
zlib's CRC32 over a buffer in memory; a one-file checkpoint written with `torch.save` alone and with
`save_checkpoint` (hashing every byte as it is written, then the manifest, fsyncs and the rename);
`verify_checkpoint` re-reading and hashing it (from the page cache: the file was just written); and the
isfinite pass run over the state before every save. The non-finite guard (milliseconds per optimizer step):
torch's fused AdamW over the state with and without the skip flag, and the guard's own bookkeeping.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megafp8.checkpoint.local import save_checkpoint, verify_checkpoint  # noqa: E402
from megafp8.parallel import ParallelDims  # noqa: E402
from megafp8.train.nonfinite import NonFiniteGuard  # noqa: E402


def timed(fn: Callable[[], object], repeats: int = 3) -> float:
    """The best of `repeats` wall times of `fn()`, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def plain_save(state: dict, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def rows(gib: float, directory: Path) -> list[tuple[str, float]]:
    """(what, seconds for `gib` GiB) for each measurement."""
    numel = int(gib * 2**30 / 4)
    state = {"model": {"w": torch.randn(numel)}, "optimizer": {}, "step": 1, "loader": {}}
    data = memoryview(state["model"]["w"].numpy()).cast("B")
    out = []
    out.append(("xxh3_64 of a buffer in memory", timed(lambda: xxhash.xxh3_64_intdigest(data))))
    out.append(("zlib.crc32 of a buffer in memory", timed(lambda: zlib.crc32(data))))
    out.append(("torch.save to a file, fsynced (no checksum)", timed(lambda: plain_save(state, directory / "plain.pt"))))
    root = directory / "ck"
    out.append(("save_checkpoint: hashed while written, manifest, fsyncs, rename",
                timed(lambda: save_checkpoint(root, 1, state, keep_last=1))))
    out.append(("verify_checkpoint: re-read (page cache) and hash", timed(lambda: verify_checkpoint(root / "step_00000001"))))
    out.append(("isfinite over the state (the check before every save)",
                timed(lambda: torch.isfinite(state["model"]["w"]).all().item())))
    return out


def adamw(params: torch.Tensor, moments: list[torch.Tensor], skip: torch.Tensor | None) -> None:
    torch._fused_adamw_([params], [params], [moments[0]], [moments[1]], [], [torch.ones(())], lr=1e-3, beta1=0.9,
                        beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False, found_inf=skip)


def guard_rows(gib: float) -> list[tuple[str, float]]:
    """(what, seconds per optimizer step) of the non-finite guard's parts, for a state of `gib` GiB of masters."""
    params = torch.randn(int(gib * 2**30 / 4))
    moments = [torch.zeros_like(params), torch.zeros_like(params)]
    norm = params.square().sum().sqrt()
    guard = NonFiniteGuard(optimizer=None, limit=3, device=params.device, dims=ParallelDims.single())  # type: ignore

    def bookkeeping() -> torch.Tensor:
        applied = torch.isfinite(norm)
        skip = torch.logical_not(applied).float()
        guard.record(1, applied)
        return skip
    return [("fused AdamW step, as before", timed(lambda: adamw(params, moments, None))),
            ("fused AdamW step with the skip flag (found_inf)", timed(lambda: adamw(params, moments, bookkeeping()))),
            ("the guard's bookkeeping alone (isfinite of the norm, counters)", timed(bookkeeping, repeats=100))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the state (FP32), GiB")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        measured = rows(args.gib, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"| {args.gib:g} GiB state, {os.cpu_count()} CPU core(s), torch {torch.__version__} | s per GiB | GiB/s |")
    print("|---|---|---|")
    for what, seconds in measured:
        print(f"| {what} | {seconds / args.gib:.3f} | {args.gib / seconds:.2f} |")
    print(f"\n| optimizer step over {args.gib:g} GiB of FP32 masters | ms per step |")
    print("|---|---|")
    for what, seconds in guard_rows(args.gib):
        print(f"| {what} | {seconds * 1e3:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
