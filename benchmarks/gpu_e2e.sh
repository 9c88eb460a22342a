#!/usr/bin/env bash
# Issue 10 on one H200: whole training steps of the ~1B dense and the small MoE model in BF16 and FP8, eager and
# compiled (benchmarks/train_step.py), the plain-PyTorch yardstick in BF16 and torchao's float8 recipes on the
# same shape in the same job (benchmarks/reference_model.py; torchao's wheel carried in wheels/), and kernel-time
# profiles of the steps. Tables go to $OUT/summary.md, logs to $OUT/logs.tar.gz.
# Usage: OUT=dir bash benchmarks/gpu_e2e.sh [parts...]   (parts, default: ours ref compiled profile moe; also ref_eager,
# ref_moe (the MoE yardstick, BF16 and torchao's rowwise FP8 experts),
# moe_compiled, compiled_ro (CUDA graphs), compiled_fp8 (FP8 only), tests (the gpu-marked tests), fused_quantize (our
# quantizers' bandwidth, fused producers against eager and Inductor), profile_compiled (FP8 only), grouped_gemm (MoE
# grouped GEMMs against BF16 and torch's FP8 ones; grouped_moe: the MoE model's shapes, our epilogues), tests_fp8 (the FP8 kernels' and layers' gpu tests), tests_one_gpu
# (one-GPU training tests), tests_optim (gradient clipping and the fused AdamW update on CUDA;
# compiled_ro_unfused_update, compiled_ro_8b_unfused_update: whole steps with the update's separate passes),
# fp8_linear (one layer, BF16 vs FP8, eager and replayed from CUDA graphs; fp8_linear_hopper: cublas and hopper;
# launch_cost: host time per call of each piece and layer, the cublas then the hopper backend, with cProfile;
# launch_cost_ab: the same, $OLD and this tree interleaved), the loss without an FP32 copy of the logits against
# F.cross_entropy (cross_entropy; tests_loss: its GPU test), the column-quantizer experiment in $EXP against this tree
# (column_experiment: GPU tests and kernel timings),
# the 8B-layer shape (compiled_ro_8b,
# ref_8b, profile_compiled_8b; compiled_ro_8b_kept_t and
# compiled_ro_kept_t: FP8 keeping its weight transposes; memory_modes: both models' memory in every mode), BF16 and FP8
# profiled side by side (profile_pair, profile_pair_ro: the ~1B under CUDA graphs, profile_pair_8b,
# profile_moe_compiled), the MoE GPU tests (tests_moe), the warp-specialized GEMMs' tests (tests_ws; tests_dense_ws:
# the hopper backend's dense GEMMs on it), the weight
# gradient through cuBLASLt into main_grad (tests_cublaslt), Nsight Compute on SwiGLU backward's column kernel and the
# wgrad GEMM (ncu_kernels; ncu_producers: the producers' Gluon kernels at the 8B-layer step's shapes, their L1
# wavefronts and bank conflicts; ncu_ws: our warp-specialized kernel's fprop and wgrad; ncu_wgrad_forms: both scale
# forms at one M x N x K; ncu_l2: L2 bandwidth and clusters
# of the dense fprop, ours against cuBLAS's FP8 and BF16 GEMMs), clocks and power sampled during one GEMM run back to
# back (clocks_gemm: the fprop and the wgrad), DeepGEMM against ours on the same operands (deepgemm: its source
# carried in .dg/DeepGEMM and built there; deepgemm_steps: the 8B-layer step on the deepgemm backend;
# fp8_linear_deepgemm: the FP8 linear on cublas, hopper and deepgemm; deepgemm_steps_1b_moe: the ~1B and MoE steps
# on it; tests_resume: a run under CUDA graphs resumed in a new process, hopper, deepgemm and auto; auto_deepgemm:
# that test and the ~1B step on `auto` where DeepGEMM is installed, the backend it chose in the summary; auto_steps: the
# ~1B, 8B-layer and MoE steps on it; qk_norm_steps: the ~1B with Qwen's query/key norms and q/k/v bias;
# recompute_layers_steps: the ~1B with all, half and none of its blocks recomputed; moe_auto: the MoE step on it
# MOE_REPEATS times (default 2) as train_step.py runs it, then once with the router balanced (as moe_balanced;
# MOE_BALANCED=0 skips it), and with MOE_ACCUM=1 once at four micro-batches per optimizer step; MOE_OVERRIDES: config
# overrides for all of its runs;
# deterministic_cost: each of DET_MODELS (default "1b 8b-layers moe") plain and under `training.deterministic`;
# determinism: whether each of REPEAT_MODELS (default 8b-layers) repeats to the bit, plain and under the mode (or in
# each of REPEAT_MODES: plain, deterministic, or one part of the mode alone), on DeepGEMM (benchmarks/determinism.py);
# ab_moe_auto: $OLD against this tree on that step (ab_moe_balanced: after the router has balanced; AB_RECIPES=fp8
# times FP8 alone, where the change leaves BF16's code as it was);
# recompute_in_graph_memory: what the recomputation inside the compiled backward keeps (the ~1B, BF16, allocator
# history of its first steps and the partitioner's graphs, in $OUT);
# recompute_in_graph_steps: its GPU test, then its ~1B steps compiled with and without CUDA graphs;
# tests_session55: the GPU tests of
# context parallelism's kernels, profiling and the unfused QKV path), clocks and
# power sampled during
# the 8B-layer steps (clocks_8b), SwiGLU backward's column
# kernel against the Gluon variant (swiglu_cols), the row + column quantizer against its Gluon twin (rows_cols; with
# the MoE gathers' two walks and their GPU tests: gathers_walk), RoPE's
# backward quantizer against its Gluon twin (rope), dense
# wgrad GEMMs (wgrad_gemm; wgrad_bf16: the BF16 columns only; dense_gemm: the three dense GEMMs, cuBLAS against the
# warp-specialized kernel; dense_gemm_graphs, grouped_gemm_graphs: replayed from CUDA graphs; group_m: the dense
# fprop and dgrad in groups of 8, 16 and 32 row tiles), SDPA's backends on our
# attention shapes (attention;
# tests_attention; whole steps under CUDA graphs with torch's order and with `model.attention_backend: auto`: attn_1b,
# attn_8b; eager: attn_eager; the ~1B with MLA, compiled: attn_mla), the GPU tests of RoPE's backward fused into the
# QKV projection's quantizer (tests_rope), backward on autograd's worker thread against the
# calling thread (fp8_linear_threads; whole steps: threads_eager, threads_compiled, threads_moe), the weight gradients
# into main_grad on the GPU, FP8 and BF16, with the one-GPU training tests (tests_main_grad), the 8B-layer eager memory
# row alone (memory_8b_eager), the 8B-layer step's memory under CUDA graphs, each recipe in a fresh process, as the
# allocator comes and with expandable segments (memory_8b_ro_fresh, expandable_8b), the hopper backend's
# conformance tests (tests_hopper), the FP8 MoE step profiled with the
# default and the hopper backend (profile_moe_fp8, profile_moe_fp8_hopper; moe_compiled_hopper; moe_compiled_accum: both
# backends, four micro-batches per step), cg_diag and cg_diag_8b (CUDA graph logs of the FP8 step), an older commit's
# tree in $OLD (old_compiled_ro, old_compiled_ro_8b, old_compiled_ro_bf16, old_compiled_ro_8b_bf16, old_fused_quantize,
# old_profile_compiled, old_moe, old_moe_compiled, old_wgrad_gemm, old_grouped_gemm; ab_ro, ab_ro_8b, ab_ro_moe: the
# two trees' steps interleaved, AB_REPEATS runs each, benchmarks/ab_steps.py: `git archive COMMIT | tar -x -C
# DIR`, carried), the MoE step after the router has balanced (moe_balanced: MOE_WARMUP untimed steps, default 200),
# and on two GPUs moe_ep2, moe_dp2, dense_2gpu, cp_2gpu: the ~1B at 32K tokens, one GPU against CP=2). `profile` also lists the host's busiest operators.
# tests_all_deepgemm: the one-GPU tests with DeepGEMM installed. STEP_TIMEOUT (s) bounds each part; PROFILE_TOP the
# rows of profile_moe_compiled's tables (default 15), PROFILE_RECIPES its recipes (default both). REQUIRE_CARD=NAME
# (e.g. H200): run nothing unless every GPU's name has NAME in it (gpu_lib.sh's start_summary, every script).
source "$(dirname "$0")/gpu_lib.sh"
PARTS=${*:-ours ref compiled profile moe}
check_parts "${BASH_SOURCE[0]}" $PARTS
start_summary
install_torchao
# The MoE step after the router has balanced: MOE_WARMUP untimed steps with the balancing bias moving MOE_BIAS_RATE a
# step, then 30 timed (moe_balanced says why 210), under CUDA graphs; every part that times it passes these.
warm=${MOE_WARMUP:-210}
MOE_BALANCED_STEP=(--model moe --warmup "$warm" --steps $((warm + 30)) training.compile=true
                   training.compile_mode=reduce-overhead model.moe.bias_update_rate="${MOE_BIAS_RATE:-0.01}")
