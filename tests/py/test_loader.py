"""The ctypes loader: where it looks, what it refuses, and that it mirrors precis.h.

Tests that load a library under other settings run in a subprocess, so the
process-wide singleton of this test session is never touched.
"""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import precis
from precis import _lib

PACKAGE_DIR = os.path.dirname(os.path.abspath(precis.__file__))
HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "csrc", "include", "precis", "precis.h")
needs_header = pytest.mark.skipif(not os.path.isfile(HEADER), reason="precis.h not at hand")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
LOCATION_VARS = ("PRECIS_LIBRARY", "PRECIS_CUDA_LIBRARY", "RUNFILES_DIR", "TEST_SRCDIR")


def run_python(code, pythonpath, **env):
    """Run code in a fresh interpreter; returns (returncode, stdout + stderr)."""
    full = {k: v for k, v in os.environ.items() if k not in LOCATION_VARS}
    full["PYTHONPATH"] = pythonpath
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def copy_package(root):
    """A copy of the Python package (no library beside it) under root/torch_ext."""
    dst = os.path.join(root, "torch_ext", "precis")
    shutil.copytree(PACKAGE_DIR, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return os.path.join(root, "torch_ext")


REPORT_LOAD = """
    import precis
    from precis import _lib
    try:
        print("LOADED", _lib.lib().precis_path)
    except _lib.LibraryError as e:
        print("ERROR", e)
"""


def test_missing_env_library_lists_where_it_looked(tmp_path):
    missing = str(tmp_path / "nowhere" / "libprecis.so")
    rc, out = run_python(REPORT_LOAD, os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=missing)
    assert rc == 0, out
    assert "ERROR" in out and missing in out and "$PRECIS_LIBRARY" in out, out
    assert "not found" in out and "bazel build" in out, out


def test_nothing_found_lists_every_candidate(tmp_path):
    pythonpath = copy_package(str(tmp_path / "repo"))
    runfiles = str(tmp_path / "runfiles")
    rc, out = run_python(REPORT_LOAD, pythonpath, RUNFILES_DIR=runfiles)
    assert rc == 0 and "ERROR" in out, out
    pkg = os.path.join(pythonpath, "precis")
    for path in [os.path.join(pkg, "libprecis.so"),
                 os.path.join(runfiles, "precis", "libprecis.so"),
                 os.path.join(str(tmp_path / "repo"), "libprecis.so"),
                 os.path.join(str(tmp_path / "repo"), "bazel-bin", "libprecis.so"),
                 os.path.join(os.sep, "bazel-bin", "libprecis.so")]:
        assert path in out, (path, out)


def test_candidate_order(monkeypatch):
    for var in LOCATION_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RUNFILES_DIR", "/rf")
    monkeypatch.setenv("TEST_SRCDIR", "/ts")
    paths = [p for _, p in _lib.candidate_paths("libprecis.so", "PRECIS_LIBRARY")]
    assert paths[:3] == [os.path.join(PACKAGE_DIR, "libprecis.so"),
                         "/rf/precis/libprecis.so", "/ts/precis/libprecis.so"]
    repo = os.path.dirname(os.path.dirname(PACKAGE_DIR))
    assert paths[3] == os.path.join(repo, "libprecis.so")
    walk = paths[4:]
    assert walk[0] == os.path.join(PACKAGE_DIR, "bazel-bin", "libprecis.so")
    assert walk[-1] == "/bazel-bin/libprecis.so"
    assert os.path.join(repo, "bazel-bin", "libprecis.so") in walk
    # An explicit path is the only candidate.
    monkeypatch.setenv("PRECIS_LIBRARY", "/x/libprecis.so")
    assert [p for _, p in _lib.candidate_paths("libprecis.so", "PRECIS_LIBRARY")] == [
        "/x/libprecis.so"]


@pytest.mark.parametrize("where", ["beside", "runfiles", "workspace", "bazel-bin"])
def test_found_in_each_place(tmp_path, where):
    real = _lib.lib().precis_path
    repo = tmp_path / "repo"
    pythonpath = copy_package(str(repo))
    env = {}
    if where == "beside":
        target = os.path.join(pythonpath, "precis", "libprecis.so")
    elif where == "runfiles":
        env["TEST_SRCDIR"] = str(tmp_path / "rf")
        target = str(tmp_path / "rf" / "precis" / "libprecis.so")
    elif where == "workspace":
        target = str(repo / "libprecis.so")
    else:
        target = str(repo / "bazel-bin" / "libprecis.so")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    shutil.copy(real, target)
    rc, out = run_python(REPORT_LOAD, pythonpath, **env)
    assert rc == 0 and f"LOADED {target}" in out, out


def build_fake(tmp_path, body):
    src = tmp_path / "fake.c"
    src.write_text(textwrap.dedent(body))
    out = tmp_path / "libprecis.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return str(out)


@needs_gcc
def test_refuses_other_major_version(tmp_path):
    fake = build_fake(tmp_path, "int precis_version(void) { return 10203; }\n")
    rc, out = run_python(REPORT_LOAD, os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=fake)
    assert rc == 0 and "ERROR" in out, out
    assert "version 1.2.3" in out and f"needs major {_lib.EXPECTED_MAJOR}" in out, out


@needs_gcc
def test_missing_functions_fail_when_called(tmp_path):
    # The status/error/version functions are required at load time...
    fake = build_fake(tmp_path, "int precis_version(void) { return 100; }\n")
    rc, out = run_python(REPORT_LOAD, os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=fake)
    assert rc == 0 and "ERROR" in out, out
    assert "lacks precis_last_error, precis_status_string" in out, out
    # ...any other one fails only when called, naming itself.
    fake = build_fake(tmp_path, """
        int precis_version(void) { return 100; }
        const char* precis_last_error(void) { return ""; }
        const char* precis_status_string(int s) { (void)s; return "?"; }
    """)
    code = """
        from precis import _lib
        handle = _lib.lib()
        assert "precis_adam_step" in handle.precis_missing
        try:
            handle.precis_adam_step(None, None, None)
        except _lib.LibraryError as e:
            print("ERROR", e)
    """
    rc, out = run_python(code, os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=fake)
    assert rc == 0 and f"ERROR precis: {fake} has no precis_adam_step" in out, out


def test_refuses_a_file_that_is_not_a_library(tmp_path):
    bogus = tmp_path / "libprecis.so"
    bogus.write_text("not an ELF file")
    rc, out = run_python(REPORT_LOAD, os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=str(bogus))
    assert rc == 0 and "ERROR precis: cannot load" in out and str(bogus) in out, out


def test_missing_cuda_library(tmp_path):
    missing = str(tmp_path / "libprecis_cuda.so")
    code = """
        from precis import _lib
        try:
            _lib.cuda_lib()
        except _lib.LibraryError as e:
            print("ERROR", e)
    """
    rc, out = run_python(code, os.path.dirname(PACKAGE_DIR),
                         PRECIS_LIBRARY=_lib.lib().precis_path, PRECIS_CUDA_LIBRARY=missing)
    assert rc == 0 and "ERROR" in out and missing in out and "PRECIS_CUDA_LIBRARY" in out, out


def test_ops_register_once(tmp_path):
    code = f"""
        import importlib.util, sys, torch
        import precis
        precis.ops.register()  # again: a no-op
        # The same sources imported under a second package name register nothing new.
        spec = importlib.util.spec_from_file_location(
            "precis_again", {os.path.join(PACKAGE_DIR, "__init__.py")!r},
            submodule_search_locations=[{PACKAGE_DIR!r}])
        again = importlib.util.module_from_spec(spec)
        sys.modules["precis_again"] = again
        spec.loader.exec_module(again)
        assert again.ops._library is None and precis.ops._library is not None
        x = torch.zeros(3)
        again.accumulate_(x, torch.ones(3))
        print("OK", x.tolist())
    """
    rc, out = run_python(code, os.path.dirname(PACKAGE_DIR),
                         PRECIS_LIBRARY=_lib.lib().precis_path)
    assert rc == 0 and "OK [1.0, 1.0, 1.0]" in out, out


def test_version_and_exports():
    assert precis.__version__.split(".")[0] == str(_lib.EXPECTED_MAJOR)
    assert _lib.version()[0] == _lib.EXPECTED_MAJOR
    for name, _, _ in _lib.PROTOTYPES:
        if name not in _lib.lib().precis_missing:
            assert getattr(_lib.lib(), name).argtypes is not None


def test_library_implements_every_prototype():
    assert _lib.lib().precis_missing == []


@needs_header
def test_prototype_table_follows_the_header():
    text = open(HEADER).read()
    declared = re.findall(r"PRECIS_API\s+[^;(]*?\b(precis_\w+)\s*\(", text)
    cpu = [n for n in declared if not n.startswith("precis_cuda_")]
    gpu = [n for n in declared if n.startswith("precis_cuda_")]
    assert [n for n, _, _ in _lib.PROTOTYPES] == cpu
    assert [n for n, _, _ in _lib.CUDA_PROTOTYPES] == gpu
    for name, _, argtypes in _lib.PROTOTYPES + _lib.CUDA_PROTOTYPES:
        params = re.search(rf"\b{name}\s*\(([^)]*)\)", text).group(1).strip()
        count = 0 if params in ("", "void") else params.count(",") + 1
        assert len(argtypes) == count, name
    for name, value in [("MAJOR", _lib.EXPECTED_MAJOR), ("SCALE_BLOCK", _lib.SCALE_BLOCK)]:
        macro = "PRECIS_VERSION_MAJOR" if name == "MAJOR" else "PRECIS_SCALE_BLOCK"
        assert re.search(rf"#define {macro} (\d+)", text).group(1) == str(value)


@needs_header
def test_enums_follow_the_header():
    text = open(HEADER).read()
    for cname, value in re.findall(r"\bPRECIS_((?:ERR_|DTYPE_|FIELD_|STATUS_)\w+) = (\d+)", text):
        assert getattr(_lib, cname.replace("STATUS_", "")
                       if cname == "STATUS_COUNT" else cname) == int(value), cname
    for cname in ("DTYPE_COUNT", "FIELD_COUNT", "STATUS_COUNT"):
        assert f"PRECIS_{cname}" in text


@needs_header
@needs_gcc
def test_struct_layout_matches_c(tmp_path):
    structs = {"precis_policy_t": _lib.PolicyStruct, "precis_adam_config_t": _lib.AdamConfig,
               "precis_adam_tensors_t": _lib.AdamTensors}
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "precis/precis.h"',
             "int main(void) {"]
    for cname, py in structs.items():
        lines.append(f'  printf("{cname} size %zu\\n", sizeof({cname}));')
        for field, _ in py._fields_:
            lines.append(f'  printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    # The _INIT macros, printed back.
    lines += [
        "  precis_policy_t p = PRECIS_POLICY_INIT;",
        "  precis_adam_config_t c = PRECIS_ADAM_CONFIG_INIT;",
        '  printf("policy_init %d %d %u\\n", (int)p.param_dtype, p.store_param_remainders, '
        'p.explicit_fields);',
        '  printf("config_init %.9g %.9g %.9g %.9g %.9g %d %d %.9g %d %llu\\n", c.lr, c.beta1, '
        'c.beta2, c.eps, c.weight_decay, c.decoupled_weight_decay, c.maximize, '
        'c.inv_grad_scale, c.check_finite, (unsigned long long)c.seed);',
        "  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    include = os.path.join(os.path.dirname(HEADER), "..")
    subprocess.run(["gcc", "-std=c11", "-I", include, str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    for cname, py in structs.items():
        assert f"{cname} size {ctypes.sizeof(py)}" in out
        for field, _ in py._fields_:
            assert f"{cname} {field} {getattr(py, field).offset}" in out, (cname, field)
    c = _lib.adam_config()
    f32 = lambda v: ctypes.c_float(v).value  # noqa: E731
    want = (f"config_init {f32(c.lr):.9g} {f32(c.beta1):.9g} {f32(c.beta2):.9g} "
            f"{f32(c.eps):.9g} {c.weight_decay:.9g} {c.decoupled_weight_decay} {c.maximize} "
            f"{c.inv_grad_scale:.9g} {c.check_finite} {c.seed}")
    assert want in out, (want, out)
    assert "policy_init 0 0 0" in out


def test_struct_helpers():
    p = _lib.policy_struct(param_dtype=_lib.DTYPE_BF16)
    assert p.size == ctypes.sizeof(_lib.PolicyStruct) and p.param_dtype == _lib.DTYPE_BF16
    assert p.exp_avg_dtype == _lib.DTYPE_FP32 and p.explicit_fields == 0
    t = _lib.adam_tensors(count=2, params=_lib.pointer_array([torch.zeros(2), None]),
                          numels=_lib.int64_array([2, 0]))
    assert t.size == ctypes.sizeof(_lib.AdamTensors) and t.count == 2
    assert t.params[1] is None and t.numels[0] == 2 and not t.grads
    with pytest.raises(TypeError, match="no settable field"):
        _lib.adam_config(learning_rate=1.0)
    with pytest.raises(TypeError):
        _lib.adam_config(size=1)


def test_check_maps_status_to_exceptions():
    _lib.check(_lib.OK, "fine")
    with pytest.raises(precis.PrecisValueError) as e:
        _lib.dtype_from_name("bf17")
    assert isinstance(e.value, ValueError) and e.value.status == _lib.ERR_INVALID_DTYPE
    assert "'bf17' is not a dtype" in str(e.value) and "PRECIS_ERR_INVALID_DTYPE" in str(e.value)
    for status in (_lib.ERR_NULL_POINTER, _lib.ERR_INVALID_ARGUMENT, _lib.ERR_INVALID_POLICY,
                   _lib.ERR_SIZE_MISMATCH):
        with pytest.raises(ValueError):
            _lib.check(status, "x")
    _lib.dtype_size(_lib.DTYPE_FP32)  # a successful call clears the last error
    for status in (_lib.ERR_UNSUPPORTED, _lib.ERR_CUDA, _lib.ERR_OUT_OF_MEMORY):
        with pytest.raises(precis.PrecisRuntimeError) as e:
            _lib.check(status, "what")
        assert isinstance(e.value, RuntimeError) and not isinstance(e.value, ValueError)
        text = _lib.lib().precis_status_string(status).decode()
        assert str(e.value).startswith(f"what: {text}"), str(e.value)


def test_dtype_helpers():
    for dtype, code in _lib.TORCH_TO_CODE.items():
        assert _lib.code_to_torch(_lib.torch_to_code(dtype)) == dtype
        assert _lib.dtype_size(code) == torch.empty(0, dtype=dtype).element_size()
    assert _lib.torch_to_code(torch.uint8) == _lib.DTYPE_FP8_E4M3
    assert _lib.torch_to_code(torch.int16) == _lib.DTYPE_INT16
    assert [_lib.dtype_name(c) for c in range(_lib.DTYPE_COUNT)] == [
        "fp32", "fp16", "bf16", "fp8", "int16"]
    assert _lib.dtype_from_name(" BFloat16 ") == _lib.DTYPE_BF16
    with pytest.raises(ValueError, match="float64"):
        _lib.torch_to_code(torch.float64)
    with pytest.raises(ValueError):
        _lib.code_to_torch(99)
    with pytest.raises(ValueError):
        _lib.dtype_size(99)


def test_tensor_arg():
    t = torch.arange(6, dtype=torch.float16)
    assert _lib.tensor_arg(t, "t") == (t.data_ptr(), 6, _lib.DTYPE_FP16)
    with pytest.raises(ValueError, match="op: t must be contiguous"):
        _lib.tensor_arg(torch.zeros(4, 4).t(), "t", what="op")
    with pytest.raises(ValueError, match="t has dtype torch.int32"):
        _lib.tensor_arg(torch.zeros(2, dtype=torch.int32), "t")
    with pytest.raises(ValueError, match="supported: torch.float32$"):
        _lib.tensor_arg(t, "t", dtypes=(torch.float32,))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        _lib.tensor_arg([1.0], "t")
