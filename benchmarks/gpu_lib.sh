# Sourced by benchmarks/gpu_*.sh: the shared set-up of a GPU session and its helpers (not run on its own).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/megafp8-gpu}
mkdir -p "$OUT"

# The ~1B dense model (issue 10's shape) on the corpus of stdlib_corpus, seq 2048; scripts add batch sizes, steps,
# learning rate and logging.
ONE_B_MODEL="model.size=1b model.vocab_size=32768 data.path=/tmp/pystdlib data.seq_len=2048"

stdlib_corpus() {  # the GPU machine's Python standard library, byte-tokenized into /tmp/pystdlib; where that
  # fails, a FAILED line in the summary with the end of its error (the runs after it failed for want of data, unsaid)
  local log="${LOGS:-$OUT}/stdlib_corpus.log" rc=0
  python tools/preprocess_data.py --input stdlib --output /tmp/pystdlib --overwrite > /dev/null 2> "$log" || rc=$?
  [ "$rc" = 0 ] && return 0
  echo "## stdlib_corpus: FAILED (rc $rc): $(tail -n 3 "$log" | tr '\n' ' ')" | tee -a "$OUT/summary.md"
  return "$rc"
}

check_parts() {  # check_parts SCRIPT PART...: exit 2 before anything runs where a PART is none of the labels of
  # SCRIPT's `case $part in` (a misspelt part ran nothing: gpu_e2e.sh said nothing of it, and the GPU call was spent)
  local script=$1 known part unknown=()
  shift
  known=$(awk '/^  case \$part in/ {inside = 1; next} /^  esac/ {inside = 0} inside' "$script" \
    | grep -oE '^    [a-z0-9_|]+\)' | tr -d ' )' | tr '|\n' '  ')
  for part in "$@"; do
    [[ " $known " == *" $part "* ]] || unknown+=("$part")
  done
  [ ${#unknown[@]} = 0 ] && return 0
  echo "$(basename "$script"): unknown part(s): ${unknown[*]}; its parts: $known" >&2
  exit 2
}

start_summary() {  # tables go to $OUT/summary.md (headed by the GPUs), each step's stderr to $LOGS; a second
  # script in the same $OUT adds to the summary (job HU lost a table to one that replaced it)
  # REQUIRE_CARD=H200: on a machine whose GPUs are not all of that name, say so and run nothing (a figure of record
  # that only counts on one card: an H100 in its place costs a start, not the call; job IA)
  LOGS=$(mktemp -d)
  local cards
  cards=$(nvidia-smi --query-gpu=name,memory.total --format=csv)
  echo "$cards" >> "$OUT/summary.md"
  if [ -n "${REQUIRE_CARD:-}" ] && tail -n +2 <<< "$cards" | grep -qv -- "$REQUIRE_CARD"; then
    echo "REQUIRE_CARD=$REQUIRE_CARD, and this machine has other cards: nothing run" | tee -a "$OUT/summary.md"
    exit 0
  fi
}

install_torchao() {  # torchao's wheel, carried in wheels/ (the GPU machine has no network)
  if ls wheels/torchao-*.whl > /dev/null 2>&1 && ! python -c "import torchao" 2>/dev/null; then
    python -m pip install -q --no-deps --no-index wheels/torchao-*.whl > "$LOGS/torchao_install.log" 2>&1 \
      || echo "torchao install failed: $(tail -n 2 "$LOGS/torchao_install.log")" >> "$OUT/summary.md"
  fi
}

install_deepgemm() {  # DeepGEMM (the `deepgemm` backend; a peer column of dense_gemm.py and grouped_gemm.py), built
  # here by tools/install_deepgemm.py from its source carried in $DEEPGEMM_SRC (default .dg/DeepGEMM: DeepGEMM's tree
  # with its cutlass and fmt submodules' include/ folders and licences, made by benchmarks/deepgemm_source.sh); it
  # JIT-compiles its kernels with this machine's nvcc. The tool builds two forms side by side and keeps the first
  # that passes the backend's check (here, jobs GU-GZ: as it comes, with the compiler's libstdc++ preloaded); this
  # shell then sources the environment it wrote. Builds and that file in /tmp, left by an earlier call on the same
  # machine, are reused. The JIT cache (the generated kernels, which `gpu_e2e.sh deepgemm` copies to the logs) goes
  # to $DG_JIT_CACHE_DIR, shared by every part and run of the machine.
  # What a fresh machine spends on DeepGEMM (~170 s of building, then a JIT compile of each kernel at first use) can
  # be skipped: where no archive of builds is carried ($DEEPGEMM_PREBUILT, default .dg/deepgemm_builds.tar.gz), the
  # builds come back in $OUT/deepgemm_builds.tar.gz, and the JIT cache in $OUT/deepgemm_jit_cache.tar.gz
  # (finish_summary); copied into .dg/ here, the next call places them instead (builds checked as any build: one
  # that fails the check is built again). DEEPGEMM_EXPORT=0 brings neither back (a script short of $OUT's room).
  export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/deepgemm_cache}
  local src=${DEEPGEMM_SRC:-.dg/DeepGEMM} prefix=${DEEPGEMM_PREFIX:-/tmp/deepgemm} t0=$SECONDS
  local log="$LOGS/deepgemm_build.log" prebuilt=${DEEPGEMM_PREBUILT:-.dg/deepgemm_builds.tar.gz}
  local jit_cache=${DEEPGEMM_JIT_CACHE:-.dg/deepgemm_jit_cache.tar.gz}
  if [ ! -d "$src" ]; then
    echo "no DeepGEMM source in $src: its columns say why they cannot run" >> "$OUT/summary.md"
    return
  fi
  if [ -f "$jit_cache" ] && [ ! -d "$DG_JIT_CACHE_DIR/cache" ]; then
    mkdir -p "$DG_JIT_CACHE_DIR" && tar -xzf "$jit_cache" -C "$DG_JIT_CACHE_DIR" \
      || echo "DeepGEMM's carried JIT cache $jit_cache not unpacked: its kernels compile at first use" >> "$OUT/summary.md"
  fi
  local cxx=${CXX:-$(command -v c++ || command -v g++)}
  { echo "compiler $cxx: $($cxx --version | head -n 1); its libstdc++ $($cxx -print-file-name=libstdc++.so.6)"
    python -c "import torch; print('libstdc++ in a torch process:',
      sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l}))"
    "${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}/bin/nvcc" --version \
      | tail -n 2; } >> "$log" 2>&1
  local tool=(python tools/install_deepgemm.py --prefix "$prefix" --source "$src") ok=0 build=()
  if [ -f "$prebuilt" ]; then
    if "${tool[@]}" --prebuilt "$prebuilt" >> "$log" 2>&1; then
      ok=1
    else
      echo "DeepGEMM's carried builds $prebuilt failed here: building" >> "$OUT/summary.md"
      build=(--rebuild)
    fi
  fi
  if [ $ok = 0 ]; then
    [ "${DEEPGEMM_EXPORT:-1}" = 0 ] || build+=(--export-builds "$OUT/deepgemm_builds.tar.gz")
    "${tool[@]}" "${build[@]}" >> "$log" 2>&1 && ok=1
  fi
  if [ $ok = 1 ]; then
    # shellcheck disable=SC1091
    source "$prefix/deepgemm.env"
    echo "DeepGEMM ready in $((SECONDS - t0)) s: $(head -n 1 "$prefix/deepgemm.env" | cut -c 3-)" >> "$OUT/summary.md"
    cp "$prefix"/build_*.log "$LOGS/" 2> /dev/null
  else
    echo "DeepGEMM: no build ran here: $(tail -n 4 "$log" | tr '\n' ' ')" >> "$OUT/summary.md"
  fi
}