# Each part runs in a subshell: what one part sources (install_deepgemm's environment, under which `auto` picks the
# deepgemm backend) does not reach the parts after it, whose `auto` rows then stay on hopper.
for part in $PARTS; do (
  case $part in
    tests) step gpu_tests python -m pytest -q -m gpu tests/ -x -p no:cacheprovider ;;
    tests_fp8) step gpu_tests_fp8 python -m pytest -q -m gpu tests/test_fp8_backends.py tests/test_fp8_gpu.py \
           tests/test_gluon_kernels_gpu.py tests/test_moe_gpu.py \
           -p no:cacheprovider ;;
    tests_one_gpu) step gpu_tests_one_gpu python -m pytest -q -m gpu tests/test_gpu.py tests/test_fp8_gpu.py \
           tests/test_moe_gpu.py \
           -k "host_wait or learns or moe_layer_on_cuda or mla_moe" -p no:cacheprovider ;;
    fp8_linear) step fp8_linear python benchmarks/fp8_linear.py --backends cublas --cuda-graphs ;;
    fp8_linear_hopper) step fp8_linear_hopper python benchmarks/fp8_linear.py --backends cublas hopper --cuda-graphs ;;
    fp8_linear_deepgemm)  # the FP8 linear on the three SM90 backends (DeepGEMM built, or reused, first)
      install_deepgemm
      step fp8_linear_deepgemm python benchmarks/fp8_linear.py --backends cublas hopper deepgemm --cuda-graphs ;;
    compiled_ro_8b) step ours_compiled_cudagraphs_8b python benchmarks/train_step.py training.compile=true \
           training.compile_mode=reduce-overhead --model 8b-layers --recipes bf16 fp8 ;;
    compiled_ro_8b_kept_t) step ours_compiled_cudagraphs_8b_kept_transpose python benchmarks/train_step.py \
           training.compile=true training.compile_mode=reduce-overhead precision.fp8_keep_weight_transpose=true \
           --model 8b-layers --recipes fp8 ;;
    compiled_ro_kept_t) step ours_compiled_cudagraphs_kept_transpose python benchmarks/train_step.py \
           training.compile=true training.compile_mode=reduce-overhead precision.fp8_keep_weight_transpose=true \
           --model 1b --recipes fp8 ;;
    memory_modes)  # issue 18's memory bar (FP8 at or below BF16 in every mode): each model eager, compiled and under
                   # CUDA graphs, BF16 and FP8; short runs, memory columns
      for model in 1b 8b-layers; do
        for mode in eager compiled cudagraphs; do
          case $mode in
            eager) flags="" ;;
            compiled) flags="training.compile=true" ;;
            cudagraphs) flags="training.compile=true training.compile_mode=reduce-overhead" ;;
          esac
          step "memory_${model}_${mode}" python benchmarks/train_step.py $flags --model $model --steps 10 --warmup 6 \
            --log-interval 2 --recipes bf16 fp8
        done
      done ;;
    ref_8b) step reference_compiled_8b python benchmarks/reference_model.py --compile --layers 8 --hidden 4096 \
           --ffn 14336 --heads 32 --seq 4096 --batch 4 --recipes bf16 torchao-tensorwise torchao-blockwise ;;
    profile_pair) step profile_compiled_pair python benchmarks/train_step.py training.compile=true --model 1b \
           --recipes bf16 fp8 --profile 3 ;;
    profile_pair_ro) step profile_cudagraphs_pair python benchmarks/train_step.py training.compile=true \
           training.compile_mode=reduce-overhead --model 1b --recipes bf16 fp8 --profile 3 --profile-top 30 ;;
    profile_pair_8b) step profile_compiled_pair_8b python benchmarks/train_step.py training.compile=true \
           --model 8b-layers --recipes bf16 fp8 --profile 3 --profile-top 40 ;;
    profile_moe_compiled)  # on `auto` as moe_auto times it: DeepGEMM installed here too (each part is a subshell)
      install_deepgemm
      step profile_moe_compiled python benchmarks/train_step.py training.compile=true \
           --model moe --recipes ${PROFILE_RECIPES:-bf16 fp8} --profile 3 --profile-top "${PROFILE_TOP:-15}" ;;
    tests_moe) step gpu_tests_moe python -m pytest -q -m gpu tests/test_fp8_gpu.py \
           tests/test_moe_gpu.py tests/test_gpu.py \
           tests/test_fp8_backends.py -k "moe or grouped or gathering or permutation or expert_rows or every_autotuned" \
           -p no:cacheprovider ;;
    tests_all_one_gpu) step gpu_tests_all_one_gpu python -m pytest -q -m gpu tests/ -k "not two_gpus" \
           -p no:cacheprovider ;;
    tests_all_deepgemm)  # the same with DeepGEMM installed (what `auto` then runs), four workers, skip reasons listed
      install_deepgemm
      step gpu_tests_all_deepgemm python -m pytest -q -rs -m gpu tests/ -k "not two_gpus" -n 4 -p no:cacheprovider ;;
    tests_two_gpus) step gpu_tests_two_gpus python -m pytest -q -m gpu tests/test_gpu.py -k two_gpus \
           -p no:cacheprovider ;;
    tests_weights) step gpu_tests_weights python -m pytest -q -m gpu tests/test_fp8_backends.py tests/test_fp8_gpu.py \
           tests/test_moe_gpu.py \
           -k "transpose or weight or grouped_gemms or moe" -p no:cacheprovider ;;
    old_moe) step old_moe bash -c "cd \"$OLD\" && python benchmarks/train_step.py --model moe --recipes bf16 fp8" ;;
    old_moe_compiled) step old_moe_compiled bash -c "cd \"$OLD\" && python benchmarks/train_step.py \
           training.compile=true --model moe --recipes bf16 fp8" ;;
    profile_compiled_8b) step profile_compiled_8b python benchmarks/train_step.py training.compile=true \
           --model 8b-layers --recipes fp8 --profile 3 ;;
    cg_diag) step cudagraph_diagnostics env TORCH_LOGS=perf_hints,cudagraph_static_inputs python \
           benchmarks/train_step.py training.compile=true training.compile_mode=reduce-overhead --model 1b \
           --recipes fp8 --steps 12 --warmup 6 ;;
    cg_diag_8b)  # the 8B-layer FP8 warm-up peaks ~7 GiB above the plan (BF16's and ~1B's match it): do the graphs
                 # copy inputs they should take as static?
      step cudagraph_diagnostics_8b env TORCH_LOGS=perf_hints,cudagraph_static_inputs python \
           benchmarks/train_step.py training.compile=true training.compile_mode=reduce-overhead --model 8b-layers \
           --recipes fp8 --steps 12 --warmup 6 ;;
    old_compiled_ro) step old_compiled_cudagraphs bash -c "cd \"$OLD\" && python benchmarks/train_step.py \
           training.compile=true training.compile_mode=reduce-overhead --model 1b --recipes fp8" ;;
    old_compiled_ro_bf16) step old_compiled_cudagraphs_bf16 bash -c "cd \"$OLD\" && python benchmarks/train_step.py \
           training.compile=true training.compile_mode=reduce-overhead --model 1b --recipes bf16" ;;
    old_compiled_ro_8b_bf16) step old_compiled_cudagraphs_8b_bf16 bash -c "cd \"$OLD\" && python \
           benchmarks/train_step.py training.compile=true training.compile_mode=reduce-overhead --model 8b-layers \
           --recipes bf16" ;;
    old_compiled_ro_8b) step old_compiled_cudagraphs_8b bash -c "cd \"$OLD\" && python benchmarks/train_step.py \
           training.compile=true training.compile_mode=reduce-overhead --model 8b-layers --recipes fp8" ;;
    old_profile_compiled) step old_profile_compiled bash -c "cd \"$OLD\" && python benchmarks/train_step.py \
           training.compile=true --model 1b --recipes fp8 --profile 3" ;;
    fused_quantize) step fused_quantize python benchmarks/fused_quantize.py ;;
    ab_ro|ab_ro_8b|ab_ro_moe)  # $OLD against this tree, interleaved (ABBA), AB_REPEATS runs each: CUDA graphs,
                               # AB_RECIPES
      model=1b; [ "$part" = ab_ro_8b ] && model=8b-layers; [ "$part" = ab_ro_moe ] && model=moe
      step "ab_compiled_cudagraphs_$model" python benchmarks/ab_steps.py --old "$OLD" --repeats "${AB_REPEATS:-3}" \
        --timeout "${AB_RUN_TIMEOUT:-240}" -- --model "$model" training.compile=true \
        training.compile_mode=reduce-overhead --recipes ${AB_RECIPES:-fp8} ;;
    moe_balanced)  # the MoE step after MOE_WARMUP (default 210) untimed steps with the balancing bias moving
                   # MOE_BIAS_RATE (default 0.01) a step: the benchmark's first steps send nearly every token to one
                   # expert a layer, and at the default 1e-3 the bias has not undone that after 200 steps (job FV);
                   # CUDA graphs, BF16 and FP8, 30 timed steps; the table's "expert load" column says how balanced
                   # the timed steps were. 210, not 200: FP8's health-sampled step (every 100th, eager) then falls
                   # before the warm-up's last step, which empties the allocator's cache, and not among the timed
                   # steps, whose memory columns it set in jobs FV-FW
      step moe_balanced python benchmarks/train_step.py "${MOE_BALANCED_STEP[@]}" --recipes bf16 fp8 ;;
    old_fused_quantize) step old_fused_quantize bash -c "cd \"$OLD\" && python benchmarks/fused_quantize.py" ;;
    swiglu_cols) step swiglu_cols_variants python benchmarks/swiglu_cols_variants.py ;;
    rows_cols) step rows_cols_variants python benchmarks/rows_cols_variants.py ;;
    gathers_walk)  # the MoE gathers walking their token blocks first (FP8: rows_cols_gluon.GATHER_ROWS_FIRST; BF16:
                   # permute.GATHER_ROWS_BY_BLOCKS): their GPU tests (the same bytes either walk), then the row +
                   # column quantizer's variants, whose MoE expert-layout row and BF16 dispatch table time both walks
      step gathers_walk_tests python -m pytest -q -m gpu tests/test_gluon_kernels_gpu.py tests/test_moe_gpu.py -n 4 \
        -k "gluon_rows_cols or permutation_kernels" -p no:cacheprovider
      step rows_cols_variants python benchmarks/rows_cols_variants.py ;;
    group_m)  # the dense fprop and dgrad walking their output tiles in groups of 8 (the default), 16 and 32 row tiles
      step dense_gemm_group_m python benchmarks/dense_gemm.py --model 8b-layers 1b --gemms fprop dgrad --cuda-graphs \
        --iters 20 --columns "ws 256, interleaved FFMA" "ws 256, interleaved FFMA, GROUP_M 16" \
        "ws 256, interleaved FFMA, GROUP_M 32" ;;
    cross_entropy) step cross_entropy python benchmarks/cross_entropy.py ;;
    column_experiment)  # job EF's GPU test selection in this tree and in $EXP (a tree with the column-quantizer
                        # experiment, e.g. `git worktree add -f --detach old_tree d70d2de`, carried), failures listed
                        # whole; then SwiGLU backward's and the row + column quantizer's variants timed in both trees
      # (the Gluon kernels' tests have their own file since the sixty-seventh session; an older $EXP lacks it)
      selection='tests/test_fp8_gpu.py $(ls tests/test_gluon_kernels_gpu.py 2>/dev/null) tests/test_fp8_backends.py'
      selection="$selection tests/test_fp8_qkv.py -m gpu -n 4 -rf"
      selection="$selection -p no:cacheprovider -k 'gluon or quantiz or producer or rope'"
      variants="python benchmarks/swiglu_cols_variants.py && python benchmarks/rows_cols_variants.py"
      step column_tests_here bash -c "python -m pytest -q $selection"
      step column_tests_exp bash -c "cd \"$EXP\" && python -m pytest -q $selection"
      step column_variants_here bash -c "$variants"
      step column_variants_exp bash -c "cd \"$EXP\" && $variants" ;;
    tests_loss) step gpu_tests_loss python -m pytest -q -m gpu tests/test_cross_entropy.py -p no:cacheprovider ;;
    rope) step rope_variants python benchmarks/rope_variants.py ;;  # RoPE's backward quantizer: Triton against Gluon
    grouped_gemm) step grouped_gemm python benchmarks/grouped_gemm.py --backend hopper --iters 20 ;;
    grouped_moe)  # the MoE model's two expert shapes, the warp-specialized kernel's TMA and register epilogues
      step grouped_gemm_moe python benchmarks/grouped_gemm.py --backend hopper --iters 20 \
        --shapes 64x2048,2048,2048 64x2048,1024,2048 --columns "warp-specialized" "ws " ;;
    wgrad_gemm) step wgrad_gemm python benchmarks/wgrad_gemm.py ;;
    dense_gemm) step dense_gemm python benchmarks/dense_gemm.py ;;  # fprop, dgrad, wgrad: cuBLAS against ours
    dense_gemm_graphs) step dense_gemm_graphs python benchmarks/dense_gemm.py --cuda-graphs --iters 20 ;;
    grouped_gemm_graphs) step grouped_gemm_graphs python benchmarks/grouped_gemm.py --backend hopper --iters 20 \
      --cuda-graphs ;;
    launch_cost)  # host time per call of each FP8 piece and small layer: the cublas backend, then the hopper one
      step launch_cost_cublas python benchmarks/fp8_launch_cost.py
      step launch_cost_hopper python benchmarks/fp8_launch_cost.py --backend hopper --cprofile 12 ;;
    launch_cost_ab)  # the same host times, $OLD against this tree interleaved (old, new, new, old: the host's drift
                     # reaches both alike), LC_BACKEND's (default hopper)
      n=0
      for tree in old new new old; do
        n=$((n + 1)); dir=.; [ $tree = old ] && dir=$OLD
        step "launch_cost_${n}_${tree}_${LC_BACKEND:-hopper}" bash -c "cd \"$dir\" && python \
          benchmarks/fp8_launch_cost.py --backend ${LC_BACKEND:-hopper}"
      done ;;
    fp8_linear_threads)  # one layer, backward on autograd's worker thread (torch's default) and on the calling thread
      step fp8_linear_worker_thread python benchmarks/fp8_linear.py --backends cublas
      step fp8_linear_calling_thread python benchmarks/fp8_linear.py --backends cublas --calling-thread ;;
    threads_eager|threads_compiled|threads_moe)  # whole steps, backward on the worker thread, then on the caller's
      case $part in
        threads_eager) flags="--model 1b" ;;
        threads_compiled) flags="training.compile=true --model 1b" ;;
        threads_moe) flags="training.compile=true --model moe" ;;
      esac
      step "${part}_worker_thread" python benchmarks/train_step.py training.backward_on_worker_thread=true $flags \
           --recipes bf16 fp8
      step "${part}_calling_thread" python benchmarks/train_step.py $flags --recipes bf16 fp8 ;;
    wgrad_bf16) step wgrad_bf16 python benchmarks/wgrad_gemm.py --bf16-only ;;
    attention) step attention python benchmarks/attention.py ;;
    tests_rope) step gpu_tests_rope python -m pytest -q -m gpu tests/test_fp8_backends.py tests/test_fp8_gpu.py \
           tests/test_gluon_kernels_gpu.py tests/test_moe_gpu.py \
           tests/test_fp8_qkv.py -k "rope or autotuned or custom_op or fused_projection" -p no:cacheprovider ;;
    tests_attention) step gpu_tests_attention python -m pytest -q -m gpu tests/test_sdpa.py -p no:cacheprovider ;;
    attn_1b|attn_8b|attn_eager|attn_mla)  # whole steps with the attention core by torch's order, then by
                      # `model.attention_backend: auto` (cuDNN first on Hopper), BF16 and FP8 each: the ~1B and the
                      # 8B-layer shape under CUDA graphs, the ~1B eager, the ~1B with MLA compiled
      case $part in
        attn_1b) flags="training.compile=true training.compile_mode=reduce-overhead"; model=1b ;;
        attn_8b) flags="training.compile=true training.compile_mode=reduce-overhead"; model=8b-layers ;;
        attn_eager) flags=""; model=1b ;;
        attn_mla) flags="training.compile=true"; model=mla ;;
      esac
      for backend in torch auto; do
        step "${part}_${backend}" python benchmarks/train_step.py $flags model.attention_backend=$backend \
             --model $model --recipes bf16 fp8
      done ;;
    tests_main_grad) step gpu_tests_main_grad python -m pytest -q -m gpu tests/test_fp8_gpu.py \
           tests/test_moe_gpu.py tests/test_gpu.py \
           -k "main_grad or host_wait or learns or thread or cuda_graph" -p no:cacheprovider ;;
    memory_8b_eager)  # the 8B-layer eager run's peak, FP8-health step included (memory_modes' slowest row alone)
      step memory_8b-layers_eager python benchmarks/train_step.py --model 8b-layers --steps 10 --warmup 6 \
           --log-interval 2 --recipes bf16 fp8 ;;
    memory_8b_ro_fresh|expandable_8b)  # the 8B-layer step under CUDA graphs, each recipe in a fresh process (job BZ's
      # held-memory comparison); expandable_8b: with the caching allocator's expandable segments, which map a pool's
      # pages into one growing address range instead of separate segments (less fragmentation; torch 2.11's support
      # for them in CUDA graphs' private pools is what this measures)
      conf=""; [ "$part" = expandable_8b ] && conf="expandable_segments:True"
      for recipe in fp8 bf16; do
        step "${part}_$recipe" env PYTORCH_CUDA_ALLOC_CONF="$conf" python benchmarks/train_step.py \
          training.compile=true training.compile_mode=reduce-overhead --model 8b-layers --steps 10 --warmup 6 \
          --log-interval 2 --recipes "$recipe"
      done ;;
    old_wgrad_gemm) step old_wgrad_gemm bash -c "cd \"$OLD\" && python benchmarks/wgrad_gemm.py" ;;
    old_grouped_gemm) step old_grouped_gemm bash -c "cd \"$OLD\" && python benchmarks/grouped_gemm.py --backend cublas" ;;
    profile_moe_fp8) step profile_moe_fp8 python benchmarks/train_step.py training.compile=true --model moe \
           --recipes fp8 --profile 3 ;;
    profile_moe_fp8_hopper) step profile_moe_fp8_hopper python benchmarks/train_step.py training.compile=true \
           precision.fp8_backend=hopper --model moe --recipes fp8 --profile 3 ;;
    moe_compiled_hopper) step moe_compiled_hopper python benchmarks/train_step.py training.compile=true \
           precision.fp8_backend=hopper --model moe --recipes bf16 fp8 ;;
    moe_compiled_accum)  # four micro-batches per optimizer step: AdamW over the 3B parameters once per 64k tokens
      for backend in cublas hopper; do
        step "moe_compiled_accum_$backend" python benchmarks/train_step.py training.compile=true \
          precision.fp8_backend=$backend --model moe --global-batch 32 --recipes bf16 fp8
      done ;;
    tests_optim)  # first, which fused-AdamW arithmetic this torch's headers hold (the fused update follows 2.13's)
      step torch_fused_adam_source python -c "import pathlib, torch; src = (pathlib.Path(torch.__file__).parent /
