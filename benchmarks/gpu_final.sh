#!/usr/bin/env bash
# Issue 10's measurement call on a 2-GPU H200 host: the FP8 gpu tests, then whole training steps (one GPU: ~1B
# dense eager and compiled, the small MoE eager; two GPUs, data parallel: ~1B dense compiled), then the plain-
# PyTorch/torchao yardstick on the same shape. Tables go to $OUT/summary.md, logs to $OUT/logs.tar.gz.
# Usage: OUT=dir bash benchmarks/gpu_final.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megafp8-gpu}
LOGS=$(mktemp -d)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/summary.md"
step() {  # step NAME command...: run, append its stdout to the summary, keep its stderr
  local name=$1; shift
  local t0=$SECONDS
  echo "## $name" >> "$OUT/summary.md"
  "$@" >> "$OUT/summary.md" 2> "$LOGS/$name.log" || echo "FAILED (rc $?): $(tail -n 3 "$LOGS/$name.log")" >> "$OUT/summary.md"
  echo "($((SECONDS - t0)) s)" >> "$OUT/summary.md"
  echo >> "$OUT/summary.md"
}
if ls wheels/torchao-*.whl > /dev/null 2>&1 && ! python -c "import torchao" 2>/dev/null; then
  python -m pip install -q --no-deps --no-index wheels/torchao-*.whl > "$LOGS/torchao_install.log" 2>&1
fi
STEPS="--steps 25 --warmup 10"
step gpu_tests python -m pytest -q -m gpu tests/test_fp8_gpu.py -x
step ours_eager python benchmarks/train_step.py $STEPS --model 1b --recipes bf16 fp8
step ours_compiled python benchmarks/train_step.py training.compile=true $STEPS --model 1b --recipes bf16 fp8
step moe_eager python benchmarks/train_step.py $STEPS --model moe --recipes bf16 fp8
step ours_compiled_2gpu torchrun --nproc_per_node=2 benchmarks/train_step.py training.compile=true $STEPS \
  --model 1b --global-batch 16 --recipes bf16 fp8
step reference_compiled python benchmarks/reference_model.py --compile --steps 15 --recipes bf16 torchao-tensorwise
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
