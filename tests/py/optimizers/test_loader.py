"""The loader of libprecis.so (ctypes) and of the glue libprecis_torch.so
(torch.ops.load_library): where it looks, what it refuses, that the glue registers
the ops once and leaves libprecis_cuda.so alone on the CPU, and that the ctypes
tables and struct mirrors (the package's and tests/py/c_abi.py's) follow precis.h.

Tests that load a library under other settings run in a subprocess, so the
process-wide singletons of this test session are never touched.
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

import c_abi
import precis
from precis import _lib, op_constants

PACKAGE_DIR = os.path.dirname(os.path.abspath(precis.__file__))
HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "..", "..", "..", "csrc", "include", "precis", "precis.h")
needs_header = pytest.mark.skipif(not os.path.isfile(HEADER), reason="precis.h not at hand")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
LOCATION_VARS = ("PRECIS_LIBRARY", "PRECIS_TORCH_LIBRARY", "PRECIS_CUDA_LIBRARY", "RUNFILES_DIR",
                 "TEST_SRCDIR")
# (file name, env var, the _lib function that loads it)
LIBRARIES = {"libprecis.so": ("PRECIS_LIBRARY", "lib"),
             "libprecis_torch.so": ("PRECIS_TORCH_LIBRARY", "torch_glue")}
by_library = pytest.mark.parametrize("name", list(LIBRARIES), ids=["core", "glue"])


def run_python(code, pythonpath, args=(), **env):
    """Run code in a fresh interpreter (sys.argv[1:] = args) with none of the library
    location variables but those in env; returns (returncode, stdout + stderr)."""
    full = {k: v for k, v in os.environ.items() if k not in LOCATION_VARS}
    full["PYTHONPATH"] = pythonpath
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=full,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def copy_package(root):
    """A copy of the Python package (no library beside it) under root/torch_ext."""
    dst = os.path.join(root, "torch_ext", "precis")
    shutil.copytree(PACKAGE_DIR, dst, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return os.path.join(root, "torch_ext")


# Importing precis loads both libraries (libprecis.so first): a LibraryError
# (an OSError) may come from the import itself.
REPORT_LOAD = """
    import sys
    try:
        import precis
        from precis import _lib
        print("LOADED", getattr(_lib, sys.argv[1])().precis_path)
    except OSError as e:
        print("ERROR", e)
