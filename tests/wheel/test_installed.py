"""The installed package (tools/wheel_test.sh installs the wheel into a fresh virtual
environment and runs this from outside the repository): every module of the source
tree imports from the installed copy, which loads the libraries inside it."""
import importlib
import os
import site
import sys

import precis
from precis import _lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALLED = os.path.dirname(os.path.abspath(precis.__file__))


def test_precis_comes_from_the_environment_not_the_checkout():
    # The environment may live in the repository (build/wheel-venv): site-packages is
    # what counts, and the checkout's package must not be the one imported.
    assert not INSTALLED.startswith(os.path.join(REPO, "torch_ext") + os.sep), INSTALLED
    assert INSTALLED in [os.path.join(p, "precis") for p in site.getsitepackages()], INSTALLED
    assert sys.prefix != sys.base_prefix  # a virtual environment
    assert not os.environ.get("PYTHONPATH")


def test_every_module_of_the_sources_imports_from_the_installed_copy():
    root = os.path.join(REPO, "torch_ext")
    modules = []
    for dirpath, _, names in os.walk(os.path.join(root, "precis")):
        for name in names:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)[:-len(".py")]
                modules.append(rel.replace(os.sep, ".").removesuffix(".__init__"))
    assert "precis.optim" in modules and "precis.ddp" in modules
    for name in sorted(modules):
        module = importlib.import_module(name)
        assert os.path.abspath(module.__file__).startswith(INSTALLED + os.sep), name


def test_libraries_load_from_inside_the_package():
    for handle in (_lib.lib(), _lib.torch_glue()):
        assert os.path.dirname(handle.precis_path) == INSTALLED, handle.precis_path
    # Loaded at the first CUDA tensor only, from beside the glue: they must be there.
    assert os.path.isfile(os.path.join(INSTALLED, "libprecis_cuda.so"))
    assert os.path.isfile(os.path.join(INSTALLED, "libprecis_cuda12.so"))
