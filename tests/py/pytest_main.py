"""Runs one pytest file under `bazel test`, writing JUnit XML where Bazel wants it."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    args = ["-q", "-p", "no:cacheprovider", *sys.argv[1:]]
    # A test file in a folder below this one (ops/, optimizers/, ...): pytest's rootdir is
    # then that folder (the runfiles hold no pyproject.toml), and pytest loads no
    # conftest.py above its rootdir unless told where to stop looking: here.
    if any(os.path.abspath(a).startswith(HERE + os.sep) for a in sys.argv[1:]):
        args.insert(0, f"--confcutdir={HERE}")
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    sys.exit(pytest.main(args))