"""


def report_load(name, pythonpath, **env):
    """REPORT_LOAD for library `name` (it loads libprecis.so first for the glue)."""
    return run_python(REPORT_LOAD, pythonpath, args=[LIBRARIES[name][1]], **env)


def real_path(name):
    return _lib.lib().precis_path if name == "libprecis.so" else _lib.torch_glue().precis_path


def others(name):
    """Environment naming the session's copy of the library other than `name`: the
    subprocess then loads the same builds as this session, whatever bazel-bin holds."""
    other = "libprecis_torch.so" if name == "libprecis.so" else "libprecis.so"
    return {LIBRARIES[other][0]: real_path(other)}


@by_library
def test_missing_env_library_lists_where_it_looked(tmp_path, name):
    var = LIBRARIES[name][0]
    missing = str(tmp_path / "nowhere" / name)
    rc, out = report_load(name, os.path.dirname(PACKAGE_DIR), **others(name), **{var: missing})
    assert rc == 0, out
    assert "ERROR" in out and missing in out and f"${var}" in out, out
    assert "not found" in out and "bazel build" in out, out


@by_library
def test_nothing_found_lists_every_candidate(tmp_path, name):
    pythonpath = copy_package(str(tmp_path / "repo"))
    runfiles = str(tmp_path / "runfiles")
    rc, out = report_load(name, pythonpath, RUNFILES_DIR=runfiles, **others(name))
    assert rc == 0 and "ERROR" in out, out
    pkg = os.path.join(pythonpath, "precis")
    for path in [os.path.join(pkg, name),
                 os.path.join(runfiles, "precis", name),
                 os.path.join(str(tmp_path / "repo"), name),
                 os.path.join(str(tmp_path / "repo"), "bazel-bin", name),
                 os.path.join(os.sep, "bazel-bin", name)]:
        assert path in out, (path, out)


@by_library
def test_candidate_order(monkeypatch, name):
    var = LIBRARIES[name][0]
    for v in LOCATION_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("RUNFILES_DIR", "/rf")
    monkeypatch.setenv("TEST_SRCDIR", "/ts")
    paths = [p for _, p in _lib.candidate_paths(name, var)]
    assert paths[:3] == [os.path.join(PACKAGE_DIR, name),
                         f"/rf/precis/{name}", f"/ts/precis/{name}"]
    repo = os.path.dirname(os.path.dirname(PACKAGE_DIR))
    assert paths[3] == os.path.join(repo, name)
    walk = paths[4:]
    assert walk[0] == os.path.join(PACKAGE_DIR, "bazel-bin", name)
    assert walk[-1] == f"/bazel-bin/{name}"
    assert os.path.join(repo, "bazel-bin", name) in walk
    # An explicit path is the only candidate.
    monkeypatch.setenv(var, f"/x/{name}")
    assert [p for _, p in _lib.candidate_paths(name, var)] == [f"/x/{name}"]


@by_library
@pytest.mark.parametrize("where", ["beside", "runfiles", "workspace", "bazel-bin"])
def test_found_in_each_place(tmp_path, where, name):
    """Both libraries copied to one place are found there; for the glue that also
    means it registers the ops with the libprecis.so Python loaded first."""
    repo = tmp_path / "repo"
    pythonpath = copy_package(str(repo))
    env = {}
    if where == "beside":
        target = os.path.join(pythonpath, "precis")
    elif where == "runfiles":
        env["TEST_SRCDIR"] = str(tmp_path / "rf")
        target = str(tmp_path / "rf" / "precis")
    elif where == "workspace":
        target = str(repo)
    else:
        target = str(repo / "bazel-bin")
    os.makedirs(target, exist_ok=True)
    for lib_name in LIBRARIES:
        shutil.copy(real_path(lib_name), os.path.join(target, lib_name))
    rc, out = report_load(name, pythonpath, **env)
    assert rc == 0 and f"LOADED {os.path.join(target, name)}" in out, out


def build_fake(tmp_path, body, name="libprecis.so"):
    src = tmp_path / "fake.c"
    src.write_text(textwrap.dedent(body))
    out = tmp_path / name
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return str(out)


@needs_gcc
def test_refuses_other_major_version(tmp_path):
    fake = build_fake(tmp_path, "int precis_version(void) { return 10203; }\n")
    rc, out = report_load("libprecis.so", os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=fake,
                          **others("libprecis.so"))
    assert rc == 0 and "ERROR" in out, out
    assert "version 1.2.3" in out and f"needs major {_lib.EXPECTED_MAJOR}" in out, out
    # The glue is loaded after libprecis.so: a wrong libprecis.so stops it first.
    rc, out = report_load("libprecis_torch.so", os.path.dirname(PACKAGE_DIR),
                          PRECIS_LIBRARY=fake, PRECIS_TORCH_LIBRARY=real_path("libprecis_torch.so"))
    assert rc == 0 and "ERROR" in out and "version 1.2.3" in out, out


@needs_gcc
def test_missing_functions_fail_when_called(tmp_path):
    # The status/error/version functions are required at load time...
    fake = build_fake(tmp_path, "int precis_version(void) { return 100; }\n")
    rc, out = report_load("libprecis.so", os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=fake,
                          **others("libprecis.so"))
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
        assert "precis_cpu_isa" in handle.precis_missing
        try:
            handle.precis_cpu_isa(None)
        except _lib.LibraryError as e:
            print("ERROR", e)
    """
    rc, out = run_python(code, os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=fake,
                         **others("libprecis.so"))
    assert rc == 0 and f"ERROR precis: {fake} has no precis_cpu_isa" in out, out


