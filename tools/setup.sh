#!/usr/bin/env bash
# Installs what precis needs, only what is missing (run as root on a fresh
# Debian 12): the Debian packages of the build, and the virtual environment
# .venv/ at the repository root with pinned PyPI packages (torch 2.13.0, CPU
# build). Bazel's Python, the tests, the demo and the benches use .venv/bin/python.
# The GPU library users load by default for now, libprecis_cuda.so, is built by CUDA 13's
# nvcc at /usr/local/cuda (without it, it is not built); libprecis_cuda12.so, which loads on
# every driver from R530 (CUDA 12.1) on, is built from the pinned PyPI packages below
# (NVRTC and ptxas 12.9: tools/build_cuda12.py), linked at .venv/cuda12.
#   tools/setup.sh --bench   also installs the optional packages of the benchmarks,
#                            pinned in tools/bench_requirements.txt (torchao, DeepSpeed)
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(bazel-bootstrap build-essential libgtest-dev
          python-is-python3     # Bazel 4's py_test stub runs "/usr/bin/env python"
          clang libclang-rt-dev   # tools/fuzz.sh: libFuzzer and the sanitizer runtimes
          gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user)  # tools/cross_test.sh
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "precis setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Pinned: an unpinned torch would pull a multi-GB CUDA build.
requirements=(torch==2.13.0 numpy==2.4.6 pytest==9.2.0 matplotlib==3.11.2 pyyaml==6.0.3
              expecttest==0.3.0  # expecttest: torch.testing._internal imports it
              # cuobjdump and nvdisasm, which tools/sass_budget.py (tests/py/tools/test_sass_budget.py)
              # reads the CUDA kernels' SASS with: CUDA 13's, binaries in nvidia/cu13/bin
              nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86
              # libprecis_cuda12.so's toolchain (tools/build_cuda12.py): NVRTC compiles the
              # kernels, ptxas checks their PTX
              nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-nvcc-cu12==12.9.86)
python=${PRECIS_BOOTSTRAP_PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "precis setup: creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
if ! .venv/bin/python - "${requirements[@]}" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
for req in sys.argv[1:]:
    name, want = req.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if have.split("+")[0] != want:
        sys.exit(1)
PY
then
  echo "precis setup: pip install ${requirements[*]}"
  .venv/bin/python -m pip install -q --disable-pip-version-check "${requirements[@]}"
fi
# A fixed path to the installed torch for Bazel's @libtorch repository (headers
# and libraries of the C++ tests), whatever the Python version in the path.
torch_dir=$(.venv/bin/python -c 'import os, torch; print(os.path.dirname(torch.__file__))')
ln -sfn "$torch_dir" .venv/torch
# And to the CUDA 12 toolchain's packages, for Bazel's @cuda12 repository.
ln -sfn "$(dirname "$torch_dir")/nvidia" .venv/cuda12

if [ "${1:-}" = "--bench" ]; then
  # --no-deps: the pins of bench_requirements.txt must never pull another torch.
  echo "precis setup: pip install -r tools/bench_requirements.txt (--no-deps)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    -r tools/bench_requirements.txt
fi
