#!/usr/bin/env bash
# FP8-vs-BF16 loss parity on two GPUs at once: the ~1B dense shape (hidden 2048, 16 layers, FFN 5632, vocab 32768),
# seq 2048, one micro-batch of 8 per step, the same seed and data, BF16 on GPU 0 and per-tile FP8 on GPU 1, for
# STEPS optimizer steps (default 2000; warmup 200, cosine 3e-4 -> 3e-5). The metrics files land in $OUT; compare them
# with `python tools/compare_runs.py` and plot with `python tools/plot_runs.py`.
# Usage: OUT=dir bash benchmarks/gpu_parity.sh
source "$(dirname "$0")/gpu_lib.sh"
stdlib_corpus
STEPS=${STEPS:-2000}
ONE_B="$ONE_B_MODEL training.micro_batch_size=8
  training.global_batch_size=8 training.steps=$STEPS optimizer.lr=3e-4 optimizer.min_lr=3e-5 optimizer.warmup_steps=200
  training.eval_interval=500 training.eval_iters=8 logging.log_interval=10 logging.output_dir=$OUT"
for recipe in bf16 fp8; do
  gpu=$([ $recipe = bf16 ] && echo 0 || echo 1)
  CUDA_VISIBLE_DEVICES=$gpu python launch/pretrain.py --config tiny_dense $ONE_B precision.recipe=$recipe \
    run_name=parity_$recipe > "$OUT/parity_$recipe.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/parity_*.log
