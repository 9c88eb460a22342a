#!/usr/bin/env bash
# FP8 health monitoring overhead on the ~1B dense model (FP8, one GPU): sampled every step, every 100 steps, off.
# Usage: OUT=dir bash benchmarks/gpu_health.sh
source "$(dirname "$0")/gpu_lib.sh"
stdlib_corpus
ONE_B="$ONE_B_MODEL training.micro_batch_size=8
  training.global_batch_size=8 training.steps=30 optimizer.lr=3e-4 optimizer.warmup_steps=10 training.eval_interval=0
  logging.log_interval=10 logging.output_dir=/tmp/runs precision.recipe=fp8"
for interval in 0 1 100; do
  python launch/pretrain.py --config tiny_dense $ONE_B logging.fp8_health_interval=$interval run_name=health_$interval \
    2>&1 | grep -E "^step" | sed "s/^/interval $interval: /" | tee -a "$OUT/health.log"
done
