#!/usr/bin/env bash
# precis against another torch than .venv's 2.13 (supported: 2.10 and newer):
#
#   tools/other_torch.sh 2.10.0 [pytest arguments, default tests/py]
#
# Makes build/torch-VERSION/ (a virtual environment with that torch from PyPI: a
# CUDA build, about 4 GB with its NVIDIA wheels, on Python 3.11), compiles the
# stable-ABI declaration check (torch_ext/csrc/torch_stable_abi_check.cc) against
# its headers, builds the libraries without Bazel (tools/gpu_check.sh build) and
# runs the Python tests with that torch. Needs gcc and nvcc (/usr/local/cuda), as
# .ci/run does. Not part of .ci/run: the download is large.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: tools/other_torch.sh TORCH_VERSION [pytest arguments]}
shift
env=build/torch-$version
if [[ ! -f $env/installed ]]; then  # the stamp: an interrupted install is redone
  python3.11 -m venv "$env" 2>/dev/null || python3 -m venv "$env"
  "$env/bin/pip" install -q "torch==$version" numpy pytest pyyaml expecttest
  touch "$env/installed"
fi
"$env/bin/python" -c "import torch; print('torch', torch.__version__)"
include=$("$env/bin/python" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
g++ -std=c++17 -fsyntax-only -I"$include" -Itorch_ext/csrc torch_ext/csrc/torch_stable_abi_check.cc
echo "stable-ABI declarations match torch $version's headers"
tools/gpu_check.sh build >/dev/null
lib=$(pwd)/build/gpu
PRECIS_LIBRARY=$lib/libprecis.so PRECIS_TORCH_LIBRARY=$lib/libprecis_torch.so \
  PRECIS_CUDA_LIBRARY=$lib/libprecis_cuda.so PYTHONPATH=$(pwd)/torch_ext:$(pwd)/tests/py \
  "$env/bin/python" -m pytest -q -p no:cacheprovider "${@:-tests/py}"
