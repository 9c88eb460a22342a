#!/usr/bin/env bash
# MoE session script: gpu tests (the MoE ones, and EP=2 over NCCL when two GPUs are present), then the MoE
# layer benchmark FP8 vs BF16. Usage: OUT=dir bash benchmarks/gpu_moe.sh
source "$(dirname "$0")/gpu_lib.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -m pytest -q -m gpu tests/test_gpu.py -k "moe or expert" 2>&1 | tee "$OUT/gpu_tests.log"
python benchmarks/moe_layer.py 2>&1 | tee "$OUT/moe_layer.md"
python benchmarks/moe_layer.py --tokens 65536 2>&1 | tee -a "$OUT/moe_layer.md"
