#!/usr/bin/env bash
# Issue 22: FP8-vs-BF16 loss parity over one pass of a large real corpus, with BF16's own seed-to-seed noise.
# The corpus is every .py/.md/.rst/.txt file of this Python environment's site-packages (de-duplicated, 1% of the
# files held out), tokenized by a 32k BPE tokenizer trained here on a sample of the training files. Runs: the ~1B
# dense model (benchmarks/train_step.py MODELS["1b"]), seq 2048, 8 x 2048 = 16,384 tokens per step, DENSE_STEPS
# (3000) steps, lr 3e-4 (warmup 200, cosine to 3e-5), one data order for all (data.seed): BF16 seed A, BF16 seed
# B, FP8 seed A; and the MoE model (MODELS["moe"]), MOE_STEPS (1000) steps, BF16 vs FP8, seed A. Validation loss
# on the held-out split every 500 steps. Steps are cut to one pass over the corpus if it is smaller (`plan` says so).
#
# On one H200 (fifteenth session's figures): the corpus takes ~96 s to make (job BH). Under CUDA graphs a dense run
# of 3,000 steps takes ~570 s (BF16) and ~475 s (FP8) of steps, plus compilation, evaluation and checkpoints, so each
# needs a second command to finish from its checkpoint, and the three do not fit one session's 30 minutes: plan two
# sessions, the second with PRIOR_RUNS (below), and the same settings in both, e.g. (a run cut at RUN_SECONDS
# checkpoints the step it stops at, so no step is done twice)
#   EXTRA_OVERRIDES="training.compile=true training.compile_mode=reduce-overhead" DENSE_CHECKPOINT_INTERVAL=1000
# (every run of the comparison must use the same ones: they are part of each run's id). Sixteenth session (jobs BN,
# BO): dense_bf16_a finished in two commands at 85-86k tokens/s, each checkpoint taking ~30 s. Twentieth session
# (jobs CA-CE, one after the other on one GPU): dense_fp8_a (~110k tokens/s) and dense_bf16_b (~90k), two commands
# each. Twenty-first session (jobs CF, CG): moe_bf16 (~91k tokens/s) and moe_fp8 (~98k), one command each, the
# corpus made first in CF. All five are in docs/parity_runs (PRIOR_RUNS=docs/parity_runs), and moe_bf16_b since the
# sixty-third session (job IJ: 329 s with the corpus, `bash $S corpus && bash $S run moe_bf16_b; bash $S compare
# moe`). Optional: moe_fp8_b, the same way.
#
# Every command on the GPU machine may be limited to 10 minutes, so the work comes in sub-steps, each short, each
# resumable (run them again until `status` says every run is finished). DEADLINE (seconds since the epoch, e.g.
# `DEADLINE=$(( $(date +%s) + 590 ))` first in a 600 s command) cuts each run's RUN_SECONDS so that its stop,
# STOP_GRACE and the copying after it end before then, and starts no run with under a minute left: in job HC the
# corpus and a fresh DeepGEMM install took 236 s, and the command's own limit killed the run instead of its stop.
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh measure    # the corpus before tokenizing (files, duplicates, bytes)
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh tokenizer  # BPE tokenizer.json on TOKENIZER_SAMPLE_BYTES of it
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh tokenize   # the token files (skipped once written)
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh plan       # corpus tokens, one-pass steps, the steps each run takes
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh corpus     # the four above in turn (each skipped once done)
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh run NAME [NAME2]  # NAME on GPU 0 (and NAME2 on GPU 1), each for at
#        most RUN_SECONDS (450) plus STOP_GRACE (120) to stop, resuming from its newest checkpoint;
#        NAME: dense_bf16_a dense_fp8_a dense_bf16_b moe_bf16 moe_fp8 moe_bf16_b (MoE's BF16 seed B, for MoE's
#        seed-to-seed spread: `next` runs it after the others, and `compare` uses it once it has finished),
#        moe_fp8_b (MoE's FP8 seed B: `compare` sets it against BF16 seed B, seed A's spread beside it, once it
#        and moe_bf16_b have finished), moe_fp8bf16experts_b, moe_fp8expertsonly_b and moe_fp8bf16attn_b (MoE's
#        ablations, seed B: the routed experts in BF16 and all else FP8, the routed experts alone in FP8, the
#        attention projections in BF16), moe_fp8allbf16_b (the control: the FP8 recipe, every GEMM layer in BF16);
#        `compare` sets each against BF16 seed B once it has finished, and all of them in one table
#        (`compare_runs.py --gaps`, beside FP8 seed B and BF16 seed A);
#        moe_bf16_b_rN, moe_fp8_b_rN for N from 2 to SEED_B_REPEATS (7; at most 9) (repeats of seed B's pair: the
#        same settings, so the same seed and data order; GPU runs are not bit-reproducible, and on an H100 seven
#        BF16 runs of seed B ended 2.0% apart, jobs IP-IR, IV, IX, JD and JF): `compare` sets FP8's mean against BF16's,
#        with BF16's run-to-run range (`compare_runs.py --pooled`), once two BF16 runs and one FP8 run have
#        finished
#        dense_fp8blocks_a (FP8 seed A with the opt-in `precision.fp8_wgrad_input_blocks`: `next` runs it last,
#        `compare` sets it against the two BF16 seeds once it has finished), dense_fp8deepgemm_a (FP8 seed A on
#        `precision.fp8_backend: deepgemm`, DeepGEMM built first by gpu_lib.sh's install_deepgemm from the
#        source carried in .dg/DeepGEMM; likewise last, and set against the BF16 seeds)
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh next       # `run` on the first two unfinished runs in that order
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh status     # each run's last step, and the disk left
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh compare [dense|moe]  # compare_runs --parity and plot_runs, dense
#        and MoE (or one of them)
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh cross_eval NAME  # NAME's newest checkpoint evaluated in BF16 and
#        in FP8 (`launch/pretrain.py --evaluate`): how much of an FP8 run's gap is the FP8 evaluation itself and how
#        much is in its weights. NAME must have run in this session with KEEP_CHECKPOINTS=1 and a checkpoint interval
#        (MOE_CHECKPOINT_INTERVAL=1000 keeps an MoE run's last step, ~45 GB), without PRIOR_RUNS: a checkpoint
#        interval is part of a run's id, so such a run is a repeat, not the run of docs/parity_runs
#   OUT=dir bash benchmarks/gpu_parity_corpus.sh config NAME  # NAME's resolved config (checks every key), no run
# Tables go to $OUT/summary.md, plots to $OUT/parity_{dense,moe}.png, each run's metrics, log and run_id.txt (the
# corpus's token counts, the tokenizer's sha256 and the run's overrides) to $OUT/runs/; the corpus, tokenizer and
# run directories (checkpoints) stay in WORK (/tmp/megafp8-parity), which must survive between commands (same
# machine). PACK_OUT=1 puts $OUT/runs and $OUT/logs into one $OUT/parity_files.tar.gz instead (for machines that
# bring back only a few files: this project's GPU machine brings back 8).
#
# Across sessions (a GPU session's budget holds about three dense runs' worth of time, and WORK does not survive the
# machine): keep what $OUT/runs/ brought back (in the repository), and give it as PRIOR_RUNS in the next session.
# Make the corpus again first, before anything installs packages into site-packages (it is built from them): the
# same files give the same split, tokenizer and tokens. A run finished in PRIOR_RUNS counts as finished here, is
# copied into this session's $OUT/runs (so the next session's PRIOR_RUNS holds every finished run), and `compare`
# reads its metrics, but only if its run_id.txt matches what this session would run: a mismatch stops the script
# with both ids before anything runs.
#
# Disk: a checkpoint holds ~14 bytes per parameter (BF16 weights, FP32 masters, two FP32 moments): ~14 GB for the
# dense model, ~45 GB for the 3.2B MoE, and up to two per run exist while one is written (checkpoint.keep_last=1).
# A finished run's checkpoints are deleted (KEEP_CHECKPOINTS=1 keeps them). Dense runs save every
# DENSE_CHECKPOINT_INTERVAL (500) steps; MoE runs save never by default (MOE_CHECKPOINT_INTERVAL=0): at the eager
# step times of docs/benchmarks.md on one H200 (0.27 s BF16, 0.37 s FP8) 1000 steps take ~270 s and ~370 s, inside
# one command; an MoE run cut short starts over. MOE_CHECKPOINT_INTERVAL=500 makes it resumable (then do not run
# the two MoE runs side by side: up to 180 GB of checkpoints). EXTRA_OVERRIDES is appended to every run's
# overrides (e.g. training.compile=true); GPU picks the GPU of a single `run NAME` (default 0), GPU2 the second run's
# of `run NAME NAME2` (default 1). GPU2=0 runs both on one GPU, side by side (the dense runs hold ~41-43 GiB each
# under CUDA graphs on an H200): the GPU's time is shared, so each logs about half its usual tokens/s, but one
# run's compilation, evaluation and checkpoints overlap the other's steps. There the first run stops STOP_STAGGER
# (60) s before the second, so that the two do not write their stop-time checkpoints at once (each run holds two
# while it writes one: four, ~50 GB of the machine's 64 GiB disk, had both written together).
# Estimated, not yet tried: the two dense runs left (~1,040 s of steps together) and the corpus then take ~1,350 s
# of device time in three commands, against ~1,600 s one after the other.
source "$(dirname "$0")/gpu_lib.sh"
WORK=${WORK:-/tmp/megafp8-parity}
DATA=$WORK/corpus
TOKENIZER=$WORK/tokenizer.json
RUNS=$WORK/runs
EXTENSIONS=".py .md .rst .txt"
CORPUS_INPUT=${CORPUS_INPUT:-$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")}
TREE_OPTIONS="--extensions $EXTENSIONS --valid-fraction ${VALID_FRACTION:-0.01} --seed ${SPLIT_SEED:-1234}
  --max-file-bytes ${MAX_FILE_BYTES:-2e6}"
TOKENIZER_SAMPLE_BYTES=${TOKENIZER_SAMPLE_BYTES:-1e8}
VOCAB_SIZE=32768
SEQ_LEN=2048
MICRO_BATCH=8
ALL_RUNS="dense_bf16_a dense_fp8_a dense_bf16_b moe_bf16 moe_fp8 moe_bf16_b moe_fp8_b"
ALL_RUNS+=" dense_fp8blocks_a dense_fp8deepgemm_a moe_fp8bf16experts_b moe_fp8expertsonly_b moe_fp8bf16attn_b"
ALL_RUNS+=" moe_fp8allbf16_b"
SEED_B_REPEATS=${SEED_B_REPEATS:-7}  # runs of each of MoE's seed-B pair, the first included (at most 9)
[[ $SEED_B_REPEATS =~ ^[1-9]$ ]] || { echo "SEED_B_REPEATS=$SEED_B_REPEATS: give 1 to 9" >&2; exit 2; }
for (( repeat = 2; repeat <= SEED_B_REPEATS; repeat++ )); do ALL_RUNS+=" moe_bf16_b_r$repeat moe_fp8_b_r$repeat"; done
mkdir -p "$WORK" "$RUNS" "$OUT/runs"
LOGS=$OUT/logs
mkdir -p "$LOGS"
[ -f "$OUT/summary.md" ] || nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/summary.md" 2>&1

model_overrides() {  # the model.* options of benchmarks/train_step.py MODELS[$1] (one source for the shapes), read
  # from its source text (a literal dict) without importing torch
  python - "$(dirname "$0")/train_step.py" "$1" <<'EOF'
import ast, sys
body = ast.parse(open(sys.argv[1]).read()).body
models = next(ast.literal_eval(node.value) for node in body
              if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "MODELS")
print(" ".join(option for option in models[sys.argv[2]] if option.startswith("model.")))
EOF
}

corpus_figure() {  # corpus_figure FIELD: train_tokens, valid_tokens, train_samples or valid_samples of $DATA
  python - "$DATA/meta.json" "$1" "$SEQ_LEN" <<'EOF'
import json, sys
meta, field, seq_len = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
split, what = field.split("_")
tokens = sum(shard["num_tokens"] for shard in meta["splits"].get(split, []))
print(tokens if what == "tokens" else max(0, (tokens - 1) // seq_len))
EOF
}

steps_of() {  # steps_of NAME: the requested steps, cut to one pass over the training split
  local want=$([ "${1%%_*}" = moe ] && echo "${MOE_STEPS:-1000}" || echo "${DENSE_STEPS:-3000}")
  local one_pass=$(( $(corpus_figure train_samples) / MICRO_BATCH ))
  echo $(( want < one_pass ? want : one_pass ))
}

eval_iters() {  # micro-batches per validation: up to EVAL_ITERS (64), never past the end of the held-out split
  local most=$(( $(corpus_figure valid_samples) / MICRO_BATCH ))
  local want=${EVAL_ITERS:-64}
  echo $(( want < most ? want : (most > 0 ? most : 1) ))
}

known_run() {  # known_run NAME: fails, saying which names exist, unless NAME is a run of this script
  case " $ALL_RUNS " in *" $1 "*) return 0 ;; esac
  echo "unknown run '$1': one of $ALL_RUNS" >&2
  return 2
}

run_overrides() {  # run_overrides NAME: every override of run NAME: family_recipe[_seed]; recipe fp8blocks is FP8
  # with the opt-in `precision.fp8_wgrad_input_blocks` (the wgrads' x in 128x128 blocks), fp8deepgemm FP8 on the
  # deepgemm backend, named (DeepGEMM's dense fprop and dgrad); the other FP8 runs keep `auto`, which is `hopper` in
  # their processes: DeepGEMM's environment is sourced only in the deepgemm run's own subshell (run_one)
  known_run "$1" || return 2
  local base=${1%_r[0-9]}  # a repeat (NAME_rN) runs NAME's settings under its own name
  local family=${base%%_*} rest=${base#*_} recipe seed interval blocks=""
  recipe=${rest%%_*}
  if [ "$recipe" = fp8blocks ]; then recipe=fp8; blocks="precision.fp8_wgrad_input_blocks=true"; fi
  if [ "$recipe" = fp8deepgemm ]; then recipe=fp8; blocks="precision.fp8_backend=deepgemm"; fi
  # MoE's ablations (where FP8's loss gap comes from): the routed experts in BF16, everything else FP8; the routed
  # experts alone in FP8; the attention projections in BF16; and the control, the FP8 recipe with every GEMM layer
  # in BF16 (what the recipe changes besides the GEMMs). The glob is quoted for YAML (a bare * starts an alias);
  # where the overrides are split into words, globbing is off.
  case $recipe in
    fp8bf16experts) recipe=fp8; blocks='precision.bf16_layers="*.experts.*"' ;;
    fp8expertsonly) recipe=fp8; blocks='precision.fp8_layers="*.experts.*"' ;;
    fp8bf16attn) recipe=fp8; blocks='precision.bf16_layers="*.attn.*"' ;;
    fp8allbf16) recipe=fp8; blocks='precision.bf16_layers="*"' ;;  # the control: no GEMM in FP8
  esac
  seed=$([ "${rest#*_}" = b ] && echo "${SEED_B:-2}" || echo "${SEED_A:-1}")
  interval=$([ "$family" = moe ] && echo "${MOE_CHECKPOINT_INTERVAL:-0}" || echo "${DENSE_CHECKPOINT_INTERVAL:-500}")
  echo "$(model_overrides "$([ "$family" = moe ] && echo moe || echo 1b)") model.vocab_size=$VOCAB_SIZE
    precision.recipe=$recipe training.seed=$seed data.path=$DATA data.seq_len=$SEQ_LEN data.seed=${DATA_SEED:-1234}
    training.micro_batch_size=$MICRO_BATCH
    training.global_batch_size=$MICRO_BATCH training.steps=$(steps_of "$1") training.eval_interval=500
    training.eval_iters=$(eval_iters) optimizer.lr=3e-4 optimizer.min_lr=3e-5 optimizer.warmup_steps=200
    optimizer.decay_style=cosine logging.log_interval=10 logging.output_dir=$RUNS run_name=$1
    checkpoint.interval=$interval checkpoint.keep_last=1 checkpoint.resume=auto $blocks ${EXTRA_OVERRIDES:-}"
}