@needs_gcc
def test_glue_needs_every_entry_point_and_a_registration(tmp_path):
    env = dict(PRECIS_LIBRARY=real_path("libprecis.so"))
    fake = build_fake(tmp_path, "int precis_torch_init(void) { return 0; }\n",
                      "libprecis_torch.so")
    rc, out = report_load("libprecis_torch.so", os.path.dirname(PACKAGE_DIR),
                          PRECIS_TORCH_LIBRARY=fake, **env)
    assert rc == 0 and "ERROR" in out, out
    assert "lacks precis_torch_drop_held, precis_torch_has_cuda, precis_torch_init_message" \
        in out, out
    fake = build_fake(tmp_path, """
        int precis_torch_init(void) { return 6; }
        const char* precis_torch_init_message(void) { return "torch is too old"; }
        int precis_torch_has_cuda(void) { return 0; }
        void precis_torch_drop_held(long long held) { (void)held; }
    """, "libprecis_torch.so")
    rc, out = report_load("libprecis_torch.so", os.path.dirname(PACKAGE_DIR),
                          PRECIS_TORCH_LIBRARY=fake, **env)
    assert rc == 0, out
    assert (f"ERROR precis: {fake} could not register the torch.ops.precis ops: "
            "torch is too old") in out, out


@by_library
def test_refuses_a_file_that_is_not_a_library(tmp_path, name):
    bogus = tmp_path / name
    bogus.write_text("not an ELF file")
    rc, out = report_load(name, os.path.dirname(PACKAGE_DIR), **others(name),
                          **{LIBRARIES[name][0]: str(bogus)})
    assert rc == 0 and "ERROR precis: cannot load" in out and str(bogus) in out, out


GLUE_H = os.path.join(HERE, "..", "..", "..", "torch_ext", "csrc", "glue.h")
NVCC = os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc")


@pytest.mark.skipif(not os.path.isfile(NVCC), reason="needs nvcc")
def test_cuda_driver_minimum_follows_nvcc_and_the_readme():
    """The glue refuses a driver older than the CUDA that built libprecis_cuda.so (its
    runtime is linked statically); that version, nvcc's and the README's must agree."""
    glue = open(GLUE_H).read()
    built_for = int(re.search(r"#define PR_CUDA_BUILT_FOR (\d+)", glue).group(1))
    release = re.search(r"release (\d+)\.(\d+)",
                        subprocess.run([NVCC, "--version"], capture_output=True, text=True,
                                       check=True).stdout)
    assert built_for == int(release.group(1)) * 1000 + int(release.group(2)) * 10, release
    driver = re.search(r'#define PR_CUDA_MIN_DRIVER "(R\d+) or newer"', glue).group(1)
    readme = open(os.path.join(HERE, "..", "..", "..", "README.md")).read()
    assert f"NVIDIA driver {driver} or newer (CUDA {built_for // 1000}" in readme


# What a user sees when `import precis` fails: the exception's type, its number of
# lines and its text.
IMPORT_ERROR = """
    try:
        import precis
        print("IMPORTED")
    except Exception as e:
        print(type(e).__name__, len(str(e).splitlines()), str(e))
"""


def test_import_without_libraries_is_one_line_naming_the_fix(tmp_path):
    rc, out = run_python(IMPORT_ERROR, copy_package(str(tmp_path / "elsewhere")))
    assert rc == 0 and out.startswith("LibraryError 1 precis: libprecis.so not found; "
                                      "reinstall precis (pip install precis-*.whl"), out
    assert "$PRECIS_LIBRARY" in out and str(tmp_path) in out, out


@needs_gcc
def test_import_with_a_library_of_another_version_is_one_line_naming_the_fix(tmp_path):
    fake = build_fake(tmp_path, "int precis_version(void) { return 10203; }\n")
    rc, out = run_python(IMPORT_ERROR, os.path.dirname(PACKAGE_DIR), PRECIS_LIBRARY=fake)
    assert rc == 0 and out.startswith(f"LibraryError 1 precis: {fake} is version 1.2.3"), out
    assert "reinstall precis so that the package and its libraries match" in out, out


def test_import_with_torch_older_than_2_10_is_one_line_naming_the_minimum(tmp_path):
    fake_torch = tmp_path / "old" / "torch"
    fake_torch.mkdir(parents=True)
    (fake_torch / "__init__.py").write_text('__version__ = "2.9.1+cu128"\n')
    rc, out = run_python(IMPORT_ERROR, f"{tmp_path / 'old'}{os.pathsep}"
                         f"{os.path.dirname(PACKAGE_DIR)}")
    assert rc == 0 and out.strip() == (
        "ImportError 1 precis needs torch 2.10 or newer (its ops are registered through "
        "libtorch's stable C ABI); found torch 2.9.1+cu128: pip install 'torch>=2.10'"), out


