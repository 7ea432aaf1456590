#!/usr/bin/env bash
# The demo: installs what is missing, builds, and runs examples/train_demo.py
# (arguments are passed through; try --help). Without --steps its trainings fit a
# 4-minute budget on the CPU at hand (--budget); --steps 300 asks for the long run.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel build //:libprecis.so //:libprecis_torch.so //:libprecis_cuda //examples/...
exec .venv/bin/python examples/train_demo.py "$@"
