"""Runs one pytest file under `bazel test`, writing JUnit XML where Bazel wants it."""
import os
import sys

import pytest

if __name__ == "__main__":
    args = ["-q", "-p", "no:cacheprovider", *sys.argv[1:]]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    sys.exit(pytest.main(args))
