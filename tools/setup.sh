#!/usr/bin/env bash
# Installs the Debian packages precis needs, only those missing (run as root on a
# fresh Debian 12). CUDA 13 is expected at /usr/local/cuda (it is on every machine
# of this project); without nvcc the CUDA library is not built.
set -euo pipefail
packages=(bazel-bootstrap build-essential libgtest-dev python3-torch python3-pytest
          python3-numpy python3-matplotlib python3-yaml
          libopenblas0-pthread  # a fast BLAS for torch's fp32 matmuls
          python-is-python3)    # Bazel 4's py_test stub runs "/usr/bin/env python"
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
