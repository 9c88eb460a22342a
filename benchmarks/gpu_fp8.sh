#!/usr/bin/env bash
# GPU session script for the FP8 path: gpu-marked tests, the FP8 linear benchmark, and BF16 vs FP8
# training throughput of the ~1B dense shape.  Usage (GPU machine, repo root): OUT=dir bash benchmarks/gpu_fp8.sh
source "$(dirname "$0")/gpu_lib.sh"
python -m pytest -q -m gpu tests/test_fp8_gpu.py tests/test_gluon_kernels_gpu.py tests/test_moe_gpu.py tests/test_gpu.py 2>&1 \
  | tee "$OUT/gpu_tests.log"
[ -n "${SKIP_LINEAR:-}" ] || python benchmarks/fp8_linear.py ${FP8_LINEAR_ARGS:-} 2>&1 | tee "$OUT/fp8_linear.md"
stdlib_corpus
ONE_B="$ONE_B_MODEL training.micro_batch_size=8
  training.global_batch_size=8 training.steps=40 optimizer.lr=3e-4 optimizer.min_lr=3e-5 optimizer.warmup_steps=10
  training.eval_interval=0
  logging.log_interval=10 logging.output_dir=/tmp/runs"
for recipe in bf16 fp8; do
  python launch/pretrain.py --config tiny_dense $ONE_B precision.recipe=$recipe run_name=1b_$recipe 2>&1 \
    | tee "$OUT/1b_$recipe.log"
done