run_id() {  # run_id NAME: what NAME's result depends on: the corpus's token counts, its tokenizer's sha256 (byte
  # tokens: none) and the run's overrides (less the paths, which differ between machines), one line
  local tokenizer=none
  [ -f "$TOKENIZER" ] && tokenizer=$(sha256sum "$TOKENIZER" | cut -d' ' -f1)
  echo "train_tokens=$(corpus_figure train_tokens) valid_tokens=$(corpus_figure valid_tokens) tokenizer=$tokenizer" \
    $(run_overrides "$1" | tr -s ' \t' '\n' | grep -v -e '^data.path=' -e '^logging.output_dir=' -e '^$')
}

metrics_last_step() {  # metrics_last_step FILE: the last training step a metrics file records (0 if none)
  python - "$1" <<'EOF'
import json, sys
from pathlib import Path
path = Path(sys.argv[1])
lines = path.read_text().splitlines() if path.is_file() else []
print(max([r["step"] for r in map(json.loads, lines) if r.get("kind") == "train"] or [0]))
EOF
}

prior_finished() {  # prior_finished NAME: PRIOR_RUNS holds NAME trained to its last step
  [ -n "${PRIOR_RUNS:-}" ] && [ -f "$PRIOR_RUNS/$1/metrics.jsonl" ] \
    && [ "$(metrics_last_step "$PRIOR_RUNS/$1/metrics.jsonl")" -ge "$(steps_of "$1")" ]
}

