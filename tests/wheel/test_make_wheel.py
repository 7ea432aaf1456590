"""tools/wheel/make_wheel.py refuses a wheel that would not work where its name says:
a library linking what the wheel does not carry, a glibc newer than the tag, a package
whose __version__ is not precis.h's."""
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAKE_WHEEL = os.path.join(REPO, "tools", "wheel", "make_wheel.py")
TAG = "manylinux_2_34_x86_64"
pytestmark = pytest.mark.skipif(shutil.which("gcc") is None or os.uname().machine != "x86_64",
                                reason="needs gcc on x86_64")


def library(tmp_path, name, flags=(), body="int precis_version(void) { return 100; }\n"):
    src = tmp_path / (name + ".c")
    src.write_text(body)
    out = tmp_path / "libs" / name
    out.parent.mkdir(exist_ok=True)
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(out), *flags], check=True)
    return str(out)


def package(tmp_path, version):
    pkg = tmp_path / "torch_ext" / "precis"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_lib.py").write_text(f'__version__ = "{version}"\n')
    return [str(pkg / "__init__.py"), str(pkg / "_lib.py")]


def make(tmp_path, files, version="0.1.0", tag=TAG):
    out = tmp_path / f"precis-{version}-py3-none-{tag}.whl"
    proc = subprocess.run([sys.executable, MAKE_WHEEL, str(out), "--version", version,
                           "--platform", tag, *files], capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, out


def good_libraries(tmp_path):
    return [library(tmp_path, n) for n in ("libprecis.so", "libprecis_torch.so",
                                           "libprecis_cuda.so", "libprecis_cuda12.so")]


def test_packs_a_good_set(tmp_path):
    rc, out, wheel = make(tmp_path, package(tmp_path, "0.1.0") + good_libraries(tmp_path))
    assert rc == 0, out
    names = zipfile.ZipFile(wheel).namelist()
    assert "precis/libprecis_cuda.so" in names and "precis/_lib.py" in names
    assert "precis/libprecis_cuda12.so" in names


def test_refuses_a_library_the_wheel_does_not_carry(tmp_path):
    libs = good_libraries(tmp_path)
    libs[0] = library(tmp_path, "libprecis.so", ["-lz"],
                      "int zlibVersion(void); int f(void) { return zlibVersion() != 0; }\n")
    rc, out, _ = make(tmp_path, package(tmp_path, "0.1.0") + libs)
    assert rc != 0 and "needs ['libz.so.1'], which the wheel does not carry" in out, out


def test_refuses_a_glibc_newer_than_the_tag(tmp_path):
    libs = good_libraries(tmp_path)
    libs[1] = library(tmp_path, "libprecis_torch.so", [], "#include <pthread.h>\n"
                      "static pthread_once_t once = PTHREAD_ONCE_INIT;\n"
                      "static void g(void) {}\nvoid f(void) { pthread_once(&once, g); }\n")
    rc, out, _ = make(tmp_path, package(tmp_path, "0.1.0") + libs,
                      tag="manylinux_2_17_x86_64")
    assert rc != 0 and "needs glibc 2.34, newer than its tag manylinux_2_17" in out, out


def test_refuses_a_package_of_another_version(tmp_path):
    rc, out, _ = make(tmp_path, package(tmp_path, "0.0.9") + good_libraries(tmp_path))
    assert rc != 0 and "__version__ is not 0.1.0" in out, out
