"""The wheel of `bazel build //:wheel`: its name, its files and its .dist-info.

Finds the wheel through $PRECIS_WHEEL (tools/wheel_test.sh) or beside the repository
root in Bazel's runfiles (tests/BUILD gives it as data).
"""
import base64
import glob
import hashlib
import os
import re
import zipfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
LIBRARIES = ("libprecis.so", "libprecis_torch.so", "libprecis_cuda.so", "libprecis_cuda12.so")


def header_version():
    text = open(os.path.join(REPO, "csrc", "include", "precis", "precis.h")).read()
    return ".".join(re.search(rf"#define PRECIS_VERSION_{p} (\d+)", text).group(1)
                    for p in ("MAJOR", "MINOR", "PATCH"))


@pytest.fixture(scope="module")
def wheel():
    path = os.environ.get("PRECIS_WHEEL") or "".join(glob.glob(os.path.join(REPO, "precis-*.whl")))
    assert os.path.isfile(path), f"no wheel: set $PRECIS_WHEEL ({path!r})"
    with zipfile.ZipFile(path) as zf:
        yield os.path.basename(path), {n: zf.read(n) for n in zf.namelist()}


def test_name_carries_the_version_and_a_platform_tag(wheel):
    name, _ = wheel
    version = header_version()
    assert re.fullmatch(rf"precis-{re.escape(version)}-py3-none-manylinux_2_\d+_(x86_64|aarch64)"
                        r"\.whl", name), name


def test_holds_the_libraries_and_every_module(wheel):
    _, files = wheel
    for lib in LIBRARIES:
        assert files[f"precis/{lib}"][:4] == b"\x7fELF", lib
    sources = {os.path.relpath(p, os.path.join(REPO, "torch_ext")).replace(os.sep, "/")
               for p in glob.glob(os.path.join(REPO, "torch_ext", "precis", "**", "*.py"),
                                  recursive=True)}
    assert "precis/__init__.py" in sources and "precis/ddp/__init__.py" in sources
    packed = {n for n in files if n.startswith("precis/") and n.endswith(".py")}
    assert packed == sources
    for name in sources:
        assert files[name] == open(os.path.join(REPO, "torch_ext", name), "rb").read(), name


def test_metadata_requires_torch_2_10_and_nothing_else(wheel):
    name, files = wheel
    version = header_version()
    meta = files[f"precis-{version}.dist-info/METADATA"].decode()
    assert f"\nVersion: {version}\n" in meta and "\nName: precis\n" in meta
    assert re.findall(r"^Requires-Dist: (.*)$", meta, re.M) == ["torch>=2.10"]
    tag = name[:-len(".whl")].split("-", 2)[2]
    wheel_file = files[f"precis-{version}.dist-info/WHEEL"].decode()
    assert re.findall(r"^Tag: (.*)$", wheel_file, re.M) == [tag]
    assert "Root-Is-Purelib: false" in wheel_file  # it holds native libraries


def test_record_lists_every_file_with_its_hash(wheel):
    _, files = wheel
    record_name = f"precis-{header_version()}.dist-info/RECORD"
    rows = [line.split(",") for line in files[record_name].decode().splitlines()]
    assert {r[0] for r in rows} == set(files)
    for path, digest, size in rows:
        if path == record_name:
            assert digest == size == ""
            continue
        want = base64.urlsafe_b64encode(hashlib.sha256(files[path]).digest()).rstrip(b"=")
        assert digest == "sha256=" + want.decode() and int(size) == len(files[path]), path