def test_cpu_ops_leave_the_cuda_library_alone(tmp_path):
    """The glue loads libprecis_cuda.so at the first CUDA call only: after CPU ops (and
    with $PRECIS_CUDA_LIBRARY naming nothing) it is not mapped."""
    code = """
        import torch, precis
        from precis import _lib, ops
        x = torch.zeros(5)
        precis.accumulate_(x, torch.ones(5, dtype=torch.bfloat16))
        ops.cast_(torch.empty(5, dtype=torch.float16), x)
        ops.scale_(x, 2.0)
        assert int(ops.count_nonfinite(x)) == 0
        p, g, m, v = torch.zeros(5), torch.ones(5), torch.zeros(5), torch.zeros(5)
        found = ops.adam_step_([p], [g], [], [m], [v], [], [], [1], 1e-3, 0.9, 0.999, 1e-8,
                               0.0, check_finite=True)
        assert float(found) == 0.0 and float(p[0]) != 0.0
        maps = open("/proc/self/maps").read()
        assert "libprecis_torch.so" in maps, maps
        print("CUDA_MAPPED", "libprecis_cuda" in maps)
        print("HAS_CUDA", _lib.torch_glue().precis_torch_has_cuda())
    """
    missing = str(tmp_path / "libprecis_cuda.so")
    rc, out = run_python(code, os.path.dirname(PACKAGE_DIR), PRECIS_CUDA_LIBRARY=missing,
                         PRECIS_LIBRARY=real_path("libprecis.so"),
                         PRECIS_TORCH_LIBRARY=real_path("libprecis_torch.so"))
    assert rc == 0 and "CUDA_MAPPED False" in out, out
    # CUDA kernels are registered where torch's CUDA library is loaded: in a CUDA
    # build of torch, with or without a GPU.
    assert f"HAS_CUDA {int(torch.version.cuda is not None)}" in out, out


def test_ops_register_once(tmp_path):
    """Loading the glue again (same path, torch.ops.load_library) and a copy at another
    path (ctypes) fails nothing and registers nothing twice."""
    copy = tmp_path / "copy" / "libprecis_torch.so"
    copy.parent.mkdir()
    shutil.copy(real_path("libprecis_torch.so"), copy)
    code = f"""
        import ctypes, torch, precis
        from precis import _lib
        glue = _lib.torch_glue()
        first = glue.precis_torch_init_message()
        torch.ops.load_library(glue.precis_path)
        assert glue.precis_torch_init() == 0
        assert glue.precis_torch_init_message() == first, glue.precis_torch_init_message()
        print("FIRST", first.decode())
        copy = ctypes.CDLL({str(copy)!r})  # its constructor runs precis_torch_init
        copy.precis_torch_init_message.restype = ctypes.c_char_p
        print("COPY_INIT", copy.precis_torch_init())
        print("COPY_MESSAGE", copy.precis_torch_init_message().decode())
        print("COPY_HAS_CUDA", copy.precis_torch_has_cuda())
        for op in ("accumulate_", "adam_step_", "count_nonfinite"):
            dump = torch._C._dispatch_dump("precis::" + op)
            cpu = [l for l in dump.splitlines() if l.startswith("CPU:")]
            assert len(cpu) == 1 and "register.c" in cpu[0], dump
        maps = open("/proc/self/maps").read().splitlines()
        core = {{l.split()[-1] for l in maps if l.endswith("/libprecis.so")}}
        assert len(core) == 1, core  # the copy's DT_NEEDED found the loaded libprecis.so
        x = torch.zeros(3)
        precis.accumulate_(x, torch.ones(3))
        print("OK", x.tolist())
    """
    rc, out = run_python(code, os.path.dirname(PACKAGE_DIR),
                         PRECIS_LIBRARY=real_path("libprecis.so"),
                         PRECIS_TORCH_LIBRARY=real_path("libprecis_torch.so"))
    assert rc == 0 and "OK [1.0, 1.0, 1.0]" in out, out
    assert "FIRST registered precis:: ops" in out, out
    assert "COPY_INIT 0" in out and "COPY_HAS_CUDA 0" in out, out
    assert "COPY_MESSAGE " in out and "registered nothing" in out.split("COPY_MESSAGE ")[1], out


