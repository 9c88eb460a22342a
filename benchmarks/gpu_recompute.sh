#!/usr/bin/env bash
# Cost of activation recomputation on one GPU: the ~1B dense shape, seq 2048, micro-batch 8, BF16 and FP8, with
# training.recompute none and full, 15 steps each; step times compared by tools/compare_runs.py, peak memory from
# the logs. Usage: OUT=dir bash benchmarks/gpu_recompute.sh
source "$(dirname "$0")/gpu_lib.sh"
stdlib_corpus
ONE_B="$ONE_B_MODEL training.micro_batch_size=8
  training.global_batch_size=8 training.steps=${STEPS:-15} optimizer.warmup_steps=10 training.eval_interval=0
  logging.log_interval=1 logging.output_dir=/tmp/runs_rc"
for recipe in bf16 fp8; do
  for mode in none full; do
    python launch/pretrain.py --config tiny_dense $ONE_B precision.recipe=$recipe training.recompute=$mode \
      run_name=${recipe}_$mode > "$OUT/${recipe}_$mode.log" 2>&1
    python - "/tmp/runs_rc/${recipe}_$mode/metrics.jsonl" >> "$OUT/peak_memory.txt" <<'PY'
import json, sys
last = [json.loads(line) for line in open(sys.argv[1]) if '"kind": "train"' in line][-1]
print(sys.argv[1], "peak GiB", round(last["peak_memory_gib"], 2), "step s", round(last["step_time_s"], 4))
PY
  done
  python tools/compare_runs.py /tmp/runs_rc/${recipe}_none /tmp/runs_rc/${recipe}_full --skip 5 | tee "$OUT/${recipe}_compare.md"
done
