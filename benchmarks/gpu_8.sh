#!/usr/bin/env bash
# Issue 23: training steps on up to eight GPUs, each with tokens/s per GPU, MFU, every rank's steady peak memory and
# the memory planner's prediction for that rank (benchmarks/train_step.py; the planner is `tools/plan.py --dry-run`
# at the same layout, held to within 10% of the measured peak). Parts, by the GPUs they need:
#   one_gpu     the ~1B dense model and the small MoE (`--model moe`) on one GPU, BF16 and FP8
#   two_gpus    ~1B at TP=2 (SP) and PP=2 (1F1B); the MoE at EP=2, TP=2 (SP) and PP=2, BF16 and FP8
#   eight_gpus  the 16B MoE (configs/16b_moe_fp8.yaml) at TP2 x PP2 x EP2 (DP2) with DualPipeV and sequence
#               parallelism; ~1B at DP=8 (sharded optimizer) and at TP=2 (SP) x DP=4; BF16 and FP8 each
#   loss_8gpu   200 steps of ~1B FP8 at TP=2 x DP=4 against one GPU, same seed, data and global batch (4 micro-batches
#               accumulated): tools/compare_runs.py's per-step loss gaps. Equal within BF16 noise means a max abs
#               loss gap within 0.05, about twice what TP=2 + SP drifted from TP=1 in 30 steps (0.027,
#               docs/benchmarks.md): the reductions add in another order, and BF16 rounding makes the runs drift.
#               Checked (compare_runs.py --max-loss-gap 0.05): a larger gap is a FAILED line under loss_compare.
# A part whose GPUs are not visible is skipped, and the summary says which and why; so is loss_8gpu's comparison
# where either run did not finish (timed out or failed).
# The layout the planner recommends for eight GPUs (`tools/plan.py --layouts`) runs after the fixed layouts; where
# the planner answers that no layout fits, it is skipped, and where the planner fails, the summary says FAILED.
# Usage: OUT=dir bash benchmarks/gpu_8.sh [parts...]   (default: one_gpu two_gpus eight_gpus loss_8gpu)
# STEP_TIMEOUT (s) bounds each step; tables go to $OUT/summary.md, logs to $OUT/logs.tar.gz, loss_8gpu's two
# runs' metrics to $OUT/loss_runs/. DEEPGEMM=1 installs
# DeepGEMM first (gpu_lib.sh's install_deepgemm, from .dg/DeepGEMM: carry it), so that FP8 runs on `deepgemm`, what
# `precision.fp8_backend: auto` picks where it is installed (~100-170 s on a fresh machine, 34-46 s from
# builds carried in .dg); else on `hopper`. REQUIRE_CARD=H200 runs nothing on other cards.
source "$(dirname "$0")/gpu_lib.sh"
PARTS=${*:-one_gpu two_gpus eight_gpus loss_8gpu}
check_parts "${BASH_SOURCE[0]}" $PARTS
start_summary
visible_gpus
echo "GPUs visible: $GPUS" | tee -a "$OUT/summary.md"
if [ "${DEEPGEMM:-0}" = 1 ]; then
  install_deepgemm  # its line in the summary says whether FP8 runs on deepgemm
fi

