#!/usr/bin/env bash
# Issue 26: two-GPU scaling in one call on two H200s. The ~1B dense model (`--model 1b`) and the 8B-layer shape
# (`--model 8b-layers`; 16 of its layers under PP), BF16 and FP8 in each run (benchmarks/train_step.py): one GPU,
# DP=2 (sharded optimizer; each gradient bucket's reduce-scatter starts in backward, `optimizer.overlap_grad_reduce`,
# the default, set explicitly), TP=2 with sequence parallelism, PP=2 under 1F1B and DualPipeV, full recomputation on
# one GPU. The last step, `scaling`, turns the tables into one (benchmarks/scaling_table.py): per row tokens/s per
# GPU, efficiency against the one-GPU row (TFLOP/s per device, same model and recipe), FP8 / BF16, MFU, steady peak
# memory, and under PP the measured bubble (1 - efficiency) beside the schedule's theoretical one.
#
# CUDA graphs (`compile_mode: reduce-overhead`) where the layout allows: one GPU, DP=2 and full recomputation on one
# GPU (recomputed inside the compiled backward since the fifty-seventh session; CUDA graph trees fail under
# checkpointing around compiled code, pytorch/pytorch#154306). The others compile in the default mode, as CUDA graphs
# there are untried and a failure would lose the row: under DualPipeV, FP8 linears with deferred weight gradients run
# eagerly inside the compiled blocks (graph breaks); PP keeps several micro-batches in flight through each block. So
# efficiency is against the best one-GPU figure: on one H200 CUDA graphs gave ~1.5% over the default mode on the ~1B
# model (docs/performance.md).
# TP's compiled blocks hold no graph break since `0732281` (FP8 included), so `tp2_cuda_graphs` tries CUDA graphs
# around their collectives (functional collectives captured in the graphs); a failure there loses only that part.
#
# Timing: --steps 15 --warmup 6 --log-interval 3 (the median of three 3-step windows). A PP step (8 micro-batches)
# gives each GPU 4x a one-GPU step's work: --steps 7 --warmup 3 --log-interval 1 (the median of four steps).
# The 600 s of the call, estimated (not yet measured: compile times of these shapes are unknown; each run pays
# ~15 s of start-up, per recipe a model build and a compile, cached on disk for a later run of the same graph),
# in the order the parts run, the issue's "done when" figures first:
#   one_gpu    ~100 s  both baselines at once, the 8B-layer shape on GPU 0, ~1B on GPU 1 (shared host CPUs)
#   dp2_8b      ~70 s  8B-layer shape, DP=2, 4 samples per rank (the one-GPU run's graphs: on-disk cache hits)
#   tp2_8b      ~80 s  8B-layer shape, TP=2 + SP, one micro-batch of 4 x 4096
#   pp2_8b     ~180 s  16 layers of the 8B-layer shape, PP=2, 8 micro-batches of 2 x 4096, 1F1B then DualPipeV
#   dp2_1b      ~60 s  ~1B, DP=2, 8 samples per rank
#   recompute   ~80 s  full recomputation on one GPU under CUDA graphs, the 8B-layer shape on GPU 0, ~1B on GPU 1
#   tp2_1b      ~70 s  ~1B, TP=2 + SP (likely past the budget: a second call)
#   pp2_1b     ~140 s  ~1B, PP=2, 8 micro-batches of 8 x 2048, 1F1B then DualPipeV (likely a second call)
#   tp2_cuda_graphs ~150 s  TP=2 + SP under CUDA graphs, the 8B-layer shape then ~1B (not in the default list)
#   tp2_overlap ~150 s  TP=2 + SP compiled with Inductor's comm/compute reordering (`training.compile_comm_overlap`:
#                      traced collectives are otherwise waited for at once), 8B-layer then ~1B (not in the default)
# Every step is bounded by what is left of BUDGET_S (default 570 s, leaving the call's last 30 s for a killed
# step's teardown and the summary) and by STEP_TIMEOUT (default 200 s); a step that would start with less than
# its estimate left is skipped, and the summary says so and how to run it.
# DEEPGEMM=1 first installs DeepGEMM (gpu_lib.sh's install_deepgemm, from .dg/DeepGEMM: carry it), so that FP8 runs
# on `deepgemm`, what `precision.fp8_backend: auto` picks where it is installed; on a fresh machine that takes
# ~100-170 s of BUDGET_S to build, 34-46 s where .dg carries the builds an earlier call brought back (gpu_lib.sh;
# jobs HY-IB, one GPU). REQUIRE_CARD=H200 runs nothing on other cards (gpu_lib.sh's start_summary). Without it
# FP8 runs on `hopper`.
# Usage: OUT=dir bash benchmarks/gpu_2gpu.sh [parts...]   (default: all of the above, in that order)
# Tables go to $OUT/summary.md, logs to $OUT/logs.tar.gz.
source "$(dirname "$0")/gpu_lib.sh"
ALL_PARTS="one_gpu dp2_8b tp2_8b pp2_8b dp2_1b recompute tp2_1b pp2_1b"
PARTS=${*:-$ALL_PARTS}
check_parts "${BASH_SOURCE[0]}" $PARTS
BUDGET_S=${BUDGET_S:-570}
STEP_TIMEOUT=${STEP_TIMEOUT:-200}
start_summary
visible_gpus
echo "GPUs visible: $GPUS; parts: $PARTS; budget ${BUDGET_S} s" | tee -a "$OUT/summary.md"
if [ "${DEEPGEMM:-0}" = 1 ]; then
  install_deepgemm  # its line in the summary says whether FP8 runs on deepgemm