only_in() {  # only_in ID OTHER: the settings of run id ID that OTHER lacks, space-separated ("nothing" if none)
  local found
  found=$(comm -23 <(tr -s ' ' '\n' <<< "$1" | sort -u) <(tr -s ' ' '\n' <<< "$2" | sort -u) | tr '\n' ' ')
  echo "${found% }" | sed 's/^$/nothing/'
}

check_prior() {  # every finished run of PRIOR_RUNS must be what this session would run (else both ids, and exit 2);
  # those that are get copied into $OUT/runs, to be carried forward
  [ -n "${PRIOR_RUNS:-}" ] || return 0
  [ -f "$DATA/meta.json" ] || { echo "PRIOR_RUNS is set: make the corpus first (prior runs are checked against" \
                                      "it)" >&2; return 2; }
  local name here there bad=0
  for name in $ALL_RUNS; do
    prior_finished "$name" || continue
    here=$(run_id "$name")
    there=$(cat "$PRIOR_RUNS/$name/run_id.txt" 2>/dev/null || echo "none recorded")
    if [ "$here" != "$there" ]; then
      echo "PRIOR_RUNS/$name was made another way. Only its settings have: $(only_in "$there" "$here");" \
           "only this session's: $(only_in "$here" "$there") (give this session the prior runs' settings, e.g." \
           "DENSE_CHECKPOINT_INTERVAL=1000 for docs/parity_runs). Whole ids: '$there'; this session's '$here'" >&2
      bad=1
      continue
    fi
    mkdir -p "$OUT/runs/$name"
    cp "$PRIOR_RUNS/$name/metrics.jsonl" "$PRIOR_RUNS/$name/run_id.txt" "$OUT/runs/$name/" 2>/dev/null
  done
  return $((bad * 2))
}

