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

install_deepgemm() {  # DeepGEMM (a peer for dense_gemm.py's and grouped_gemm.py's DeepGEMM columns), built here from
  # its source carried in $DEEPGEMM_SRC (default .dg/DeepGEMM: DeepGEMM's tree with its cutlass and fmt submodules'
  # include/ folders and licences; `git archive` of each); it JIT-compiles its kernels with this machine's nvcc.
  # Built as it comes, its first JIT call crashed here (std::regex reached a facet of another libstdc++), so two
  # builds are made side by side and the first that passes `deepgemm_peer.py`'s smoke test is used: as it comes, run
  # with the compiler's own libstdc++ preloaded; libstdc++ linked into it statically. Builds left in /tmp by an
  # earlier call on the same machine are reused. Its JIT cache (the generated kernels, which `gpu_e2e.sh deepgemm`
  # copies to the logs) goes to $DG_JIT_CACHE_DIR, shared by every part and run of the machine.
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deepgemm_cache}
  local src=${DEEPGEMM_SRC:-.dg/DeepGEMM} nvcc_path cxx variant dir preload rc
  if [ ! -d "$src" ]; then
    echo "no DeepGEMM source in $src: its columns say why they cannot run" >> "$OUT/summary.md"
    return
  fi
  src=$(cd "$src" && pwd)
  nvcc_path=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc_path")")}
  export PATH="$CUDA_HOME/bin:$PATH"
  cxx=${CXX:-$(command -v c++ || command -v g++)}
  local t0=$SECONDS log="$LOGS/deepgemm_build.log"
  { echo "compiler $cxx: $($cxx --version | head -n 1); its libstdc++ $($cxx -print-file-name=libstdc++.so.6)"
    python -c "import torch; print('libstdc++ in a torch process:',
      sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l}))"
    nvcc --version | tail -n 2; } > "$log" 2>&1
  for variant in plain static; do
    dir=/tmp/deepgemm_$variant
    ls "$dir"/deep_gemm/_C*.so > /dev/null 2>&1 && continue  # built by an earlier call on this machine
    rm -rf "$dir" && cp -r "$src" "$dir"
    (cd "$dir" && ln -sfn "$dir/third-party/cutlass/include/cutlass" deep_gemm/include/cutlass \
       && ln -sfn "$dir/third-party/cutlass/include/cute" deep_gemm/include/cute \
       && if [ $variant = static ]; then export LDFLAGS="-static-libstdc++ -static-libgcc"; fi \
       && python setup.py build && ln -sf "$dir/$(find build -name '_C*.so' | head -n 1)" deep_gemm/) \
      > "$LOGS/deepgemm_build_$variant.log" 2>&1 &
  done
  wait
  for variant in plain static; do
    dir=/tmp/deepgemm_$variant
    preload=
    [ $variant = plain ] && preload=$($cxx -print-file-name=libstdc++.so.6)
    PYTHONPATH="$dir:$PYTHONPATH" LD_PRELOAD=$preload timeout 300 python benchmarks/deepgemm_peer.py >> "$log" 2>&1
    rc=$?
    if [ $rc = 0 ]; then
      export PYTHONPATH="$dir:$PYTHONPATH"
      [ -n "$preload" ] && export LD_PRELOAD=$preload
      echo "DeepGEMM built ($variant${preload:+, $preload preloaded}) in $((SECONDS - t0)) s:" \
        "$(tail -n 2 "$log" | tr '\n' ' ')" >> "$OUT/summary.md"
      return
    fi
    echo "DeepGEMM $variant failed its smoke test (rc $rc; its build:" \
      "$(tail -n 2 "$LOGS/deepgemm_build_$variant.log" | tr '\n' ' '))" >> "$log"
  done
  echo "DeepGEMM: no build ran here: $(tail -n 4 "$log" | tr '\n' ' ')" >> "$OUT/summary.md"
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
