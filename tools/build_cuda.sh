#!/usr/bin/env bash
# Builds libprecis_cuda.so with nvcc: build_cuda.sh OUT SRC...
# Called by the //:libprecis_cuda genrule and tools/gpu_check.sh; warnings are errors.
# PRECIS_CUDA_RESOURCE_USAGE=1 adds ptxas's registers/spills per kernel to the
# output (tools/kernel_resources.py reads them).
set -euo pipefail
out=$1; shift
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
cu=(); c=(); lds=""; inc=""
for f in "$@"; do
  case "$f" in
    *.cu) cu+=("$f") ;;
    *.c) c+=("$f") ;;
    *.lds) lds=$f ;;
    */include/precis/precis.h) inc=${f%/precis/precis.h} ;;
  esac
done
csrc=$(dirname "$inc")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
objs=()
for f in "${c[@]}"; do
  o=$tmp/$(basename "$f").o
  gcc -std=c11 -O2 -fPIC -fvisibility=hidden -Wall -Wextra -Werror -I"$inc" -I"$csrc" -c "$f" -o "$o"
  objs+=("$o")
done
gencode=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
         -gencode arch=compute_90,code=compute_90)
# -fmad=false: nvcc would otherwise let ptxas fuse any a*b followed by + or -
# into one FMA (e.g. a dequantized m = q*s into g - m), which the CPU kernels and
# the emulated tests (C11 / -ffp-contract=off) round twice. Where the update
# means an FMA, rules.h writes one (PRECIS_FMA). --threads 0: the targets
# compile in parallel.
cuflags=(-std=c++17 -O3 -fmad=false --threads 0)
if [[ ${PRECIS_CUDA_RESOURCE_USAGE:-0} == 1 ]]; then cuflags+=(--resource-usage --threads 1); fi  # one ptxas at a time: unmixed output
for f in "${cu[@]}"; do
  o=$tmp/$(basename "$f").o
  "$nvcc" "${cuflags[@]}" "${gencode[@]}" --compiler-options=-fPIC,-fvisibility=hidden,-Wall,-Wextra,-Werror \
    -Werror all-warnings -I"$inc" -I"$csrc" -c "$f" -o "$o"
  objs+=("$o")
done
"$nvcc" -shared "${gencode[@]}" "${objs[@]}" -o "$out" \
  -Xlinker --version-script="$lds" -Xlinker -Bsymbolic