run_dir() {  # run_dir NAME: where NAME's metrics are: PRIOR_RUNS's if it finished there, else this session's
  if prior_finished "$1"; then echo "$PRIOR_RUNS/$1"; else echo "$RUNS/$1"; fi
}

last_step() { metrics_last_step "$(run_dir "$1")/metrics.jsonl"; }  # last_step NAME (0 if it has not begun)

finished() { [ -f "$DATA/meta.json" ] && [ "$(last_step "$1")" -ge "$(steps_of "$1")" ]; }

run_one() {  # run_one NAME GPU [SECONDS]: train NAME on GPU for at most SECONDS (RUN_SECONDS), then report and keep
  # what comes back
  local name=$1 overrides rc
  overrides=$(run_overrides "$name") || return 2
  if finished "$name"; then echo "$name: finished already"; return 0; fi
  case $name in *deepgemm*) install_deepgemm ;; esac  # built once a machine (a second call reuses the build)
  local seconds=${3:-${RUN_SECONDS:-450}} left
  if [ -n "${DEADLINE:-}" ]; then  # what the command's deadline leaves, less the stop's grace and the copying
    [[ $DEADLINE =~ ^[0-9]+$ ]] || { echo "DEADLINE=$DEADLINE: give seconds since the epoch, e.g." \
                                       "DEADLINE=\$(( \$(date +%s) + 590 ))" >&2; return 2; }
    left=$(( DEADLINE - $(date +%s) - ${STOP_GRACE:-120} - 15 ))
    if [ "$left" -lt 60 ]; then
      echo "- $name (GPU $2): not started, DEADLINE leaves ${left} s of running" | tee -a "$OUT/summary.md"
      return 0
    fi
    [ "$left" -lt "$seconds" ] && { echo "- $name: ${seconds} s cut to ${left} s by DEADLINE" >> "$OUT/summary.md"
                                    seconds=$left; }
  fi
  # At RUN_SECONDS timeout sends SIGTERM: the run stops at its next logging step with a checkpoint
  # (checkpoint.save_on_signal, where checkpoint.interval > 0), and is killed (137) if that takes over STOP_GRACE s.
  # The dense model's checkpoint (12.5 GiB) took ~30 s to write on the GPU machine: a 30 s grace killed the stop's
  # save in job BN, and the run went back to its previous checkpoint.
  set -f  # the overrides are split into words but never globbed: a layer glob (`*.attn.*`) is the config's
  CUDA_VISIBLE_DEVICES=$2 timeout -k "${STOP_GRACE:-120}" "$seconds" python launch/pretrain.py \
    --config tiny_dense $overrides \
    >> "$RUNS/$name.log" 2>&1
  rc=$?
  set +f
  mkdir -p "$OUT/runs/$name"
  cp "$RUNS/$name/metrics.jsonl" "$OUT/runs/$name/" 2>/dev/null
  run_id "$name" > "$OUT/runs/$name/run_id.txt"
  tail -c 200000 "$RUNS/$name.log" > "$OUT/runs/$name.log"
  local line="$name (GPU $2): step $(last_step "$name") of $(steps_of "$name"), exit $rc"
  if finished "$name"; then
    line="$line, finished"
    [ "${KEEP_CHECKPOINTS:-0}" = 1 ] || rm -rf "$RUNS/$name/checkpoints"
  elif [ "$rc" != 124 ] && [ "$rc" != 137 ]; then
    line="$line, FAILED: $(tail -n 2 "$RUNS/$name.log" | tr '\n' ' ')"
  elif ! ls -d "$RUNS/$name"/checkpoints/step_* > /dev/null 2>&1; then
    line="$line, cut short before its first checkpoint: it starts over next time"
    [ "${name%%_*}" = moe ] && line="$line (MOE_CHECKPOINT_INTERVAL=500 makes it resumable)"
  fi
  echo "- $line" | tee -a "$OUT/summary.md"
}

