"""The PEP 517 build backend of `pip install .` (pyproject.toml): Bazel builds the wheel
(bazel build //:wheel) and this copies it where pip asks. Needs what the build needs:
bazel, gcc and CUDA 13's nvcc at /usr/local/cuda (tools/setup.sh installs the rest); the
CUDA 12 toolchain of libprecis_cuda12.so (NVRTC, ptxas) pip installs into the build's
environment (CUDA12_TOOLCHAIN, the pins of tools/setup.sh), linked at .venv/cuda12 where
no set-up made that link."""
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


# libprecis_cuda12.so's toolchain (tools/build_cuda12.py), pinned as in tools/setup.sh
# (tests/py/tools/test_cuda12_library.py checks that the two agree).
CUDA12_TOOLCHAIN = ["nvidia-cuda-nvrtc-cu12==12.9.86", "nvidia-cuda-nvcc-cu12==12.9.86"]


def get_requires_for_build_wheel(config_settings=None):
    # the build is Bazel's; the packer uses only the standard library
    return list(CUDA12_TOOLCHAIN)


def _link_cuda12_toolchain():
    """.venv/cuda12 (Bazel's @cuda12) to the nvidia/ folder holding NVRTC, where the
    set-up has not made it: the one pip installed CUDA12_TOOLCHAIN into."""
    link = os.path.join(ROOT, ".venv", "cuda12")
    if os.path.exists(os.path.join(link, "cuda_nvrtc")):
        return
    import nvidia  # a namespace package: one folder per site that has nvidia-* packages
    for folder in nvidia.__path__:
        if os.path.isdir(os.path.join(folder, "cuda_nvrtc")):
            os.makedirs(os.path.dirname(link), exist_ok=True)
            if os.path.islink(link):
                os.remove(link)
            os.symlink(folder, link)
            return
    raise RuntimeError("no NVRTC for libprecis_cuda12.so: pip install "
                       + " ".join(CUDA12_TOOLCHAIN))


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _link_cuda12_toolchain()
    # Bazel's output to stderr: a hook's stdout is not for logs.
    subprocess.run(["bazel", "build", "//:wheel"], cwd=ROOT, check=True, stdout=sys.stderr)
    name = _wheel_name()
    shutil.copyfile(os.path.join(_bazel("info", "bazel-bin"), name),
                    os.path.join(wheel_directory, name))
    return name