fi

budgeted() {  # budgeted PART NAME ESTIMATE command...: `step` bounded by what is left of the budget, or skipped
  local part=$1 name=$2 estimate=$3 left=$((BUDGET_S - SECONDS))
  shift 3
  if [ "$left" -lt "$estimate" ]; then
    echo "## $name: SKIPPED: ${left} s of the ${BUDGET_S} s budget left, it needs ~${estimate} s (another call:" \
      "OUT=dir bash benchmarks/gpu_2gpu.sh $part)" | tee -a "$OUT/summary.md"
    return
  fi
  STEP_TIMEOUT=$((left < STEP_TIMEOUT ? left : STEP_TIMEOUT)) step "$name" "$@"
}

one_gpu_pair() {  # one_gpu_pair PART "NAME ESTIMATE command..." "NAME ESTIMATE command...": the first on GPU 0,
  # the second on GPU 1 at the same time (one after the other on GPU 0 when only one is visible); each lane writes
  # its own summary, appended to $OUT/summary.md in lane order once both are done
  local part=$1 lane
  if [ "$GPUS" -ge 2 ]; then
    (export CUDA_VISIBLE_DEVICES=0; OUT=$OUT/gpu0; mkdir -p "$OUT"; budgeted "$part" $2) &
    (export CUDA_VISIBLE_DEVICES=1; OUT=$OUT/gpu1; mkdir -p "$OUT"; budgeted "$part" $3) &
    wait
  else
    (export CUDA_VISIBLE_DEVICES=0; OUT=$OUT/gpu0; mkdir -p "$OUT"; budgeted "$part" $2; budgeted "$part" $3)
  fi
  for lane in "$OUT"/gpu0 "$OUT"/gpu1; do
    [ -f "$lane/summary.md" ] && cat "$lane/summary.md" >> "$OUT/summary.md"
    rm -rf "$lane"
  done
}

