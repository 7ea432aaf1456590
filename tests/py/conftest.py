"""pytest setup: make `import precis` work from a checkout (repo/torch_ext on sys.path).

Under Bazel the py_test's imports do this; from a shell, run
.venv/bin/python -m pytest tests/py after `bazel build //...` (or with
PRECIS_LIBRARY pointing at a libprecis.so).
"""
import os
import sys

_TORCH_EXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "torch_ext")
if os.path.isdir(_TORCH_EXT) and os.path.abspath(_TORCH_EXT) not in map(os.path.abspath, sys.path):
    sys.path.insert(0, os.path.abspath(_TORCH_EXT))
