#!/usr/bin/env bash
# tools/cross_test.sh aarch64 [--junit DIR]
#
# Builds the C core (csrc/) and the C tests of tests/c/ for aarch64 with Debian's
# cross compiler, and runs the tests under qemu-user: every kernel path this
# "CPU" has (scalar, neon, sve) against the double reference and against each
# other, and the golden digests of test_adam.cc (AdamGolden), which x86's scalar
# path gives too: the same bits on both architectures. Every test runs on an
# SVE CPU with 128-bit vectors (Grace's width, where neon is the default path);
# test_adam runs again with 256-bit vectors (sve the default), the tests of the
# paths with 512-bit ones (the sve loops are vector-length-agnostic: each length
# ends its loops differently), and the tests that pick a path on a CPU without
# SVE (neon is then the best path and sve is refused). Speed under qemu means
# nothing; only bits are checked.
#
# Needs gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu, qemu-user and libgtest-dev
# (GoogleTest's sources, built here for the target once, into .cross/).
# --junit DIR: one JUnit XML per test binary (tools/count_tests.py reads them).
# The slowest tests run natively only (see $slow below).
set -euo pipefail
cd "$(dirname "$0")/.."

arch=${1:-}
if [ "$arch" != aarch64 ]; then
  echo "usage: tools/cross_test.sh aarch64 [--junit DIR]" >&2
  exit 2
fi
shift
junit=""
if [ "${1:-}" = --junit ]; then
  junit=${2:?--junit needs a directory}
fi

triple=aarch64-linux-gnu
CC=$triple-gcc
CXX=$triple-g++
for tool in "$CC" "$CXX" qemu-aarch64; do
  command -v "$tool" >/dev/null || { echo "cross_test: $tool is missing (tools/setup.sh)" >&2; exit 2; }
done
gtest_src=/usr/src/googletest/googletest
out=.cross/$arch
mkdir -p "$out/obj" "$out/bin"

# The core's flags of BUILD (C_COPTS, -fno-math-errno).
cflags=(-std=c11 -O3 -fopenmp -fvisibility=hidden -Wall -Wextra -Werror -pedantic -fno-math-errno
        -Icsrc -Icsrc/include)
# -ffp-contract=off: G++ contracts a*b+c into FMAs by default, which aarch64 has
# and x86-64's baseline has not; the tests' own arithmetic (inputs, references)
# must round as on x86, as the core's (C11: never contracted) does.
cxxflags=(-std=c++17 -O2 -ffp-contract=off -fopenmp -I. -Icsrc -Icsrc/include
          -I"$gtest_src/include")

if [ ! -f "$out/libgtest_main.a" ]; then
  echo "cross_test: building GoogleTest for $arch"
  "$CXX" -std=c++17 -O2 -I"$gtest_src/include" -I"$gtest_src" -c "$gtest_src/src/gtest-all.cc" \
    -o "$out/obj/gtest-all.o"
  "$CXX" -std=c++17 -O2 -I"$gtest_src/include" -c "$gtest_src/src/gtest_main.cc" \
    -o "$out/obj/gtest_main.o"
  ar rcs "$out/libgtest_main.a" "$out/obj/gtest-all.o" "$out/obj/gtest_main.o"
fi

echo "cross_test: building the core for $arch"
# One compiler per core; each job waited for by its pid, so that a failed
# compile stops here instead of leaving an older object in the archive.
core_objs=()
pids=()
for src in csrc/*.c; do
  obj="$out/obj/$(basename "$src" .c).o"
  if [ ${#pids[@]} -ge "$(nproc)" ]; then
    wait "${pids[0]}"
    pids=("${pids[@]:1}")
  fi
  rm -f "$obj"
  "$CC" "${cflags[@]}" -c "$src" -o "$obj" &
  pids+=($!)
  core_objs+=("$obj")
done
for pid in "${pids[@]}"; do wait "$pid"; done
rm -f "$out/libprecis_core.a"
ar rcs "$out/libprecis_core.a" "${core_objs[@]}"

# qemu-user's CPU models: max has SVE, its vector length in bytes set by
# sve-default-vector-length; neoverse-n1 has none. PRECIS_TEST_PATHS: the paths
# each must run, PRECIS_TEST_DEFAULT the one it takes by default (neon with
# 128-bit SVE) (Adam.RunnablePathsAreTheCpusOwn), so that a model without SVE
# cannot pass for one with it.
qemu=(qemu-aarch64 -L /usr/$triple)
sve128=(-cpu max,sve-default-vector-length=16)
with_sve=scalar,neon,sve
# Left to the native runs, to keep this to a few minutes (qemu runs ~20x slower):
# the exhaustive 2^32-input conversion checks, the large-tensor runs, and the
# double reference per dtype combination (AdamGolden checks here that every
# combination gives the bits of x86, where those run).
slow='*EveryInput*:Adam.ReadmePoliciesAgreeOnEveryPathAtLargeOddSizes:Adam.LargeFp32AndScaledTensors'
slow+=':AllDtypes/AdamCombo.*:Rules.LargeTensorMatchesDoubleReference:Rules.SimdPathsAgreeAtLargeOddSizes'
# The tests of the paths (test_adam.cc) that pick them: run again on the other
# CPU models; those that compare them: at the other vector lengths.
picks='Adam.RunnablePathsAreTheCpusOwn:Adam.CpuIsaEnvironmentVariableForcesAnyRunnablePath'
paths="$picks:Adam.SimdPathsAgreeBitForBit:*EveryPath*:*EverySimdPath*"

failed=0
# run_test NAME LABEL FILTER PATHS DEFAULT QEMU_ARGS...: runs test binary NAME
# (its log and JUnit XML under LABEL) with the gtest filter on qemu's CPU of
# QEMU_ARGS, which runs PATHS and takes DEFAULT.
run_test() {
  local name=$1 label=$2 filter=$3 want=$4 default=$5
  shift 5
  local args=(--gtest_filter="$filter")
  if [ -n "$junit" ]; then  # DIR/<label>/test.xml, as bazel-testlogs lays them out
    mkdir -p "$junit/$label"
    args+=(--gtest_output="xml:$junit/$label/test.xml")
  fi
  echo "cross_test: $label ($*)"
  if ! PRECIS_TEST_PATHS=$want PRECIS_TEST_DEFAULT=$default OMP_NUM_THREADS=2 "${qemu[@]}" "$@" "$out/bin/$name" "${args[@]}" \
      >"$out/$label.log" 2>&1; then
    tail -40 "$out/$label.log"
    failed=1
  fi
  grep -E "^runnable paths: |^\[  (PASSED|FAILED|SKIPPED) " "$out/$label.log" || true
}

for src in tests/c/test_*.cc; do
  name=$(basename "$src" .cc)
  "$CXX" "${cxxflags[@]}" "$src" -o "$out/bin/$name" -Wl,--whole-archive "$out/libprecis_core.a" \
    -Wl,--no-whole-archive "$out/libgtest_main.a" -lpthread -lm
  run_test "$name" "$arch-$name" "-$slow" "$with_sve" neon "${sve128[@]}"
done
# 256-bit vectors: all of test_adam, on sve as its default path; 512-bit: the paths.
run_test test_adam "$arch-sve256-test_adam" "-$slow" "$with_sve" sve \
  -cpu max,sve-default-vector-length=32
run_test test_adam "$arch-sve512-test_adam" "$paths-$slow" "$with_sve" sve \
  -cpu max,sve-default-vector-length=64
run_test test_adam "$arch-nosve-test_adam" "$picks" scalar,neon neon -cpu neoverse-n1
exit $failed
