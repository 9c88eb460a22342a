#!/usr/bin/env bash
# GPU session script for the FP8 path: gpu-marked tests, then the FP8 linear benchmark.
# Usage (GPU machine, repo root): OUT=/some/dir bash benchmarks/gpu_fp8.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megafp8-gpu}
mkdir -p "$OUT"
python -m pytest -q -m gpu tests/test_fp8_gpu.py tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
python benchmarks/fp8_linear.py --profile 2>&1 | tee "$OUT/fp8_linear.md"
