#!/usr/bin/env bash
# The GPU checks of precis on a machine with a CUDA GPU, nvcc, gcc, python3 with
# torch and pytest, and no Bazel (e.g. the lent H100):
#
#   tools/gpu_check.sh build      libprecis.so + libprecis_torch.so (gcc) and
#                                 libprecis_cuda.so (nvcc), side by side in build/gpu
#   tools/gpu_check.sh test       tools/fp8_cuda_check.cu, then every Python test (CUDA
#                                 ones included), JUnit XML
#   tools/gpu_check.sh sanitize   compute-sanitizer memcheck + racecheck over the CUDA tests
#   tools/gpu_check.sh bench      bench/adam_cuda.py (10M, 100M, 1B params)
#   tools/gpu_check.sh all        all four, in that order
#
# Python is $PYTHON, else python3 (there: /opt/torch/.venv/bin/python3, torch 2.11).
# That image lacks expecttest (torch.testing._internal, which tests/py/test_layout.py
# uses, imports it): `test` installs wheels found in .whl/ (pip download expecttest
# here, carry .whl) into build/gpu/site first.
# Logs and XML go to $OUT (the device tool's result folder) or build/gpu/out.
# Each step fits in the device tool's 10 minutes; 'all' may not: run steps one
# by one there (build is fast, and later steps rebuild when the build is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=$root/build/gpu
out=${OUT:-$build/out}
mkdir -p "$build" "$out"
# The glue (libprecis_torch.so) finds libprecis.so (DT_NEEDED, rpath $ORIGIN) and
# libprecis_cuda.so beside itself; the variables say the same to the package.
export PRECIS_LIBRARY=$build/libprecis.so PRECIS_TORCH_LIBRARY=$build/libprecis_torch.so
export PRECIS_CUDA_LIBRARY=$build/libprecis_cuda.so
export PYTHONPATH=$root/torch_ext${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}

# The flags of //:libprecis.so and //:libprecis_torch.so (C_COPTS, copts and
# linkopts in BUILD) and of the //:libprecis_cuda genrule (tools/build_cuda.sh):
# keep them in step.
C_COPTS=(-std=c11 -O3 -fopenmp -fvisibility=hidden -Wall -Wextra -Werror -pedantic)

build_libs() {
  echo "== build ($(gcc --version | head -1); $("$nvcc" --version | tail -1))"
  local obj=$build/obj f o objs=()
  rm -rf "$obj" && mkdir -p "$obj/core" "$obj/torch" || return 1
  # libprecis.so; its soname is what the glue's DT_NEEDED names.
  for f in csrc/*.c; do
    o=$obj/core/$(basename "$f" .c).o
    gcc "${C_COPTS[@]}" -fPIC -Icsrc/include -Icsrc -c "$f" -o "$o" || return 1
    objs+=("$o")
  done
  gcc -shared -fopenmp "${objs[@]}" -o "$PRECIS_LIBRARY" -Wl,--version-script=csrc/exports.lds \
    -Wl,-Bsymbolic -Wl,-soname,libprecis.so -lm || return 1
  # libprecis_torch.so: no libtorch at build time (resolved with dlsym at load).
  objs=()
  for f in torch_ext/csrc/*.c; do
    o=$obj/torch/$(basename "$f" .c).o
    gcc "${C_COPTS[@]}" -fexceptions -pthread -fPIC -Icsrc/include -c "$f" -o "$o" || return 1
    objs+=("$o")
  done
  gcc -shared "${objs[@]}" "$PRECIS_LIBRARY" -o "$PRECIS_TORCH_LIBRARY" \
    -Wl,--version-script=torch_ext/csrc/exports.lds -Wl,-rpath,'$ORIGIN' -ldl -pthread || return 1
  NVCC=$nvcc tools/build_cuda.sh "$PRECIS_CUDA_LIBRARY" cuda/*.cu csrc/include/precis/precis.h \
    csrc/errors.c csrc/dtype.c csrc/exports.lds || return 1
  ls -l "$PRECIS_LIBRARY" "$PRECIS_TORCH_LIBRARY" "$PRECIS_CUDA_LIBRARY"
}

ensure_built() {
  [[ -f $PRECIS_LIBRARY && -f $PRECIS_TORCH_LIBRARY && -f $PRECIS_CUDA_LIBRARY ]] || build_libs
}

run_tests() {
  ensure_built || return 1
  if ! "$py" -c "import expecttest" 2>/dev/null; then
    compgen -G ".whl/*.whl" >/dev/null || { echo "expecttest is missing: carry its wheel in .whl/" >&2; return 1; }
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$build/site" .whl/*.whl || return 1
    export PYTHONPATH=$PYTHONPATH:$build/site
  fi
  nvidia-smi -L
  # The GPU's fp8 conversions against the CPU's, for every input.
  local rc=0
  { "$nvcc" -std=c++17 -O3 -arch=sm_90 -Icsrc/include -Icsrc tools/fp8_cuda_check.cu \
      -o "$build/fp8_cuda_check" && "$build/fp8_cuda_check"; } 2>&1 | tee "$out/fp8_cuda_check.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
  "$py" -c "import sys, torch; print(sys.executable, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
  "$py" -m pytest -q -rs -p no:cacheprovider tests/py --junitxml="$out/pytest.xml" \
    2>&1 | tee "$out/test.log"
  [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
  return $rc
}

sanitize() {
  ensure_built || return 1
  local rc=0 tool filter
  # The 2^31-element test takes minutes under the sanitizer; it runs in `test`.
  # memcheck takes about 40 s over every CUDA test on the H100; racecheck takes over
  # 10 minutes there, so it runs the tests of the kernels that share memory or
  # synchronize a block (count_nonfinite, check_finite, fp8 block scales): ~1 minute.
  for tool in memcheck racecheck; do
    filter="cuda and not over_2_31 and not compile"
    [[ $tool == racecheck ]] && filter+=" and (count or finite or fp8 or scale or nonfinite)"
    echo "== compute-sanitizer --tool $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 99 --target-processes all \
      "$py" -m pytest -q -x -p no:cacheprovider tests/py/test_cuda_adam.py \
      tests/py/test_accumulate.py tests/py/test_ddp_bucket_ops.py \
      -k "$filter" 2>&1 | tee "$out/sanitize_$tool.log"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || rc=1
  done
  return $rc
}

bench() {
  ensure_built || return 1
  "$py" bench/adam_cuda.py "$@" 2>&1 | tee "$out/bench_adam_cuda.txt"
}

case "${1:-all}" in
  build) build_libs ;;
  test) run_tests ;;
  sanitize) sanitize ;;
  bench) shift; bench "$@" ;;
  all) build_libs && run_tests; sanitize; bench ;;
  *) echo "usage: $0 build|test|sanitize|bench [bench args]|all" >&2; exit 2 ;;
esac