'include/ATen/native/cuda/fused_adam_utils.cuh').read_text(); print(torch.__version__, 'FP32 + FMA moments:',
'std::fma(beta1, exp_avg' in src, '| FP64 scalars:', 'const double& beta1' in src.split('adam_math')[1][:600])"
      step gpu_tests_optim python -m pytest -q -m gpu tests/test_optim.py tests/test_fused_update.py -p no:cacheprovider ;;
    compiled_ro_unfused_update) step ours_compiled_cudagraphs_unfused_update python benchmarks/train_step.py \
           training.compile=true training.compile_mode=reduce-overhead optimizer.fused_update=false --model 1b \
           --recipes bf16 fp8 ;;
    compiled_ro_8b_unfused_update) step ours_compiled_cudagraphs_8b_unfused_update python benchmarks/train_step.py \
           training.compile=true training.compile_mode=reduce-overhead optimizer.fused_update=false \
           --model 8b-layers --recipes bf16 fp8 ;;
    tests_hopper) step gpu_tests_hopper python -m pytest -q -m gpu tests/test_fp8_backends.py -k hopper \
           -p no:cacheprovider ;;
    ncu_kernels)  # Nsight Compute on one launch each of the two kernels performance.md names as what is left (its
                  # counters read on some GPU machines, not under gVisor: the part then says so and costs seconds)
      for target in "_swiglu_backward_cols_kernel python benchmarks/fused_quantize.py" \
                    "Avec128_Bvec128 python benchmarks/wgrad_gemm.py --model 8b-layers --iters 3"; do
        set -- $target
        kernel=$1
        shift
        step "ncu_$kernel" ncu --kernel-name "regex:$kernel" --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
          --section SchedulerStats "$@"
      done ;;
    ncu_producers)  # Nsight Compute on the producers' Gluon kernels at the 8B-layer step's shapes (RoPE's backward,
                    # SwiGLU backward's columns, the row + column quantizer; benchmarks/producer_kernels.py): what
                    # bounds each, its L1 wavefronts, shared ones and bank conflicts (docs/benchmarks.md jobs FA-FC)
      step ncu_producers ncu --kernel-name "regex:gluon|swiglu_backward_cols" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --metrics l1tex__data_pipe_lsu_wavefronts.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum \
        python benchmarks/producer_kernels.py ;;
    ncu_ws)  # Nsight Compute on the warp-specialized kernel's dense fprop and wgrad (into main_grad) at the 8B-layer
             # gate/up shape (what it found: docs/performance.md). The 3rd launch of each process
             # (dense_gemm.py: one for its check, three warm-ups), counters as ncu_kernels'
      for gemm in fprop wgrad; do
        step "ncu_ws_$gemm" ncu --kernel-name "regex:_ws_gemm_kernel" --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
          --section WarpStateStats --section SchedulerStats --section Occupancy --section SourceCounters \
          python benchmarks/dense_gemm.py --shapes 28672,4096 --gemms "$gemm" --columns "ws 256" --iters 3
      done ;;
    ncu_wgrad_forms)  # Nsight Compute (clocks locked) on the warp-specialized kernel at one M x N x K, 28,672 x 4,096 x
                      # 16,384, in both scale forms: the 8B-layer gate/up wgrad (1x128 x 1x128, into main_grad) and
                      # an fprop of the same dimensions (1x128 x 128x128, BF16 out): job CY compared them at
                      # different K; this separates the per-column scales' cost per K step from the shape's
      for form in wgrad fprop; do
        shape="--shapes 28672,4096"; [ "$form" = fprop ] && shape="--tokens 28672 --shapes 4096,16384"
        step "ncu_wgrad_forms_$form" ncu --kernel-name "regex:_ws_gemm_kernel" --launch-skip 2 --launch-count 1 \
          --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
          python benchmarks/dense_gemm.py $shape --gemms "$form" --columns "ws 256" --iters 3
      done ;;
    ncu_l2)  # Nsight Compute: how close the dense fprop at the 8B-layer gate/up shape runs to L2's bandwidth (each K
             # step of a 128 x 256 tile reads 48 KB from L2 for 8.4 MFLOP) and whether a kernel runs in clusters:
             # our interleaved-FFMA kernel, cuBLAS's blockwise FP8 GEMM (the cublas backend) and cuBLAS's BF16 GEMM
      l2="lts__t_bytes.sum.per_second,lts__t_sectors_srcunit_tex_op_read.sum.per_second,\
lts__t_sectors_srcunit_tex_op_read.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,\
l1tex__m_xbar2l1tex_read_bytes.sum.per_second,sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum"
      for column in "ws 256, interleaved FFMA" backend BF16; do
        case $column in
          ws*) kernels="regex:_ws_gemm_kernel"; name=ws ;;
          backend) kernels="regex:nvjet|xmma|cutlass|gemm"; name=cublas_fp8 ;;
          BF16) kernels="regex:nvjet|xmma|cutlass|gemm"; name=cublas_bf16 ;;
        esac
        step "ncu_l2_$name" ncu --kernel-name "$kernels" --launch-skip 2 --launch-count 1 --section LaunchStats \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --metrics "$l2" \
          python benchmarks/dense_gemm.py --shapes 28672,4096 --gemms fprop --columns "$column" --iters 3
      done ;;
    clocks_8b)  # the SM clock, power and clock event reasons sampled every 200 ms while BF16, then FP8, run the
                # 8B-layer step under CUDA graphs: do the GEMMs run slower in the step than alone because the clock drops?
      for recipe in bf16 fp8; do
        SAMPLE_MS=200 sampled_step "$recipe" "steps_8b_$recipe" python benchmarks/train_step.py training.compile=true \
          training.compile_mode=reduce-overhead --model 8b-layers --recipes $recipe
      done
      step clocks_8b python benchmarks/clocks_summary.py bf16="$LOGS/clocks_bf16.csv" fp8="$LOGS/clocks_fp8.csv" ;;
    clocks_gemm)  # the same samples while one GEMM runs back to back (the 8B-layer gate/up shape, 200 calls a
                  # CUDA graph replay): the fprop as BF16's, cuBLAS's blockwise FP8 and ours; the 1x128 x 1x128
                  # wgrad into main_grad as cuBLASLt's and ours. Is each held by the power cap?
      for run in "fprop BF16 bf16" "fprop backend cublas_fp8" "fprop ws ws" "wgrad backend cublaslt_wgrad" \
                 "wgrad ws ws_wgrad"; do
        read -r gemm column label <<< "$run"
        [ "$column" = ws ] && column="ws 256, interleaved FFMA"
        sampled_step "$label" "gemm_$label" python benchmarks/dense_gemm.py --shapes 28672,4096 --gemms "$gemm" \
          --columns "$column" --cuda-graphs --iters 200
      done
      step clocks_gemm python benchmarks/clocks_summary.py bf16="$LOGS/clocks_bf16.csv" \
        cublas_fp8="$LOGS/clocks_cublas_fp8.csv" ws="$LOGS/clocks_ws.csv" \
        cublaslt_wgrad="$LOGS/clocks_cublaslt_wgrad.csv" ws_wgrad="$LOGS/clocks_ws_wgrad.csv" ;;
    deepgemm)  # DeepGEMM (built by install_deepgemm) against ours on the same FP8 operands: the 8B-layer's dense
               # GEMMs (DG_ITERS calls a CUDA graph replay, default 100), the MoE experts' grouped ones, and the
               # 8B-layer gate/up fprop and wgrad run back to back (200 calls a replay) with clocks and power sampled
      install_deepgemm
      # each shape's first call JIT-compiles (seconds): all of them first, in parallel
      for nk in 12288,4096 4096,4096 28672,4096 4096,14336 6144,2048 2048,2048 11264,2048 2048,5632; do
        timeout 300 python benchmarks/dense_gemm.py --shapes $nk --columns "ws 256, interleaved FFMA" DeepGEMM \
          --iters 1 > "$LOGS/deepgemm_warm_$nk.log" 2>&1 &
      done
      for shape in 64x2176,2048,2048 64x2176,1024,2048; do
        timeout 300 python benchmarks/grouped_gemm.py --backend hopper --shapes $shape --gemms fprop dgrad into \
          --columns interleaved deepgemm --iters 1 > "$LOGS/deepgemm_warm_$shape.log" 2>&1 &
      done
      wait
      step deepgemm_dense python benchmarks/dense_gemm.py --model 8b-layers 1b --cuda-graphs \
        --iters "${DG_ITERS:-100}" --columns BF16 backend "ws 256, interleaved FFMA" DeepGEMM
      step deepgemm_grouped python benchmarks/grouped_gemm.py --backend hopper --cuda-graphs --iters 20 \
        --shapes 64x2176,2048,2048 64x2176,1024,2048 --gemms fprop dgrad into --columns interleaved deepgemm
      for run in "fprop ws ws" "fprop DeepGEMM dg" "wgrad backend cublaslt_wgrad" "wgrad DeepGEMM dg_wgrad"; do
        read -r gemm column label <<< "$run"
        [ "$column" = ws ] && column="ws 256, interleaved FFMA"
        sampled_step "$label" "gemm_$label" python benchmarks/dense_gemm.py --shapes 28672,4096 --gemms "$gemm" \
          --columns "$column" --cuda-graphs --iters 200
      done
      step clocks_deepgemm python benchmarks/clocks_summary.py ws="$LOGS/clocks_ws.csv" dg="$LOGS/clocks_dg.csv" \
        cublaslt_wgrad="$LOGS/clocks_cublaslt_wgrad.csv" dg_wgrad="$LOGS/clocks_dg_wgrad.csv"
      mkdir -p "$LOGS/deepgemm_kernels"
      find "$DG_JIT_CACHE_DIR" -name '*.cu' -exec cp --backup=numbered {} "$LOGS/deepgemm_kernels/" \; 2> /dev/null ;;
    deepgemm_steps)  # the 8B-layer step under CUDA graphs: BF16 and FP8 on hopper, then FP8 on the deepgemm
                     # backend (DeepGEMM's dense fprop and dgrad), its kernels JIT-compiled first, in parallel
      install_deepgemm
      for nk in 12288,4096 4096,4096 28672,4096 4096,14336; do
        timeout 300 python benchmarks/dense_gemm.py --shapes $nk --gemms fprop dgrad --columns DeepGEMM --iters 1 \
          > "$LOGS/deepgemm_warm_$nk.log" 2>&1 &
      done
      wait
      step ours_8b_cudagraphs python benchmarks/train_step.py training.compile=true \
        training.compile_mode=reduce-overhead precision.fp8_backend=hopper --model 8b-layers --recipes bf16 fp8
      step deepgemm_8b_cudagraphs python benchmarks/train_step.py training.compile=true \
        training.compile_mode=reduce-overhead precision.fp8_backend=deepgemm --model 8b-layers --recipes fp8
      STEP_TIMEOUT=150 step gpu_tests_deepgemm python -m pytest -q -m gpu tests/test_fp8_backends.py \
        -k "deepgemm and gemm" -p no:cacheprovider ;;
    auto_deepgemm)  # `auto` where DeepGEMM is installed (fifty-first session): the resume test's three cases (hopper,
                    # deepgemm, auto), then the ~1B step, BF16 and FP8 on `auto`; the backend it logged goes to the
                    # summary (`fp8: backend deepgemm (auto)` expected)
      install_deepgemm
      step gpu_tests_resume python -m pytest -q -m gpu tests/test_fp8_gpu.py -k resumes -p no:cacheprovider
      step auto_1b python benchmarks/train_step.py training.compile=true training.compile_mode=reduce-overhead \
        --model 1b --recipes bf16 fp8
      grep -h "fp8: backend\|fp8: auto" "$LOGS/auto_1b.log" | sort -u >> "$OUT/summary.md" ;;
    auto_steps)  # the three steps of issues 18 and 19 on `auto` where DeepGEMM is installed, under CUDA graphs, in one
                 # call (~530 s on an H100 with DeepGEMM's install, jobs HE-HH): the ~1B, the 8B-layer shape and the
                 # MoE model, BF16 and FP8; the backends they logged go to the summary
      install_deepgemm
      for model in 1b 8b-layers moe; do
        step auto_$model python benchmarks/train_step.py training.compile=true training.compile_mode=reduce-overhead \
          --model $model --recipes bf16 fp8
        grep -h "fp8: backend\|fp8: auto" "$LOGS/auto_$model.log" | sort -u >> "$OUT/summary.md"
      done ;;
    moe_auto)  # issue 19's MoE step on `auto` where DeepGEMM is installed: MOE_REPEATS pairs (BF16, FP8) as
               # train_step.py runs it (the router not balanced), then one pair after MOE_WARMUP steps with the
               # balancing bias moving MOE_BIAS_RATE a step (moe_balanced's settings); the logged backends to the summary
      # MOE_OVERRIDES: config overrides for every run of the part (e.g. optimizer.moment_dtype=bf16, as
      # configs/671b_fp8.yaml keeps AdamW's moments), both recipes alike
      install_deepgemm
      read -r -a moe_overrides <<< "${MOE_OVERRIDES:-}"
      for i in $(seq "${MOE_REPEATS:-2}"); do
        step moe_auto_$i python benchmarks/train_step.py training.compile=true training.compile_mode=reduce-overhead \
          "${moe_overrides[@]}" --model moe --recipes bf16 fp8
      done
      if [ "${MOE_BALANCED:-1}" = 1 ]; then
        step moe_auto_balanced python benchmarks/train_step.py "${MOE_BALANCED_STEP[@]}" "${moe_overrides[@]}" \
          --recipes bf16 fp8
      fi
      if [ "${MOE_ACCUM:-0}" = 1 ]; then  # also one pair with four micro-batches per optimizer step (AdamW and
                                          # the gradient norm once per 64k tokens, as in pretraining)
        step moe_auto_accum python benchmarks/train_step.py training.compile=true \
          training.compile_mode=reduce-overhead "${moe_overrides[@]}" --model moe --global-batch 32 --recipes bf16 fp8
      fi
      grep -h "fp8: backend\|fp8: auto" "$LOGS"/moe_auto_*.log | sort -u >> "$OUT/summary.md" ;;
    deterministic_cost)  # what `training.deterministic` costs: each of DET_MODELS (default "1b 8b-layers moe") as
                         # train_step.py runs it under CUDA graphs on `auto` (DeepGEMM installed), plain and then
                         # deterministic, each in its own process (the mode's settings hold for a whole process)
      install_deepgemm
      for model in ${DET_MODELS:-1b 8b-layers moe}; do
        for mode in false true; do
          step "deterministic_${model}_$mode" python benchmarks/train_step.py training.compile=true \
            training.compile_mode=reduce-overhead training.deterministic=$mode --model "$model" --recipes bf16 fp8
        done
      done ;;
    determinism)  # whether a step repeats to the bit: benchmarks/determinism.py (two runs of one seed in one process,
                  # the first step's gradients and every loss compared) on each of REPEAT_MODELS (default 8b-layers)
                  # for REPEAT_STEPS steps (default 6), compiled under CUDA graphs on `auto` with DeepGEMM installed
                  # (the backend the steps of record run), REPEAT_RECIPES (default "bf16 fp8"), in each of
                  # REPEAT_MODES (default "plain deterministic"; a part of the mode, e.g. inductor, runs it alone:
                  # determinism.py --only), each mode in a process of its own; a mode named again is another
                  # draw, its step numbered (determinism_MODEL_MODE_2)
      install_deepgemm
      for model in ${REPEAT_MODELS:-8b-layers}; do
        unset draws; declare -A draws=()
        for mode in ${REPEAT_MODES:-plain deterministic}; do
          case $mode in
            plain) mode_args=() ;;
            deterministic) mode_args=(--deterministic) ;;
            *) mode_args=(--only "$mode") ;;
          esac
          draws[$mode]=$(( ${draws[$mode]:-0} + 1 ))
          draw_name="determinism_${model}_$mode"
          [ "${draws[$mode]}" -gt 1 ] && draw_name+="_${draws[$mode]}"
          step "$draw_name" python benchmarks/determinism.py --model "$model" \
            --steps "${REPEAT_STEPS:-6}" training.compile=true training.compile_mode=reduce-overhead \
            --recipes ${REPEAT_RECIPES:-bf16 fp8} "${mode_args[@]}"
        done
      done
      grep -h "fp8: backend" "$LOGS"/determinism_*.log | sort -u >> "$OUT/summary.md" ;;
    ab_moe_auto)  # $OLD against this tree on `auto` where DeepGEMM is installed: the MoE step as train_step.py runs
                  # it (CUDA graphs, BF16 and FP8 in each run), interleaved (ABBA), AB_REPEATS runs each
      install_deepgemm
      step ab_moe_auto python benchmarks/ab_steps.py --old "$OLD" --repeats "${AB_REPEATS:-1}" \
        --timeout "${AB_RUN_TIMEOUT:-240}" -- --model moe training.compile=true training.compile_mode=reduce-overhead \
        --recipes ${AB_RECIPES:-bf16 fp8} ;;
    ab_moe_balanced)  # ab_moe_auto after the router has balanced (MOE_BALANCED_STEP)
      install_deepgemm
      step ab_moe_balanced python benchmarks/ab_steps.py --old "$OLD" --repeats "${AB_REPEATS:-1}" \
        --timeout "${AB_RUN_TIMEOUT:-300}" -- "${MOE_BALANCED_STEP[@]}" --recipes ${AB_RECIPES:-bf16 fp8} ;;
    recompute_in_graph_memory)  # the ~1B, BF16, every block recomputed inside its compiled backward
                                # (`training.recompute_compiled=in_graph`, compiled without graphs): the allocator's
                                # history of its first 3 steps (pytorch.org/memory_viz) and AOTAutograd's forward and
                                # backward graphs (which tensors the partitioner saves for backward), both in $OUT
      step recompute_in_graph_memory env TORCH_LOGS=aot_graphs python benchmarks/train_step.py training.compile=true \
        training.recompute=full training.recompute_compiled=in_graph logging.memory_snapshot_steps=3 \
        --model 1b --recipes bf16 --warmup 2 --steps 6 --out "$OUT/recompute_in_graph_runs" ;;
    recompute_in_graph_steps)  # the ~1B, every block recomputed inside its compiled backward, compiled without
                               # and with CUDA graphs, BF16 and FP8: tokens/s, peaks and held memory (the test of
                               # the CUDA-graph cases first)
      step tests_recompute_graphs python -m pytest -q -m gpu tests/test_fp8_gpu.py -k "like_eager and recompute" \
        -p no:cacheprovider
      for mode in default reduce-overhead; do
        step "recompute_in_graph_$mode" python benchmarks/train_step.py training.compile=true \
          training.compile_mode=$mode training.recompute=full training.recompute_compiled=in_graph --model 1b \
          --recipes bf16 fp8
      done ;;
    tests_session55)  # the fifty-fifth session's GPU tests: context parallelism's kernels against their twin (eager
                      # and compiled), a profiled run's trace and allocator history, the unfused FP8 QKV + RoPE
                      # path (Qwen's query/key norms and q/k/v bias) under CUDA graphs
      step gpu_tests_session55 python -m pytest -q -m gpu tests/test_context_parallel.py tests/test_gpu.py \
           tests/test_fp8_gpu.py -k "cuda_kernels or profiled or (like_eager and qk_norm)" -p no:cacheprovider ;;
    recompute_layers_steps)  # the ~1B step compiled (default mode) with every block recomputed, with the first 8 of
                             # its 16 recomputed (`training.recompute_layers`), and with none: tokens/s, the peak
                             # against the planner's figure (train_step.py prints both), BF16 and FP8
      for flags in "training.recompute=full" "training.recompute=full training.recompute_layers=8" ""; do
        name=$(echo "${flags:-none}" | tr ' =.' '___')
        step "recompute_$name" python benchmarks/train_step.py training.compile=true $flags --model 1b \
             --recipes bf16 fp8
      done ;;
    qk_norm_steps)  # the ~1B step under CUDA graphs with Qwen3's query/key norms, with Qwen2's q/k/v bias, and with
                    # neither, BF16 and FP8 (each FP8 row with either setting on leaves the QKV projection's RoPE
                    # unfused), then the GPU test of that path under CUDA graphs; on `auto` (DeepGEMM if carried)
      install_deepgemm
      for attention in plain qk_norm qkv_bias; do
        case $attention in
          plain) flags="" ;;
          *) flags="model.attention.$attention=true" ;;
        esac
        step attention_$attention python benchmarks/train_step.py training.compile=true \
             training.compile_mode=reduce-overhead $flags --model 1b --recipes bf16 fp8
      done
      step gpu_tests_qk_norm python -m pytest -q -m gpu tests/test_fp8_gpu.py -k "like_eager and qk_norm" \
           -p no:cacheprovider ;;
    tests_resume)  # a run under CUDA graphs resumed in a new process, on hopper and deepgemm (DeepGEMM built first)
      install_deepgemm
      step gpu_tests_resume python -m pytest -q -m gpu tests/test_fp8_gpu.py -k resumes -p no:cacheprovider ;;
    deepgemm_steps_1b_moe)  # the ~1B step (BF16, FP8 on hopper, FP8 on deepgemm) and the balanced MoE step (FP8 on
                            # hopper and on deepgemm: its attention projections; the experts keep our grouped GEMMs)
      install_deepgemm
      step deepgemm_1b_hopper python benchmarks/train_step.py training.compile=true \
        training.compile_mode=reduce-overhead precision.fp8_backend=hopper --model 1b --recipes bf16 fp8
      step deepgemm_1b python benchmarks/train_step.py training.compile=true training.compile_mode=reduce-overhead \
        precision.fp8_backend=deepgemm --model 1b --recipes fp8
      for run in "hopper bf16 fp8" "deepgemm fp8"; do
        read -r backend recipes <<< "$run"
        step "deepgemm_moe_$backend" python benchmarks/train_step.py "${MOE_BALANCED_STEP[@]}" \
          precision.fp8_backend=$backend --recipes $recipes
      done ;;
    tests_cublaslt) step gpu_tests_cublaslt python -m pytest -q -m gpu tests/test_fp8_gpu.py \
           tests/test_moe_gpu.py tests/test_gpu.py \
           -k "cublaslt or cuda_graphs or compiled_fp8_linear or fused_fp8_mlp or learns or host_wait" \
           -p no:cacheprovider ;;
    tests_ws) step gpu_tests_ws python -m pytest -q -m gpu tests/test_fp8_gpu.py tests/test_moe_gpu.py \
           -k "warp_specialized or grouped or main_grad" -p no:cacheprovider ;;
    tests_dense_ws)  # the hopper backend's dense GEMMs on the warp-specialized kernel: conformance, main_grad, training
      step gpu_tests_dense_ws python -m pytest -q -m gpu tests/test_fp8_backends.py -k hopper -p no:cacheprovider
      step gpu_tests_dense_ws_training python -m pytest -q -m gpu tests/test_fp8_gpu.py \
           -k "cublaslt_adds or hopper_backend_runs_dense or cuda_graphs_add or learns" -p no:cacheprovider ;;
    compiled_fp8) step ours_compiled_fp8 python benchmarks/train_step.py training.compile=true --model 1b --recipes fp8 ;;
    ours) step ours_eager python benchmarks/train_step.py --model 1b --recipes bf16 fp8 ;;
    ref) step reference_compiled python benchmarks/reference_model.py --compile \
           --recipes bf16 torchao-tensorwise torchao-rowwise torchao-blockwise
         ;;
    ref_eager) step reference_eager python benchmarks/reference_model.py --recipes bf16 torchao-blockwise ;;
    ref_moe)  # the MoE yardstick (torchtitan's DeepSeek-V3 MoE in plain PyTorch) at `train_step.py --model moe`'s
              # shape, compiled blocks, BF16 and torchao's rowwise FP8 (linears and experts): set beside moe_auto
      step reference_moe python benchmarks/reference_model.py --compile --layers 8 --experts 64 --top-k 8 \
           --expert-ffn 1024 --shared-experts 1 --first-dense 1 --groups 8 --topk-groups 4 \
           --recipes bf16 torchao-rowwise ;;
    compiled) step ours_compiled python benchmarks/train_step.py training.compile=true --model 1b --recipes bf16 fp8 ;;
    compiled_ro) step ours_compiled_cudagraphs python benchmarks/train_step.py training.compile=true \
           training.compile_mode=reduce-overhead --model 1b --recipes bf16 fp8 ;;
    profile) step profile_eager python benchmarks/train_step.py --model 1b --recipes bf16 fp8 --profile 3
             step profile_compiled python benchmarks/train_step.py training.compile=true --model 1b \
               --recipes fp8 --profile 3 ;;
    moe) step moe_eager python benchmarks/train_step.py --model moe --recipes bf16 fp8 ;;
    moe_compiled) step moe_compiled python benchmarks/train_step.py training.compile=true --model moe --recipes bf16 fp8 ;;
    profile_compiled) step profile_compiled_fp8 python benchmarks/train_step.py training.compile=true --model 1b \
               --recipes fp8 --profile 3 ;;
    # The two-GPU parts say they are skipped on one GPU (torchrun's failure summary left out the reason, and the
    # start of two ranks cost the call its time)
    moe_dp2) gpus_for 2 moe_dp2 && step moe_dp2 torchrun --nproc_per_node=2 benchmarks/train_step.py --model moe \
               --global-batch 16 --recipes bf16 fp8 ;;
    moe_ep2) gpus_for 2 moe_ep2 && step moe_ep2 torchrun --nproc_per_node=2 benchmarks/train_step.py parallel.ep=2 \
               --model moe --global-batch 16 --recipes bf16 fp8 ;;
    dense_2gpu) gpus_for 2 dense_2gpu && step dense_2gpu torchrun --nproc_per_node=2 benchmarks/train_step.py \
               training.compile=true --model 1b --global-batch 16 --recipes bf16 fp8 ;;
    cp_2gpu)  # context parallelism: the ~1B at 32K tokens a sequence on one GPU, then each sequence over two (CP=2),
              # compiled, BF16 and FP8: tokens/s per GPU (the efficiency), peak memory against the plan
      step cp_one_gpu python benchmarks/train_step.py training.compile=true --model 1b-32k --global-batch 4 \
           --recipes bf16 fp8
      gpus_for 2 cp_2gpu && step cp_2gpu torchrun --nproc_per_node=2 benchmarks/train_step.py training.compile=true \
           parallel.cp=2 --model 1b-32k --global-batch 4 --recipes bf16 fp8 ;;
  esac
) done
finish_summary
