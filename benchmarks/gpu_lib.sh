# Sourced by benchmarks/gpu_*.sh: the shared set-up of a GPU session and its helpers (not run on its own).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megafp8-gpu}
mkdir -p "$OUT"

# The ~1B dense model (issue 10's shape) on the corpus of stdlib_corpus, seq 2048; scripts add batch sizes, steps,
# learning rate and logging.
ONE_B_MODEL="model.size=1b model.vocab_size=32768 data.path=/tmp/pystdlib data.seq_len=2048"

stdlib_corpus() {  # the GPU machine's Python standard library, byte-tokenized into /tmp/pystdlib
  python tools/preprocess_data.py --input stdlib --output /tmp/pystdlib --overwrite > /dev/null
}

start_summary() {  # tables go to $OUT/summary.md (headed by the GPUs), each step's stderr to $LOGS
  LOGS=$(mktemp -d)
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/summary.md"
}

install_torchao() {  # torchao's wheel, carried in wheels/ (the GPU machine has no network)
  if ls wheels/torchao-*.whl > /dev/null 2>&1 && ! python -c "import torchao" 2>/dev/null; then
    python -m pip install -q --no-deps --no-index wheels/torchao-*.whl > "$LOGS/torchao_install.log" 2>&1 \
      || echo "torchao install failed: $(tail -n 2 "$LOGS/torchao_install.log")" >> "$OUT/summary.md"
  fi
}

step() {  # step NAME command...: run it (at most $STEP_TIMEOUT s), append its stdout (a table) and its time to the
  # summary, keep its stderr
  local name=$1 t0=$SECONDS
  shift
  echo "## $name" >> "$OUT/summary.md"
  timeout "${STEP_TIMEOUT:-590}" "$@" >> "$OUT/summary.md" 2> "$LOGS/$name.log" \
    || echo "FAILED (rc $?): $(tail -n 3 "$LOGS/$name.log")" >> "$OUT/summary.md"
  printf '(%s s)\n\n' "$((SECONDS - t0))" >> "$OUT/summary.md"
  echo "== $name done"
}

sampled_step() {  # sampled_step LABEL NAME command...: `step NAME command...` with the SM clock, power and clock event
  # reasons sampled every 100 ms into $LOGS/clocks_LABEL.csv (benchmarks/clocks_summary.py reads it)
  local label=$1 fields=timestamp,utilization.gpu,clocks.current.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu
  shift
  for reasons in clocks_event_reasons.active clocks_throttle_reasons.active; do  # the newer name first
    if nvidia-smi --query-gpu=$fields,$reasons --format=csv -i 0 > /dev/null 2>&1; then
      fields=$fields,$reasons
      break
    fi
  done
  nvidia-smi --query-gpu=$fields --format=csv -i 0 -lms "${SAMPLE_MS:-100}" > "$LOGS/clocks_$label.csv" 2>&1 &
  local sampler=$!
  step "$@"
  kill $sampler 2> /dev/null
  wait $sampler 2> /dev/null
}

finish_summary() {  # the logs, as one file that comes back from the GPU machine
  tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
}

visible_gpus() {  # sets GPUS: how many GPUs this machine shows (0 without CUDA), asked once
  [ -n "${GPUS:-}" ] || GPUS=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
}

gpus_for() {  # gpus_for N PART: whether N GPUs are visible; if not, says that PART is skipped and why
  visible_gpus
  [ "$GPUS" -ge "$1" ] && return 0
  echo "## $2: SKIPPED: needs $1 GPUs, $GPUS visible" | tee -a "$OUT/summary.md"
  return 1
}
