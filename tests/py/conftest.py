"""pytest setup: make `import precis` work from a checkout (repo/torch_ext on sys.path).

Under Bazel the py_test's imports do this; from a shell, run
.venv/bin/python -m pytest tests/py after `bazel build //...` (or with
PRECIS_LIBRARY pointing at a libprecis.so). With PRECIS_TEST_INSTALLED=1
(tools/wheel_test.sh) the tests run against the installed package instead.
"""
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH_EXT = os.path.abspath(os.path.join(_HERE, "..", "..", "torch_ext"))
# The tests are in folders below this one (ops/, optimizers/, distributed/, tools/); the
# helpers they import (ddp_worker, c_abi, adam_reference, state_snapshot) are here.
if _HERE not in map(os.path.abspath, sys.path):
    sys.path.insert(0, _HERE)
if os.environ.get("PRECIS_TEST_INSTALLED") == "1":
    import precis  # noqa: E402  (before any test module: all of them share this copy)
    if os.path.abspath(precis.__file__).startswith(_TORCH_EXT + os.sep):
        raise RuntimeError(f"PRECIS_TEST_INSTALLED=1 but precis comes from the checkout "
                           f"({precis.__file__}), not from an installed wheel")
elif os.path.isdir(_TORCH_EXT) and _TORCH_EXT not in map(os.path.abspath, sys.path):
    sys.path.insert(0, _TORCH_EXT)


# The `cuda` marker: a test (or a parameter, e.g. device="cuda") that needs a CUDA
# device. Skipped without one; tools/gpu_check.sh cuda-tests runs exactly these
# (pytest -m cuda), and tests/py/ops/test_cuda_selection.py checks what that selects.
CUDA_SKIP_REASON = "needs a CUDA device (torch.cuda.is_available() is False)"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one); "
                                       "tools/gpu_check.sh cuda-tests selects these with -m cuda")


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch  # only here: collecting a file must not need torch before its own imports

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
