#!/usr/bin/env bash
# GPU session script: gpu-marked tests, then BF16 training throughput of the ~1B dense shape.
# Usage (on a GPU machine, from the repo root): OUT=/some/dir bash benchmarks/gpu_smoke.sh
source "$(dirname "$0")/gpu_lib.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
python -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
stdlib_corpus
# ~1B dense (hidden 2048, 16 layers, FFN 5632, 16 heads, vocab 32768), seq 2048, micro-batch 8, eager BF16.
ONE_B="$ONE_B_MODEL training.micro_batch_size=8
  training.steps=30 optimizer.warmup_steps=5 training.eval_interval=0 logging.log_interval=10 logging.output_dir=/tmp/runs"
python launch/pretrain.py --config tiny_dense $ONE_B training.global_batch_size=8 run_name=1b_1gpu 2>&1 | tee "$OUT/1b_1gpu.log"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  torchrun --standalone --nproc_per_node=2 launch/pretrain.py --config tiny_dense $ONE_B \
    training.global_batch_size=16 run_name=1b_2gpu 2>&1 | tee "$OUT/1b_2gpu.log"
fi
