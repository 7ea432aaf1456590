#!/usr/bin/env bash
# The one wheel against another torch than .venv's 2.13 (supported: 2.10 and newer):
#
#   tools/other_torch.sh 2.10.0 [pytest arguments, default tests/py tests/wheel]
#
# Makes build/torch-VERSION/ (a virtual environment with that torch from PyPI: a
# CUDA build, about 4 GB with its NVIDIA wheels, on Python 3.11), installs the wheel
# (built as `pip install .` builds it, or $PRECIS_WHEEL) -- the same file for every
# torch, nothing rebuilt -- and runs the Python tests from outside the repository
# against the installed package (tools/wheel_test.sh); then checks the glue's
# stable-ABI declarations (torch_ext/csrc/torch_stable_abi_check.cc) against that
# torch's headers with g++. Not part of .ci/run: the download is large.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: tools/other_torch.sh TORCH_VERSION [pytest arguments]}
shift
env=build/torch-$version
status=0
PRECIS_BOOTSTRAP_PYTHON=${PRECIS_BOOTSTRAP_PYTHON:-$(command -v python3.11 || echo python3)} \
  tools/wheel_test.sh "$env" "$version" "$env/junit" "$@" || status=1
include=$("$env/bin/python" -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
g++ -std=c++17 -fsyntax-only -I"$include" -Itorch_ext/csrc torch_ext/csrc/torch_stable_abi_check.cc
echo "stable-ABI declarations match torch $version's headers"
exit $status
