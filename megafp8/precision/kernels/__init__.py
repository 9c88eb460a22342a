"""GPU kernels of the FP8 path (and one of the BF16 experts'), imported only on CUDA, by the CUDA backends and the
BF16 experts' weight-gradient add (CPU-only installs never need Triton).

- `tiles`: the building blocks every quantizing kernel shares (tile scales, the FP8 cast, a tile quantized along
  its rows and its columns and stored in the GEMMs' layouts).
- `quantize`: standalone quantizers (activations and gradients along rows, or rows and columns in one pass;
  weights in 128x128 blocks with their transpose). They give the reference's bytes and scales exactly.
- `producers`: RMSNorm, SwiGLU and SwiGLU's backward, each quantizing its own FP32 result (their pure-torch twins
  are `megafp8.precision.producers`).
- `gemm`: our blockwise-scaled GEMMs, dense and grouped by expert (`ws_gemm`: the warp-specialized Gluon one).
- `cublaslt`: cuBLASLt's blockwise-scaled GEMM called directly (ctypes), adding its product into an FP32 tensor.
- `swiglu_cols_gluon`, `gluon_tiles`: SwiGLU backward's column outputs in Gluon, what SM90 runs (and its row
  outputs beside them in one launch).
- `limits`: what the host checks before a launch (tensors the kernels' int32 offsets can address).
- `health`: the FP8 health monitor's statistics of a tensor in one pass (its pure-torch twin is
  `megafp8.precision.health.chunk_sums`).
- `experts_add`: the BF16 experts' weight gradient added into FP32 `main_grad` for the experts with rows only (not
  an FP8 kernel: the BF16 grouped path calls it; its twin is the whole add).
"""
