#!/usr/bin/env bash
# Builds libprecis_cuda.so with nvcc: build_cuda.sh OUT SRC...
# Called by the //:libprecis_cuda genrule; warnings are errors.
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
for f in "${cu[@]}"; do
  o=$tmp/$(basename "$f").o
  "$nvcc" -std=c++17 -O3 "${gencode[@]}" --compiler-options=-fPIC,-fvisibility=hidden,-Wall,-Wextra,-Werror \
    -Werror all-warnings -I"$inc" -I"$csrc" -c "$f" -o "$o"
  objs+=("$o")
done
"$nvcc" -shared "${gencode[@]}" "${objs[@]}" -o "$out" \
  -Xlinker --version-script="$lds" -Xlinker -Bsymbolic
