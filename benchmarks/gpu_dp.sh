#!/usr/bin/env bash
# Two-GPU data parallelism: gpu tests, then the ~1B dense shape at DP=2 with the sharded optimizer,
# gradient reduce-scatter overlapped with backward vs after it. Usage: OUT=dir bash benchmarks/gpu_dp.sh
source "$(dirname "$0")/gpu_lib.sh"
python -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
stdlib_corpus
ONE_B="$ONE_B_MODEL training.micro_batch_size=8
  training.global_batch_size=16 training.steps=30 optimizer.lr=3e-4 optimizer.warmup_steps=10
  training.eval_interval=0 logging.log_interval=10 logging.output_dir=/tmp/runs optimizer.bucket_size_mb=100"
for overlap in true false; do
  torchrun --standalone --nproc_per_node=2 launch/pretrain.py --config tiny_dense $ONE_B \
    optimizer.overlap_grad_reduce=$overlap run_name=dp2_overlap_$overlap 2>&1 | tee "$OUT/dp2_overlap_$overlap.log"
done