run_pair() {  # run_pair NAME [NAME2]: side by side on GPUs GPU (0) and GPU2 (1; 0 puts both on one GPU)
  for name in "$@"; do known_run "$name" || return 2; done
  [ -f "$DATA/meta.json" ] || { echo "no corpus in $DATA: run the corpus sub-steps first" >&2; return 2; }
  echo "## run $* ($(date -u +%FT%TZ))" >> "$OUT/summary.md"
  local first_seconds=${RUN_SECONDS:-450}
  if [ $# -ge 2 ] && [ "${GPU:-0}" = "${GPU2:-1}" ]; then
    # On one GPU both runs would stop, and write their checkpoints, at the same moment: with each run's previous
    # checkpoint still there until its new one is complete, four dense checkpoints (~50 GB) would share the
    # machine's 64 GiB disk. The first stops STOP_STAGGER s earlier, so that at most one writes at a time.
    first_seconds=$(( first_seconds - ${STOP_STAGGER:-60} ))
  fi
  run_one "$1" "${GPU:-0}" "$first_seconds" &
  [ $# -ge 2 ] && run_one "$2" "${GPU2:-1}" &
  wait
}

plan() {
  {
    echo "## plan"
    echo "- corpus: $(corpus_figure train_tokens) training tokens ($(corpus_figure train_samples) samples of" \
         "$SEQ_LEN), $(corpus_figure valid_tokens) held-out tokens; validation: $(eval_iters) micro-batches of" \
         "$MICRO_BATCH"
    [ "$(corpus_figure valid_samples)" -ge $((MICRO_BATCH * $(eval_iters))) ] \
      || echo "- WARNING: the held-out split is smaller than one validation pass: raise VALID_FRACTION"
    for family in dense moe; do
      local want=$([ $family = moe ] && echo "${MOE_STEPS:-1000}" || echo "${DENSE_STEPS:-3000}")
      local steps=$(steps_of "${family}_bf16_a") cut=""
      [ "$steps" -lt "$want" ] && cut=" (cut from $want: the corpus holds one pass of $steps steps)"
      echo "- $family: $steps steps of $((MICRO_BATCH * SEQ_LEN)) tokens =" \
           "$((steps * MICRO_BATCH * SEQ_LEN)) tokens, one pass at most$cut"
    done
    echo
  } | tee -a "$OUT/summary.md"
}

compare() {
  local dense moe moe_labels=("BF16" "FP8")
  dense="$(run_dir dense_bf16_a) $(run_dir dense_fp8_a) $(run_dir dense_bf16_b)"
  moe="$(run_dir moe_bf16) $(run_dir moe_fp8)"
  if finished moe_bf16_b; then  # MoE's own seed-to-seed spread, as the dense comparison has
    moe="$moe $(run_dir moe_bf16_b)"
    moe_labels=("BF16 seed A" "FP8 seed A" "BF16 seed B")
  fi
  if [ "$1" != moe ]; then
    step parity_dense python tools/compare_runs.py --parity $dense --window 500
    step plot_dense python tools/plot_runs.py $dense --labels "BF16 seed A" "FP8 seed A" "BF16 seed B" \
      --metrics loss val_loss --gaps --smooth 10 --from-step 100 --out "$OUT/parity_dense.png"
    if finished dense_fp8blocks_a; then  # the opt-in against the same BF16 seeds
      step parity_dense_fp8blocks python tools/compare_runs.py --parity $(run_dir dense_bf16_a) \
        $(run_dir dense_fp8blocks_a) $(run_dir dense_bf16_b) --window 500
    fi
    if finished dense_fp8deepgemm_a; then  # the deepgemm backend, likewise
      step parity_dense_fp8deepgemm python tools/compare_runs.py --parity $(run_dir dense_bf16_a) \
        $(run_dir dense_fp8deepgemm_a) $(run_dir dense_bf16_b) --window 500
    fi
  fi
  if [ "$1" != dense ]; then
    step parity_moe python tools/compare_runs.py --parity $moe --window 250
    if finished moe_bf16_b && finished moe_fp8_b; then  # the second seed pair: FP8 B against BF16 B
      step parity_moe_seed_b python tools/compare_runs.py --parity $(run_dir moe_bf16_b) $(run_dir moe_fp8_b) \
        $(run_dir moe_bf16) --window 250 --seeds B A
      moe="$moe $(run_dir moe_fp8_b)"
      moe_labels+=("FP8 seed B")
    fi
    local ablation gap_runs=() gap_labels=()
    for ablation in fp8bf16experts fp8expertsonly fp8bf16attn fp8allbf16; do  # against BF16 seed B, A's spread beside
      if finished moe_bf16 && finished moe_bf16_b && finished "moe_${ablation}_b"; then
        step "parity_moe_$ablation" python tools/compare_runs.py --parity $(run_dir moe_bf16_b) \
          $(run_dir "moe_${ablation}_b") $(run_dir moe_bf16) --window 250 --seeds B A
        gap_runs+=("$(run_dir "moe_${ablation}_b")")
        gap_labels+=("$ablation")
      fi
    done
    if [ ${#gap_runs[@]} -gt 0 ] && finished moe_fp8_b; then  # all of them in one table, FP8 B and BF16 A beside
      local steps first windows=()
      steps=$(steps_of moe_bf16_b)
      for (( first = 1; first <= steps; first += 250 )); do
        windows+=("$first-$(( first + 249 < steps ? first + 249 : steps ))")
      done
      step moe_ablations python tools/compare_runs.py --gaps $(run_dir moe_bf16_b) $(run_dir moe_bf16) \
        $(run_dir moe_fp8_b) "${gap_runs[@]}" --windows "${windows[@]}" \
        --labels "BF16 seed B" "BF16 seed A" "FP8 seed B" "${gap_labels[@]}"
    fi
    step plot_moe python tools/plot_runs.py $moe --labels "${moe_labels[@]}" --metrics loss val_loss --gaps \
      --smooth 10 --from-step 100 --out "$OUT/parity_moe.png"
    seed_b_repeats
  fi
}

seed_b_repeats() {  # MoE's seed-B pair repeated (NAME_r2, NAME_r3: the same settings, so the same seed and data
  # order): what the GPU's non-deterministic kernels alone spread one configuration over, and FP8's mean against
  # BF16's (`compare_runs.py --pooled`), once two BF16 runs and one FP8 run have finished; plotted against the first
  # (labels kept per recipe, like the runs: ALL_RUNS interleaves the two recipes, the plot takes BF16's runs first)
  local name repeat bf16=() fp8=() bf16_labels=() fp8_labels=()
  for name in $ALL_RUNS; do
    [[ $name =~ ^moe_(bf16|fp8)_b(_r[0-9])?$ ]] && finished "$name" || continue
    repeat=${name##*_r}
    [ "$repeat" = "$name" ] && repeat="" || repeat=" repeat $repeat"
    case $name in
      moe_bf16_*) bf16+=("$(run_dir "$name")"); bf16_labels+=("BF16 B$repeat") ;;
      *) fp8+=("$(run_dir "$name")"); fp8_labels+=("FP8 B$repeat") ;;
    esac
  done
  [ ${#bf16[@]} -ge 2 ] && [ ${#fp8[@]} -ge 1 ] || return 0
  step moe_seed_b_repeats python tools/compare_runs.py --pooled "${bf16[@]}" --against "${fp8[@]}" \
    --labels "BF16 seed B" "FP8 seed B" --window 250
  step plot_moe_repeats python tools/plot_runs.py "${bf16[@]}" "${fp8[@]}" --labels "${bf16_labels[@]}" "${fp8_labels[@]}" \
    --metrics loss val_loss --gaps --smooth 10 --from-step 100 --out "$OUT/parity_moe_repeats.png"
}

cross_eval() {  # cross_eval NAME: NAME's newest checkpoint (a run of this session, trained with KEEP_CHECKPOINTS=1
  # and a checkpoint interval, so that its last step is kept) evaluated on the held-out split under both recipes:
  # an FP8 run's gap to BF16 splits into what FP8 costs the evaluation itself (its weights evaluated in BF16) and
  # what stays in its trained weights; a BF16 run evaluated in FP8 gives FP8's cost to a BF16-trained model
  local name=$1 overrides recipe record rc
  overrides=$(run_overrides "$name") || return 2
  if ! ls -d "$RUNS/$name"/checkpoints/step_* > /dev/null 2>&1; then
    echo "cross_eval $name: no checkpoint in $RUNS/$name/checkpoints: run it in this session with KEEP_CHECKPOINTS=1" \
         "and MOE_CHECKPOINT_INTERVAL (or DENSE_CHECKPOINT_INTERVAL) set, without PRIOR_RUNS holding it" >&2
    return 2
  fi
  mkdir -p "$OUT/runs/$name"
  for recipe in bf16 fp8; do
    set -f  # (as in run_one: the overrides are never globbed)
    record=$(python launch/pretrain.py --config tiny_dense $overrides precision.recipe=$recipe --evaluate \
               2>> "$LOGS/cross_eval_$name.log" | grep '^{')
    rc=$?
    set +f
    [ $rc = 0 ] || { echo "cross_eval $name: the $recipe evaluation failed: $(tail -n 2 "$LOGS/cross_eval_$name.log")" \
                       >&2; return 1; }
    echo "$record" > "$OUT/runs/$name/eval_$recipe.json"
  done
  {
    echo "## cross_eval $name"
    python - "$RUNS/$name/metrics.jsonl" "$OUT/runs/$name/eval_bf16.json" "$OUT/runs/$name/eval_fp8.json" <<'PY'
import json, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "eval"]
own = evals[-1] if evals else None
bf16, fp8 = (json.load(open(path)) for path in sys.argv[2:4])
print("| step | the run's own evaluation | its weights evaluated in BF16 | in FP8 | FP8 / BF16 evaluation |")
print("|---|---|---|---|---|")
own_text = f"{own['val_loss']:.4f} (step {own['step']})" if own else "-"
print(f"| {bf16['step']} | {own_text} | {bf16['val_loss']:.4f} | {fp8['val_loss']:.4f} | "
      f"{100 * (fp8['val_loss'] / bf16['val_loss'] - 1):+.3f}% |")
PY
    echo
  } | tee -a "$OUT/summary.md"
}

pack_out() {  # PACK_OUT=1: $OUT/runs and $OUT/logs go into $OUT/parity_files.tar.gz, merged with what earlier
  # sub-steps packed there, and leave $OUT. For machines that bring back only a few files from $OUT (this project's
  # GPU machine: at most 8, so in job CD of the twentieth session a finished run's metrics.jsonl stayed behind).
  [ "${PACK_OUT:-0}" = 1 ] || return 0
  local stage dir
  stage=$(mktemp -d)
  [ -f "$OUT/parity_files.tar.gz" ] && tar -xzf "$OUT/parity_files.tar.gz" -C "$stage"
  for dir in runs logs; do
    [ -d "$OUT/$dir" ] && cp -r "$OUT/$dir" "$stage/" && rm -rf "${OUT:?}/$dir"
  done
  tar -czf "$OUT/parity_files.tar.gz" -C "$stage" .
  rm -rf "$stage"
}
trap pack_out EXIT

case ${1:-} in
  run|next|status|compare) check_prior || exit 2 ;;
esac
case ${1:-} in
  measure) step corpus_measure python tools/preprocess_data.py --input "$CORPUS_INPUT" $TREE_OPTIONS \
             --output "$DATA" --dry-run ;;
  tokenizer) [ -f "$TOKENIZER" ] && echo "$TOKENIZER exists" || step tokenizer python tools/train_tokenizer.py \
             --input "$CORPUS_INPUT" $TREE_OPTIONS --sample-bytes "$TOKENIZER_SAMPLE_BYTES" --vocab-size "$VOCAB_SIZE" \
             --output "$TOKENIZER" ;;
  tokenize) [ -f "$DATA/meta.json" ] && echo "$DATA exists" || step tokenize python tools/preprocess_data.py \
             --input "$CORPUS_INPUT" $TREE_OPTIONS --max-bytes "${CORPUS_MAX_BYTES:-0}" --tokenizer "$TOKENIZER" \
             --output "$DATA" --overwrite ;;
  plan) plan ;;
  corpus) for part in measure tokenizer tokenize plan; do bash "$0" $part || exit; done ;;
  run) shift; [ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: $0 run NAME [NAME2]" >&2; exit 2; }; run_pair "$@" ;;
  next) todo=$(for name in $ALL_RUNS; do finished "$name" || echo "$name"; done | head -n 2)
        if [ -z "$todo" ]; then echo "every run is finished: run compare"; else run_pair $todo; fi ;;
  status) [ -f "$DATA/meta.json" ] || { echo "no corpus in $DATA yet"; exit 0; }
          for name in $ALL_RUNS; do
            echo "$name: step $(last_step "$name") of $(steps_of "$name")$(prior_finished "$name" \
                  && echo " (in PRIOR_RUNS)")"
          done
          df -h "$WORK" | tail -n 1 ;;
  compare) case ${2:-all} in all|dense|moe) compare "${2:-all}" ;;
             *) echo "usage: $0 compare [dense|moe]" >&2; exit 2 ;; esac ;;
  cross_eval) known_run "${2:-}" || exit 2
              [ -f "$DATA/meta.json" ] || { echo "no corpus in $DATA: run the corpus sub-steps first" >&2; exit 2; }
              cross_eval "$2" ;;
  config) known_run "${2:-}" || exit 2
          [ -f "$DATA/meta.json" ] || { echo "no corpus in $DATA: run the corpus sub-steps first" >&2; exit 2; }
          overrides=$(run_overrides "${2:-}") || exit 2
          set -f  # (as in run_one: the overrides are never globbed)
          python launch/pretrain.py --config tiny_dense $overrides --print-config ;;
  *) echo "usage: OUT=dir bash $0 measure|tokenizer|tokenize|plan|corpus|run NAME [NAME2]|next|status|compare|" \
          "cross_eval NAME|config NAME" >&2
     exit 2 ;;
esac
