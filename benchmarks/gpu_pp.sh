#!/usr/bin/env bash
# Two-GPU pipeline parallelism: the ~1B dense shape at PP=1 (one GPU) and PP=2 (two GPUs, NCCL) under every
# schedule, same seed and global batch (8 micro-batches of 2 x 2048 tokens), BF16 and FP8; per-step losses and
# step times compared by tools/compare_runs.py. Usage: OUT=dir bash benchmarks/gpu_pp.sh
source "$(dirname "$0")/gpu_lib.sh"
stdlib_corpus
STEPS=${STEPS:-20}
ONE_B="$ONE_B_MODEL training.micro_batch_size=2
  training.global_batch_size=16 training.steps=$STEPS optimizer.lr=3e-4 optimizer.min_lr=3e-5 optimizer.warmup_steps=10
  training.eval_interval=0 logging.log_interval=1 logging.output_dir=/tmp/runs_pp"
for recipe in ${RECIPES:-bf16 fp8}; do
  python launch/pretrain.py --config tiny_dense $ONE_B precision.recipe=$recipe run_name=${recipe}_pp1 \
    > "$OUT/${recipe}_pp1.log" 2>&1
  runs=/tmp/runs_pp/${recipe}_pp1
  for schedule in ${SCHEDULES:-1f1b interleaved_1f1b interleaved_zb zbv dualpipev}; do
    torchrun --standalone --nproc_per_node=2 launch/pretrain.py --config tiny_dense $ONE_B precision.recipe=$recipe \
      parallel.pp=2 parallel.pp_schedule=$schedule run_name=${recipe}_pp2_$schedule > "$OUT/${recipe}_pp2_$schedule.log" 2>&1
    runs="$runs /tmp/runs_pp/${recipe}_pp2_$schedule"
  done
  python tools/compare_runs.py $runs --skip 5 | tee "$OUT/${recipe}_pp_compare.md"
done
grep -h "pipeline:" "$OUT"/*pp2*.log | sed 's/.*pipeline:/pipeline:/' | cut -c1-140 | sort -u | tee "$OUT/bubbles.txt"
tail -n 2 "$OUT"/*pp*.log
