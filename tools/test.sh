#!/usr/bin/env bash
# Every test: GoogleTest and pytest through Bazel, then the Python tests against the
# installed wheel (tools/wheel_test.sh), then the C tests again under
# AddressSanitizer + UndefinedBehaviorSanitizer, then built for aarch64 and run
# under qemu-user (tools/cross_test.sh), then each libFuzzer harness of
# fuzz/ for a short bounded time (tools/fuzz.sh; one test case per harness).
# Ends with "N passed, M failed".
set -uo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh || exit 1

counts=$(mktemp)
trap 'rm -f "$counts"' EXIT
status=0

bazel test --keep_going //... || status=1
.venv/bin/python tools/count_tests.py bazel-testlogs >>"$counts" || status=1

# The wheel as a user installs it: into a fresh virtual environment (torch 2.13.0 from
# disk), tested from outside the repository, so a file missing from the wheel fails here.
rm -rf build/wheel-venv build/wheel-junit
tools/wheel_test.sh build/wheel-venv 2.13.0 build/wheel-junit \
  tests/py/optimizers/test_optim.py tests/py/optimizers/test_checkpoint.py \
  tests/py/optimizers/test_compile.py tests/py/optimizers/test_loader.py tests/wheel \
  || status=1
.venv/bin/python tools/count_tests.py build/wheel-junit --label installed-wheel >>"$counts" \
  || status=1

c_tests=$(bazel query 'kind(cc_test, //tests/...)' 2>/dev/null)
bazel test --config=asan --keep_going $c_tests || status=1
.venv/bin/python tools/count_tests.py bazel-testlogs --label asan >>"$counts" || status=1
# The asan run pointed bazel-bin at its own tree (k8-dbg): point it back at the normal
# build (cached, nothing recompiles), which benchmarks and examples load afterwards.
bazel build //:libprecis.so //:libprecis_torch.so >/dev/null 2>&1 || status=1

# The C core and its tests built for aarch64, run under qemu-user (neon and sve paths).
rm -rf .cross/junit
tools/cross_test.sh aarch64 --junit .cross/junit || status=1
.venv/bin/python tools/count_tests.py .cross/junit --label aarch64 >>"$counts" || status=1

# ptxas's registers and spills of every CUDA kernel (no spill in the specialized ones):
# what a GPU run would show first as a slow kernel.
rm -rf .kernel_resources
.venv/bin/python tools/kernel_resources.py --junit .kernel_resources/junit || status=1
.venv/bin/python tools/count_tests.py .kernel_resources/junit --label ptxas >>"$counts" || status=1
# ... and of libprecis_cuda12.so's, for each of its six architectures (NVRTC's ptxas).
.venv/bin/python tools/kernel_resources.py --cuda12 --junit .kernel_resources/junit12 || status=1
.venv/bin/python tools/count_tests.py .kernel_resources/junit12 --label ptxas-cuda12 >>"$counts" \
  || status=1

rm -rf .fuzz/junit
tools/fuzz.sh --time 20 --junit .fuzz/junit || status=1
.venv/bin/python tools/count_tests.py .fuzz/junit --label fuzz >>"$counts" || status=1

.venv/bin/python tools/count_tests.py --sum "$counts" || status=1
exit $status