# The benchmark on 1, 2 and 8 GPUs (one process per GPU); words, so `step` can run them (not shell functions).
ONE="python benchmarks/train_step.py"
TWO="torchrun --standalone --nproc_per_node=2 benchmarks/train_step.py"
EIGHT="torchrun --standalone --nproc_per_node=8 benchmarks/train_step.py"
SP="parallel.tp=2 parallel.sequence_parallel=true"
for part in $PARTS; do
  case $part in
    one_gpu) gpus_for 1 one_gpu || continue
      step dense_1gpu $ONE --model 1b --recipes bf16 fp8
      step moe_1gpu $ONE --model moe --recipes bf16 fp8 ;;
    two_gpus) gpus_for 2 two_gpus || continue
      # A micro-batch of 8 x 2048 tokens per step and rank, as on one GPU; PP=2 takes two, one per stage.
      step dense_tp2 $TWO $SP --model 1b --global-batch 8 --recipes bf16 fp8
      step dense_pp2 $TWO parallel.pp=2 --model 1b --global-batch 16 --recipes bf16 fp8
      step moe_ep2 $TWO parallel.ep=2 --model moe --global-batch 16 --recipes bf16 fp8
      step moe_tp2 $TWO $SP --model moe --global-batch 8 --recipes bf16 fp8
      step moe_pp2 $TWO parallel.pp=2 --model moe --global-batch 16 --recipes bf16 fp8 ;;
    eight_gpus) gpus_for 8 eight_gpus || continue
      # DP2 x 8 micro-batches of one 4096-token sample: DualPipeV with pp=2 keeps 3 in flight.
      step moe16b_tp2_pp2_ep2 $EIGHT $SP parallel.pp=2 parallel.ep=2 parallel.pp_schedule=dualpipev \
        --config 16b_moe_fp8 --model config --global-batch 16 --recipes bf16 fp8
      # The planner's recommendation for the 16B MoE on these GPUs (its table goes to the summary too). Its answer
      # "no layout fits" (exit status 0) skips the run; any other failure of the planner (an error, a crash, a
      # timeout, output with neither answer) is a FAILED line with the end of its stderr.
      # The planner runs once: its table goes to the summary and to $LOGS/moe16b_plan.out, read for its answer.
      step moe16b_layouts bash -c 'set -o pipefail; python tools/plan.py "$@" | tee "$0"' "$LOGS/moe16b_plan.out" \
        --config 16b_moe_fp8 --world-size 8 --layouts
      plan_rc=$STEP_RC
      plan=$(cat "$LOGS/moe16b_plan.out" 2> /dev/null)
      recommended=$(sed -n 's/^recommended overrides: //p' <<< "$plan")
      if [ "$plan_rc" = 0 ] && [ -n "$recommended" ]; then
        step moe16b_recommended $EIGHT $recommended --config 16b_moe_fp8 --model config --global-batch 16 \
          --recipes bf16 fp8
      elif [ "$plan_rc" = 0 ] && grep -q '^no layout fits' <<< "$plan"; then
        echo "## moe16b_recommended: SKIPPED: the planner found no layout that fits (moe16b_layouts says why)" \
          | tee -a "$OUT/summary.md"
      else
        case $plan_rc in
          0) why="gave neither a recommendation nor 'no layout fits'" ;;
          124) why="timed out after ${STEP_TIMEOUT:-590} s" ;;
          *) why="failed (rc $plan_rc)" ;;
        esac
        echo "## moe16b_recommended: FAILED: the layout planner (tools/plan.py --layouts) $why: $(tail -n 3 \
          "$LOGS/moe16b_layouts.log" | tr '\n' ' ')" | tee -a "$OUT/summary.md"
      fi
      step dense_dp8 $EIGHT optimizer.sharded=true --model 1b --global-batch 64 --recipes bf16 fp8
      step dense_tp2_dp4 $EIGHT $SP --model 1b --global-batch 32 --recipes bf16 fp8 ;;
    loss_8gpu) gpus_for 8 loss_8gpu || continue
      stdlib_corpus || continue  # its FAILED line says why the loss runs did not run
      RUN_DIR=$(mktemp -d)  # fresh run directories: nothing to resume
      RUNS="$ONE_B_MODEL precision.recipe=fp8 training.micro_batch_size=8 training.global_batch_size=32
        training.steps=200 optimizer.lr=3e-4 optimizer.min_lr=3e-5 optimizer.warmup_steps=20 training.eval_interval=0
        logging.log_interval=1 logging.output_dir=$RUN_DIR"
      step loss_1gpu python launch/pretrain.py --config tiny_dense $RUNS run_name=fp8_1gpu
      unfinished_runs=$(unfinished loss_1gpu "$STEP_RC")
      step loss_tp2_dp4 torchrun --standalone --nproc_per_node=8 launch/pretrain.py --config tiny_dense $RUNS $SP \
        run_name=fp8_tp2_dp4
      more=$(unfinished loss_tp2_dp4 "$STEP_RC")
      for run in fp8_1gpu fp8_tp2_dp4; do  # the two runs' metrics come back with the results (docs/parity_runs)
        [ -f "$RUN_DIR/$run/metrics.jsonl" ] && mkdir -p "$OUT/loss_runs/$run" \
          && cp "$RUN_DIR/$run/metrics.jsonl" "$OUT/loss_runs/$run/"
      done
      [ -n "$unfinished_runs" ] && [ -n "$more" ] && unfinished_runs+="; "
      unfinished_runs+=$more
      # Only two whole runs are compared: over a run cut short, compare_runs.py would compare the steps it logged.
      if [ -z "$unfinished_runs" ]; then
        step loss_compare python tools/compare_runs.py "$RUN_DIR/fp8_1gpu" "$RUN_DIR/fp8_tp2_dp4" --skip 10 \
          --max-loss-gap 0.05
      else
        echo "## loss_compare: SKIPPED: $unfinished_runs" | tee -a "$OUT/summary.md"
      fi ;;
  esac
done
finish_summary
