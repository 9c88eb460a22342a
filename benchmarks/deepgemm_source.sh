#!/usr/bin/env bash
# Make .dg/DeepGEMM, the DeepGEMM source that benchmarks/gpu_lib.sh's install_deepgemm builds on the GPU machine
# (which has no network), from local clones of its three repositories, at the commits measured in docs/benchmarks.md
# (jobs GS-GZ): DeepGEMM 2.6.1 and the cutlass and fmt commits its submodules name. Only what the build reads is
# taken (29 MB); .dg is listed in .git/info/exclude, so git ignores it, and a GPU call carries it (`carry: [".dg"]`).
# Run it from this repository (it writes into the work tree it is run in). From the `fetch` tool's snapshots, cutlass's
# archive prints "invalid object ... media/images/..." for a blob the snapshot lacks outside include/: harmless.
#   bash benchmarks/deepgemm_source.sh DEEPGEMM_CLONE CUTLASS_CLONE FMT_CLONE
set -euo pipefail
if [ $# -ne 3 ]; then
  echo "usage: $0 DEEPGEMM_CLONE CUTLASS_CLONE FMT_CLONE (git clones of deepseek-ai/DeepGEMM, NVIDIA/cutlass," \
    "fmtlib/fmt)" >&2
  exit 2
fi
DEEPGEMM=${DEEPGEMM_COMMIT:-54e2261} CUTLASS=${CUTLASS_COMMIT:-f3fde58} FMT=${FMT_COMMIT:-553ec11}
root=$(git rev-parse --show-toplevel)
dest="$root/.dg/DeepGEMM"
rm -rf "$dest"
mkdir -p "$dest/third-party/cutlass" "$dest/third-party/fmt"
grep -qx '/.dg/' "$root/.git/info/exclude" 2> /dev/null || echo /.dg/ >> "$root/.git/info/exclude"
git -C "$1" archive "$DEEPGEMM" csrc deep_gemm setup.py scripts third-party/tilelang_ops CMakeLists.txt LICENSE \
  | tar -x -C "$dest"
git -C "$2" archive "$CUTLASS" include LICENSE.txt | tar -x -C "$dest/third-party/cutlass"
git -C "$3" archive "$FMT" include LICENSE | tar -x -C "$dest/third-party/fmt"
echo "$dest: $(du -sh "$dest" | cut -f1), DeepGEMM $DEEPGEMM, cutlass $CUTLASS, fmt $FMT"
