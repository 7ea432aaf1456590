#!/usr/bin/env bash
# The demo: installs what is missing, builds, and runs examples/train_demo.py
# (arguments are passed through; try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build //:libprecis.so //:libprecis_torch.so //:libprecis_cuda //examples/...
exec .venv/bin/python examples/train_demo.py "$@"