def test_version_and_exports():
    assert precis.__version__.split(".")[0] == str(_lib.EXPECTED_MAJOR)
    assert _lib.version()[0] == _lib.EXPECTED_MAJOR
    for handle, table in ((_lib.lib(), _lib.PROTOTYPES),
                          (_lib.torch_glue(), _lib.TORCH_GLUE_PROTOTYPES)):
        for name, _, _ in table:
            if name not in handle.precis_missing:
                assert getattr(handle, name).argtypes is not None


def test_library_implements_every_prototype():
    assert _lib.lib().precis_missing == []
    assert _lib.torch_glue().precis_missing == []
    assert _lib.torch_glue().precis_torch_init() == _lib.OK


def header_functions(text):
    """{name: arity} of every PRECIS_API function of precis.h, and their order."""
    declared = re.findall(r"PRECIS_API\s+[^;(]*?\b(precis_\w+)\s*\(", text)
    arity = {}
    for name in declared:
        params = re.search(rf"\b{name}\s*\(([^)]*)\)", text).group(1).strip()
        arity[name] = 0 if params in ("", "void") else params.count(",") + 1
    return declared, arity


@needs_header
def test_prototype_tables_follow_the_header():
    """Every prototype Python declares is in precis.h with its arity, in header order;
    the glue's table is exactly the header's precis_torch_* functions."""
    text = open(HEADER).read()
    declared, arity = header_functions(text)
    tables = {"_lib.PROTOTYPES": _lib.PROTOTYPES,
              "_lib.TORCH_GLUE_PROTOTYPES": _lib.TORCH_GLUE_PROTOTYPES,
              "c_abi.CPU_PROTOTYPES": c_abi.CPU_PROTOTYPES,
              "c_abi.CUDA_PROTOTYPES": c_abi.CUDA_PROTOTYPES}
    for table_name, table in tables.items():
        names = [n for n, _, _ in table]
        assert len(set(names)) == len(names), table_name
        for name, _, argtypes in table:
            assert name in arity, f"{table_name}: {name} is not in precis.h"
            assert len(argtypes) == arity[name], f"{table_name}: {name} arity"
        if table_name != "c_abi.CPU_PROTOTYPES":
            positions = [declared.index(n) for n in names]
            assert positions == sorted(positions), f"{table_name} is not in header order"
    assert [n for n, _, _ in _lib.TORCH_GLUE_PROTOTYPES] == [
        n for n in declared if n.startswith("precis_torch_")]
    assert [n for n, _, _ in c_abi.CUDA_PROTOTYPES] == [
        n for n in declared if n.startswith("precis_cuda_")]
    assert {"precis_status_string", "precis_last_error", "precis_version"} <= {
        n for n, _, _ in _lib.PROTOTYPES}
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
    """The package's precis_policy_t mirror and the tests' Adam mirrors (c_abi.py):
    sizes, field offsets and the _INIT macros, as gcc compiles precis.h."""
    structs = {"precis_policy_t": _lib.PolicyStruct, **c_abi.STRUCTS}
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
        "  precis_adam_tensors_t t = PRECIS_ADAM_TENSORS_INIT;",
        "  precis_cuda_adam_device_args_t d = PRECIS_CUDA_ADAM_DEVICE_ARGS_INIT;",
        '  printf("policy_init %zu %d %d %u\\n", p.size, (int)p.param_dtype, '
        'p.store_param_remainders, p.explicit_fields);',
        '  printf("config_init %zu %.17g %.17g %.17g %.17g %.17g %d %d %.9g %d %llu %d %d %d\\n", '
        'c.size, c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.decoupled_weight_decay, '
        'c.maximize, c.inv_grad_scale, c.check_finite, (unsigned long long)c.seed, '
        'c.lr_float32, c.cpu_sqrt == NULL, c.num_threads);',
        '  printf("tensors_init %zu %zu %d %d %d %d %d %d\\n", t.size, t.count, '
        '(int)t.param_dtype, '
        '(int)t.grad_dtype, (int)t.master_dtype, (int)t.exp_avg_dtype, (int)t.exp_avg_sq_dtype, '
        't.params == NULL && t.grads == NULL && t.masters == NULL && t.exp_avgs == NULL && '
        't.exp_avg_sqs == NULL && t.exp_avg_scales == NULL && t.exp_avg_sq_scales == NULL && '
        't.numels == NULL && t.steps == NULL);',
        '  printf("device_args_init %zu %d\\n", d.size, d.lr == NULL && d.inv_grad_scale == NULL '
        '&& d.steps == NULL && d.found_inf == NULL);',
        "  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    include = os.path.join(os.path.dirname(HEADER), "..")
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", "-I", include, str(src), "-o",
                    str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    for cname, py in structs.items():
        assert f"{cname} size {ctypes.sizeof(py)}" in out
        for field, _ in py._fields_:
            assert f"{cname} {field} {getattr(py, field).offset}" in out, (cname, field)
    c = c_abi.adam_config()
    want = (f"config_init {c.size} {c.lr:.17g} {c.beta1:.17g} {c.beta2:.17g} "
            f"{c.eps:.17g} {c.weight_decay:.17g} {c.decoupled_weight_decay} {c.maximize} "
            f"{c.inv_grad_scale:.9g} {c.check_finite} {c.seed} {c.lr_float32} "
            f"{int(not c.cpu_sqrt)} {c.num_threads}")
    assert want in out, (want, out)
    p = _lib.policy_struct()
    assert f"policy_init {p.size} {p.param_dtype} {p.store_param_remainders} " \
           f"{p.explicit_fields}" in out, out
    t = c_abi.adam_tensors()
    assert (f"tensors_init {t.size} {t.count} {t.param_dtype} {t.grad_dtype} {t.master_dtype} "
            f"{t.exp_avg_dtype} {t.exp_avg_sq_dtype} 1") in out, out
    assert not (t.params or t.grads or t.masters or t.numels or t.steps)
    d = c_abi.cuda_adam_device_args()
    assert f"device_args_init {d.size} 1" in out, out
    assert d.lr is None and d.inv_grad_scale is None and not d.steps and d.found_inf is None


