#!/usr/bin/env bash
# Issue 10's measurement call on a 2-GPU H200 host: the FP8 gpu tests, then whole training steps (one GPU: ~1B
# dense eager and compiled, the small MoE eager; two GPUs, data parallel: ~1B dense compiled), then the plain-
# PyTorch/torchao yardstick on the same shape. Tables go to $OUT/summary.md, logs to $OUT/logs.tar.gz.
# Usage: OUT=dir bash benchmarks/gpu_final.sh
source "$(dirname "$0")/gpu_lib.sh"
start_summary
install_torchao
STEPS="--steps 25 --warmup 10"
step gpu_tests python -m pytest -q -m gpu tests/test_fp8_gpu.py tests/test_gluon_kernels_gpu.py tests/test_moe_gpu.py -x
step ours_eager python benchmarks/train_step.py $STEPS --model 1b --recipes bf16 fp8
step ours_compiled python benchmarks/train_step.py training.compile=true $STEPS --model 1b --recipes bf16 fp8
step moe_eager python benchmarks/train_step.py $STEPS --model moe --recipes bf16 fp8
step ours_compiled_2gpu torchrun --nproc_per_node=2 benchmarks/train_step.py training.compile=true $STEPS \
  --model 1b --global-batch 16 --recipes bf16 fp8
step reference_compiled python benchmarks/reference_model.py --compile --steps 15 --recipes bf16 torchao-tensorwise
finish_summary
