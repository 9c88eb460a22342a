#!/usr/bin/env bash
# Issue 10 on one H200: whole training steps of the ~1B dense and the small MoE model in BF16 and FP8, eager and
# compiled (benchmarks/train_step.py), the plain-PyTorch yardstick in BF16 and torchao's float8 recipes on the
# same shape in the same job (benchmarks/reference_model.py; torchao's wheel carried in wheels/), and kernel-time
# profiles of the steps. Every table lands in $OUT. Usage: OUT=dir bash benchmarks/gpu_e2e.sh [parts...]
# Parts (default all, in this order): ours ref compiled profile moe
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megafp8-gpu}
mkdir -p "$OUT"
PARTS=${*:-ours ref compiled profile moe}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
git log -1 --format=%h 2>/dev/null | tee "$OUT/commit.txt"
if ls wheels/torchao-*.whl > /dev/null 2>&1 && ! python -c "import torchao" 2>/dev/null; then
  pip install -q --no-deps wheels/torchao-*.whl > "$OUT/torchao_install.log" 2>&1
fi
for part in $PARTS; do
  case $part in
    ours) python benchmarks/train_step.py --model 1b --recipes bf16 fp8 > "$OUT/ours_eager.md" 2> "$OUT/ours_eager.log" ;;
    ref) python benchmarks/reference_model.py --compile --recipes bf16 torchao-tensorwise torchao-rowwise \
           > "$OUT/reference_compiled.md" 2> "$OUT/reference_compiled.log"
         python benchmarks/reference_model.py --recipes bf16 torchao-blockwise \
           > "$OUT/reference_eager.md" 2> "$OUT/reference_eager.log" ;;
    compiled) python benchmarks/train_step.py --model 1b --recipes bf16 fp8 training.compile=true \
           > "$OUT/ours_compiled.md" 2> "$OUT/ours_compiled.log" ;;
    profile) python benchmarks/train_step.py --model 1b --recipes bf16 fp8 --profile 3 \
           > "$OUT/profile_eager.md" 2> "$OUT/profile_eager.log"
         python benchmarks/train_step.py --model 1b --recipes bf16 fp8 --profile 3 training.compile=true \
           > "$OUT/profile_compiled.md" 2> "$OUT/profile_compiled.log" ;;
    moe) python benchmarks/train_step.py --model moe --recipes bf16 fp8 > "$OUT/moe_eager.md" 2> "$OUT/moe_eager.log" ;;
  esac
  echo "== $part done"; cat "$OUT"/*.md 2>/dev/null | tail -n 4
done
