#!/usr/bin/env bash
# Two independent lanes of benchmarks/gpu_e2e.sh parts on a two-GPU machine, one GPU each, so one lease runs twice
# the work: OUT=dir bash benchmarks/gpu_two_lanes.sh "parts for GPU 0" "parts for GPU 1". Each lane's tables go to
# $OUT/lane0/summary.md and $OUT/lane1/summary.md. Lanes share the host's CPUs: time what you compare on one lane.
set -uo pipefail
OUT=${OUT:-/tmp/megafp8-gpu}
here=$(dirname "$0")
CUDA_VISIBLE_DEVICES=0 OUT="$OUT/lane0" bash "$here/gpu_e2e.sh" $1 &
CUDA_VISIBLE_DEVICES=1 OUT="$OUT/lane1" bash "$here/gpu_e2e.sh" $2 &
wait