# Words, so `step` can run them (not shell functions). Overrides go before the options (train_step.py takes them as
# one run of words), --recipes last. Each one-GPU lane tokenizes the corpus into its own directory (two lanes
# writing one would race).
ONE="python benchmarks/train_step.py"
DATA0="--data /tmp/megafp8-bench-data-gpu0"
DATA1="--data /tmp/megafp8-bench-data-gpu1"
TWO="torchrun --standalone --nproc_per_node=2 benchmarks/train_step.py"
CUDA_GRAPHS="training.compile=true training.compile_mode=reduce-overhead"
COMPILED="training.compile=true"
DP="optimizer.sharded=true optimizer.overlap_grad_reduce=true"
SP="parallel.tp=2 parallel.sequence_parallel=true"
RECOMPUTE="training.recompute=full"
PP_8B="parallel.pp=2 model.num_layers=16 training.micro_batch_size=2"  # --global-batch 16: 8 micro-batches
PP_1B="parallel.pp=2"                                                  # 8 x 2048 per micro-batch; --global-batch 64
TIMED="--steps 15 --warmup 6 --log-interval 3 --recipes bf16 fp8"
PP_TIMED="--steps 7 --warmup 3 --log-interval 1 --recipes bf16 fp8"
for part in $PARTS; do
  case $part in
    one_gpu) gpus_for 1 one_gpu || continue
      one_gpu_pair one_gpu "one_gpu_8b 100 $ONE $CUDA_GRAPHS --model 8b-layers $DATA0 $TIMED" \
        "one_gpu_1b 90 $ONE $CUDA_GRAPHS --model 1b $DATA1 $TIMED" ;;
    dp2_8b) gpus_for 2 dp2_8b || continue
      budgeted dp2_8b dp2_8b 70 $TWO $CUDA_GRAPHS $DP --model 8b-layers --global-batch 8 $TIMED ;;
    tp2_8b) gpus_for 2 tp2_8b || continue
      budgeted tp2_8b tp2_sp_8b 80 $TWO $COMPILED $SP --model 8b-layers --global-batch 4 $TIMED ;;
    pp2_8b) gpus_for 2 pp2_8b || continue
      for schedule in 1f1b dualpipev; do
        budgeted pp2_8b pp2_${schedule}_8b_16_layers 90 $TWO $COMPILED $PP_8B parallel.pp_schedule=$schedule \
          --model 8b-layers --global-batch 16 $PP_TIMED
      done ;;
    dp2_1b) gpus_for 2 dp2_1b || continue
      budgeted dp2_1b dp2_1b 60 $TWO $CUDA_GRAPHS $DP --model 1b --global-batch 16 $TIMED ;;
    recompute) gpus_for 1 recompute || continue  # under CUDA graphs, as one_gpu (recomputed in the compiled backward)
      one_gpu_pair recompute "recompute_8b 80 $ONE $CUDA_GRAPHS $RECOMPUTE --model 8b-layers $DATA0 $TIMED" \
        "recompute_1b 70 $ONE $CUDA_GRAPHS $RECOMPUTE --model 1b $DATA1 $TIMED" ;;
    tp2_1b) gpus_for 2 tp2_1b || continue
      budgeted tp2_1b tp2_sp_1b 70 $TWO $COMPILED $SP --model 1b --global-batch 8 $TIMED ;;
    tp2_cuda_graphs) gpus_for 2 tp2_cuda_graphs || continue
      budgeted tp2_cuda_graphs tp2_sp_cuda_graphs_8b 80 $TWO $CUDA_GRAPHS $SP --model 8b-layers --global-batch 4 $TIMED
      budgeted tp2_cuda_graphs tp2_sp_cuda_graphs_1b 70 $TWO $CUDA_GRAPHS $SP --model 1b --global-batch 8 $TIMED ;;
    tp2_overlap) gpus_for 2 tp2_overlap || continue
      budgeted tp2_overlap tp2_sp_overlap_8b 80 $TWO $COMPILED training.compile_comm_overlap=true $SP \
        --model 8b-layers --global-batch 4 $TIMED
      budgeted tp2_overlap tp2_sp_overlap_1b 70 $TWO $COMPILED training.compile_comm_overlap=true $SP --model 1b \
        --global-batch 8 $TIMED ;;
    pp2_1b) gpus_for 2 pp2_1b || continue
      for schedule in 1f1b dualpipev; do
        budgeted pp2_1b pp2_${schedule}_1b 70 $TWO $COMPILED $PP_1B parallel.pp_schedule=$schedule --model 1b \
          --global-batch 64 $PP_TIMED
      done ;;
  esac
done
# Efficiency against the one-GPU rows of this summary. A later call's parts (without one_gpu) are compared with the
# first call's: python benchmarks/scaling_table.py first/summary.md later/summary.md --baselines one_gpu_8b one_gpu_1b
# (only where both calls got the same card, as the summaries' heads name it: otherwise its rows say n/a; run one_gpu
# again in the later call)
step scaling python benchmarks/scaling_table.py "$OUT/summary.md" --baselines one_gpu_8b one_gpu_1b
finish_summary
