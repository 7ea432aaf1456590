"""pytest setup: make `import precis` work from a checkout (repo/torch_ext on sys.path).

Under Bazel the py_test's imports do this; from a shell, run
.venv/bin/python -m pytest tests/py after `bazel build //...` (or with
PRECIS_LIBRARY pointing at a libprecis.so). With PRECIS_TEST_INSTALLED=1
(tools/wheel_test.sh) the tests run against the installed package instead.
"""
import os
import sys

_TORCH_EXT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                          "torch_ext"))
if os.environ.get("PRECIS_TEST_INSTALLED") == "1":
    import precis  # noqa: E402  (before any test module: all of them share this copy)
    if os.path.abspath(precis.__file__).startswith(_TORCH_EXT + os.sep):
        raise RuntimeError(f"PRECIS_TEST_INSTALLED=1 but precis comes from the checkout "
                           f"({precis.__file__}), not from an installed wheel")
elif os.path.isdir(_TORCH_EXT) and _TORCH_EXT not in map(os.path.abspath, sys.path):
    sys.path.insert(0, _TORCH_EXT)