def test_struct_helpers():
    p = _lib.policy_struct(param_dtype=_lib.DTYPE_BF16)
    assert p.size == ctypes.sizeof(_lib.PolicyStruct) and p.param_dtype == _lib.DTYPE_BF16
    assert p.exp_avg_dtype == _lib.DTYPE_FP32 and p.explicit_fields == 0
    with pytest.raises(TypeError, match="no settable field"):
        _lib.policy_struct(dtype=1)
    with pytest.raises(TypeError):
        _lib.policy_struct(size=1)
    t = c_abi.adam_tensors(count=2, params=c_abi.pointer_array([torch.zeros(2), None]),
                           numels=c_abi.int64_array([2, 0]))
    assert t.size == ctypes.sizeof(c_abi.AdamTensors) and t.count == 2
    assert t.params[1] is None and t.numels[0] == 2 and not t.grads
    with pytest.raises(TypeError, match="no settable field"):
        c_abi.adam_config(learning_rate=1.0)


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
    for dtype, code in op_constants.TORCH_TO_CODE.items():
        assert op_constants.code_to_torch(op_constants.torch_to_code(dtype)) == dtype
        assert _lib.dtype_size(code) == torch.empty(0, dtype=dtype).element_size()
    assert op_constants.torch_to_code(torch.uint8) == _lib.DTYPE_FP8_E4M3
    assert op_constants.torch_to_code(torch.int16) == _lib.DTYPE_INT16
    assert [_lib.dtype_name(c) for c in range(_lib.DTYPE_COUNT)] == [
        "fp32", "fp16", "bf16", "fp8", "int16"]
    assert _lib.dtype_from_name(" BFloat16 ") == _lib.DTYPE_BF16
    with pytest.raises(ValueError, match="float64"):
        op_constants.torch_to_code(torch.float64)
    with pytest.raises(ValueError):
        op_constants.code_to_torch(99)
    with pytest.raises(ValueError):
        _lib.dtype_size(99)


def test_require_tensor():
    _lib.require_tensor(torch.zeros(2), "t")  # a tensor passes
    with pytest.raises(TypeError, match="^op: t must be a torch.Tensor, got list$"):
        _lib.require_tensor([1.0], "t", "op")
    with pytest.raises(TypeError, match="got NoneType"):
        _lib.require_tensor(None, "t")
