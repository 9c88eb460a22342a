#!/usr/bin/env bash
# Two-GPU tensor parallelism: gpu tests, then the ~1B dense shape at TP=1 (one GPU) and TP=2 (two GPUs,
# NCCL), same seed and global batch, BF16 and FP8, with and without sequence parallelism; per-step
# losses and step times compared by tools/compare_runs.py. Usage: OUT=dir bash benchmarks/gpu_tp.sh
source "$(dirname "$0")/gpu_lib.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
[ -n "${SKIP_TESTS:-}" ] || python -m pytest -q -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.log"
stdlib_corpus
STEPS=${STEPS:-30}
ONE_B="$ONE_B_MODEL training.micro_batch_size=8
  training.global_batch_size=8 training.steps=$STEPS optimizer.lr=3e-4 optimizer.min_lr=3e-5 optimizer.warmup_steps=10
  training.eval_interval=0 logging.log_interval=1 logging.output_dir=/tmp/runs"
for recipe in ${RECIPES:-bf16 fp8}; do
  python launch/pretrain.py --config tiny_dense $ONE_B precision.recipe=$recipe run_name=${recipe}_tp1 \
    > "$OUT/${recipe}_tp1.log" 2>&1
  for sp in false true; do
    torchrun --standalone --nproc_per_node=2 launch/pretrain.py --config tiny_dense $ONE_B precision.recipe=$recipe \
      parallel.tp=2 parallel.sequence_parallel=$sp run_name=${recipe}_tp2_sp_$sp > "$OUT/${recipe}_tp2_sp_$sp.log" 2>&1
  done
  python tools/compare_runs.py /tmp/runs/${recipe}_tp1 /tmp/runs/${recipe}_tp2_sp_false /tmp/runs/${recipe}_tp2_sp_true \
    --skip 10 | tee "$OUT/${recipe}_compare.md"
done
tail -n 3 "$OUT"/*tp*.log
