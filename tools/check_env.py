#!/usr/bin/env python
"""What this machine gives megafp8: torch, the GPUs, the precision `auto` picks, which FP8 backends run here (and,
for each that does not, why), and the attention kernels `model.attention_backend: auto` prefers.

    python tools/check_env.py            # a short report; exit status 0
    python tools/check_env.py --json     # the same, as JSON

Run it on a new cluster's compute node before the first job: it says whether the FP8 recipe gets its fast kernels
there (on an H100/H200, `hopper`, or `deepgemm` where DeepGEMM is installed: `tools/install_deepgemm.py`), and what is
missing where it does not. It asks each backend exactly what a training run asks at start-up, so where DeepGEMM is
installed its check runs once, in a child process, as a run's would (seconds; longer the first time, while its JIT
compiles). It allocates no model and starts no process group.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megafp8.config import PrecisionConfig  # noqa: E402
from megafp8.model.sdpa import sdpa_backends_for  # noqa: E402
from megafp8.precision import backend_names, passed_over, resolve_recipe, select_backend, why_unavailable  # noqa: E402
from megafp8.config.arguments import run_tool  # noqa: E402

# Packages megafp8 can use beyond torch, and what for.
OPTIONAL = {
    "triton": "the GPU FP8 backends' kernels, on CUDA machines",
    "safetensors": "Hugging Face checkpoint conversion",
    "tokenizers": "tokenizer.json tokenizers (data preparation)",
    "transformers": "checking conversions against Hugging Face's own models, in the tests",
    "numpy": "data loading",
    "pyyaml": "configs",
}


def package_version(name: str) -> Optional[str]:
    """The installed version of distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def devices() -> list[dict[str, Any]]:
    """Each visible CUDA device: its name, compute capability and memory."""
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
                      "memory_gib": round(props.total_memory / 2**30, 1)})
    return found


def fp8_backends(device: torch.device) -> dict[str, Optional[str]]:
    """Each registered FP8 backend: None where it runs on `device`, else why not."""
    return {name: why_unavailable(name, device) for name in backend_names() if name != "auto"}


def report(device: torch.device) -> dict[str, Any]:
    """Everything this tool says, for `device` (the first GPU, or the CPU)."""
    recipe, why_recipe = resolve_recipe("auto", device, PrecisionConfig().auto_cpu_recipe)
    backends = fp8_backends(device)
    chosen = select_backend("auto", device)
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
    attention = sdpa_backends_for("auto", device)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "devices": devices(),
        "checked_on": str(device),
        "precision_auto": {"recipe": recipe, "why": why_recipe},
        "fp8_backends": backends,
        "fp8_backend_auto": {"backend": chosen.name,
                             "passed_over": {name: why for name, why in passed_over(chosen, device)}},
        "attention_auto": ([b.name.lower() for b in attention] if attention else "torch's own order"),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "packages": {name: package_version(name) for name in OPTIONAL},
    }


def render(facts: dict[str, Any]) -> str:
    """The report as lines for a terminal."""
    lines = [f"python {facts['python']}, torch {facts['torch']} (CUDA {facts['cuda'] or 'none'}, "
             f"NCCL {facts['nccl'] or 'none'})"]
    if facts["devices"]:
        lines += [f"GPU {d['index']}: {d['name']}, SM{d['capability'].replace('.', '')}, {d['memory_gib']} GiB"
                  for d in facts["devices"]]
    else:
        lines.append("no CUDA GPU visible: CPU only")
    auto = facts["precision_auto"]
    lines.append(f"precision.recipe auto -> {auto['recipe']} ({auto['why']})")
    lines.append(f"FP8 backends on {facts['checked_on']}:")
    width = max(map(len, facts["fp8_backends"]))
    lines += [f"  {name:<{width}}  {'runs' if why is None else 'no: ' + why}"
              for name, why in facts["fp8_backends"].items()]
    picked = facts["fp8_backend_auto"]
    lines.append(f"precision.fp8_backend auto -> {picked['backend']}")
    lines += [f"  (not {name}: {why})" for name, why in picked["passed_over"].items()]
    order = facts["attention_auto"]
    lines.append(f"model.attention_backend auto -> {order if isinstance(order, str) else ', then '.join(order)} "
                 f"(cuDNN {facts['cudnn'] or 'none'})")
    lines.append("packages:")
    lines += [f"  {name:<12} {version or 'not installed':<14} for {OPTIONAL[name]}"
              for name, version in facts["packages"].items()]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    facts = report(device)
    print(json.dumps(facts, indent=2) if args.json else render(facts))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