step() {  # step NAME command...: run it (at most $STEP_TIMEOUT s), append its stdout (a table) and its time to the
  # summary, keep its stderr; STEP_RC is the command's exit status (124: timed out), for a later step that needs
  # this one to have finished (unfinished)
  local name=$1 t0=$SECONDS
  shift
  echo "## $name" >> "$OUT/summary.md"
  STEP_RC=0  # (set this way, a caller under `set -e` goes on past a failed step, as the summary line says)
  timeout "${STEP_TIMEOUT:-590}" "$@" >> "$OUT/summary.md" 2> "$LOGS/$name.log" || STEP_RC=$?
  [ "$STEP_RC" = 0 ] || echo "FAILED (rc $STEP_RC): $(tail -n 3 "$LOGS/$name.log")" >> "$OUT/summary.md"
  printf '(%s s)\n\n' "$((SECONDS - t0))" >> "$OUT/summary.md"
  echo "== $name done"
}

unfinished() {  # unfinished NAME RC: nothing where step NAME's command exited 0 (RC, its STEP_RC); else
  # "NAME did not finish (why)": timed out, or failed with its status and the last line of its stderr
  [ "$2" = 0 ] && return 0
  if [ "$2" = 124 ]; then
    echo "$1 did not finish (timed out after ${STEP_TIMEOUT:-590} s)"
  else
    echo "$1 did not finish (failed, rc $2: $(tail -n 1 "$LOGS/$1.log" 2> /dev/null))"
  fi
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

finish_summary() {  # the logs, as one file that comes back from the GPU machine (logs_2.tar.gz and on for the
  # second script and on in the same $OUT)
  local name=logs.tar.gz i=2
  while [ -e "$OUT/$name" ]; do
    name=logs_$i.tar.gz
    i=$((i + 1))
  done
  tar -czf "$OUT/$name" -C "$LOGS" .
  if [ "${DEEPGEMM_EXPORT:-1}" != 0 ] && [ -d "${DG_JIT_CACHE_DIR:-/tmp/deepgemm_cache}/cache" ]; then
    # DeepGEMM's compiled kernels, for the next call
    tar -czf "$OUT/deepgemm_jit_cache.tar.gz" -C "${DG_JIT_CACHE_DIR:-/tmp/deepgemm_cache}" cache
  fi
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
