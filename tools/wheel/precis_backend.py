"""The PEP 517 build backend of `pip install .` (pyproject.toml): Bazel builds the wheel
(bazel build //:wheel) and this copies it where pip asks. Needs what the build needs:
bazel, gcc and CUDA 13's nvcc at /usr/local/cuda (tools/setup.sh installs the rest)."""
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bazel(*args):
    return subprocess.run(["bazel", *args], cwd=ROOT, check=True, stdout=subprocess.PIPE,
                          text=True).stdout.strip()


def _wheel_name():
    """The file name //:wheel gets: version and platform from @precis_wheel_info."""
    defs = os.path.join(_bazel("info", "output_base"), "external", "precis_wheel_info",
                        "defs.bzl")
    values = dict(re.findall(r'^(WHEEL_\w+) = "(.*)"$', open(defs).read(), re.M))
    return f"precis-{values['WHEEL_VERSION']}-py3-none-{values['WHEEL_PLATFORM']}.whl"


def get_requires_for_build_wheel(config_settings=None):
    return []  # the build is Bazel's; the packer uses only the standard library


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    # Bazel's output to stderr: a hook's stdout is not for logs.
    subprocess.run(["bazel", "build", "//:wheel"], cwd=ROOT, check=True, stdout=sys.stderr)
    name = _wheel_name()
    shutil.copyfile(os.path.join(_bazel("info", "bazel-bin"), name),
                    os.path.join(wheel_directory, name))
    return name
