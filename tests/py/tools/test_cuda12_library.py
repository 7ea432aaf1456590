"""libprecis_cuda12.so without a GPU: what it needs (no CUDA library), what it carries (a
cubin for each of six architectures, one PTX of ISA 8.1 for each module), and its host
code's launches through the driver API, run against a stand-in driver
(tests/c/fake_driver/fake_libcuda.c): every kernel a call launches is in the library, each
GPU gets its architecture's cubin, and a machine where it cannot run gets one line saying
why (no driver, a driver too old, a GPU too old).

Each driver scenario runs in a subprocess: libcuda.so.1 is opened once per process."""
import ctypes
import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import pytest

import c_abi
from precis import _lib

HERE = os.path.dirname(os.path.abspath(__file__))
PY_DIR = os.path.dirname(HERE)
ARCHS = {80, 86, 89, 90, 100, 120}
MODULES = ("step.cu", "bucket_ops.cu", "resync.cu")


def library_path():
    glue_dir = os.path.dirname(_lib.torch_glue().precis_path)
    path = os.path.join(glue_dir, "libprecis_cuda12.so")
    assert os.path.isfile(path), f"libprecis_cuda12.so is not beside the glue ({glue_dir})"
    return path


def fake_driver_dir():
    """The folder of the stand-in libcuda.so.1 (Bazel's runfiles, or bazel-bin)."""
    roots = [os.environ.get("RUNFILES_DIR", ""), os.environ.get("TEST_SRCDIR", "")]
    here = HERE
    while os.path.dirname(here) != here:
        roots.append(os.path.join(here, "bazel-bin"))
        here = os.path.dirname(here)
    for root in roots:
        for sub in ("precis/tests/fake_driver", "tests/fake_driver"):
            d = os.path.join(root, sub)
            if os.path.isfile(os.path.join(d, "libcuda.so.1")):
                return d
    pytest.fail("no stand-in libcuda.so.1: bazel build //tests:fake_driver/libcuda.so.1")


def images():
    """[(module, sm, bytes)] of the library (sm 0: the PTX)."""
    lib = ctypes.CDLL(library_path())
    lib.precis_cuda12_image.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                        ctypes.POINTER(ctypes.c_int),
                                        ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_size_t)]
    out = []
    for i in range(lib.precis_cuda12_image_count()):
        m, sm, data, size = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t()
        assert lib.precis_cuda12_image(i, m, sm, data, size) == 1
        out.append((MODULES[m.value], sm.value, ctypes.string_at(data.value, size.value)))
    return out


def cubin_arch(image):
    """The sm of a cubin from its ELF header: e_flags' low byte, or its second byte from
    CUDA 12.8's ELF ABI version 0x41 (sm_100 and newer)."""
    assert image[:4] == b"\x7fELF", "not an ELF image"
    flags = struct.unpack_from("<I", image, 0x30)[0]
    return (flags >> 8) & 0xFF if image[7] == 0x41 else flags & 0xFF


# ---- what the library needs and carries ------------------------------------------------

def test_links_and_carries_no_cuda_runtime():
    """No CUDA library among its dependencies, none of cudart's functions or strings, no
    CUDA 13 compiler in it; libprecis_cuda.so (CUDA 13's runtime linked in) shows them,
    so the check can fail."""
    def needed(path):
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True,
                             check=True).stdout
        return set(re.findall(r"\(NEEDED\).*\[(.*)\]", out))

    def strings(path):
        return subprocess.run(["strings", path], capture_output=True, text=True,
                              check=True).stdout

    path = library_path()
    assert needed(path) <= {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                            "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}, needed(path)
    cudart = re.compile(r"__cudaRegisterFatBinary|cudaGetLastError|cudaLaunchKernel|"
                        r"libcudart|release 13\.")
    assert not cudart.findall(strings(path))
    old = os.path.join(os.path.dirname(path), "libprecis_cuda.so")
    if os.path.isfile(old):
        assert cudart.findall(strings(old)), "the check finds nothing in the CUDA 13 library"


def test_a_cubin_for_each_architecture_and_ptx_an_old_driver_loads():
    by_module = {}
    for module, sm, image in images():
        by_module.setdefault(module, []).append((sm, image))
    assert sorted(by_module) == sorted(MODULES)
    for module, found in by_module.items():
        cubins = [cubin_arch(image) for sm, image in found if sm != 0]
        assert sorted(cubins) == sorted(ARCHS), (module, cubins)
        assert [sm for sm, _ in found if sm != 0] == cubins  # the table says what each is
        ptx = [image for sm, image in found if sm == 0]
        assert len(ptx) == 1, module
        head = ptx[0][:2000].decode(errors="replace")
        # 8.1: CUDA 12.1 (R530), the first ISA with kernel parameters over 4 KiB (AdamArgs
        # is 15 KiB); ptxas checked it at build time (tools/build_cuda12.py).
        assert re.search(r"^\.version 8\.1$", head, re.M), head[:300]
        assert re.search(r"^\.target sm_80$", head, re.M), head[:300]


def test_cuobjdump_reads_each_cubin_as_its_architecture(tmp_path):
    """The ELF header's reading (cubin_arch) against cuobjdump's (CUDA 13's, pinned)."""
    found = [os.path.join(p, "nvidia", "cu13", "bin", "cuobjdump") for p in sys.path]
    cuobjdump = next((p for p in found if os.path.isfile(p)), None)
    assert cuobjdump, "no cuobjdump (tools/setup.sh pins nvidia-cuda-cuobjdump)"
    for module, sm, image in images():
        if sm == 0 or module != "resync.cu":
            continue
        path = tmp_path / f"x.sm_{sm}.cubin"
        path.write_bytes(image)
        out = subprocess.run([cuobjdump, "-lelf", str(path)], capture_output=True, text=True,
                             check=True).stdout
        assert re.search(rf"\.sm_{sm}\.cubin$", out.strip()), out


# ---- the host code's launches, against a stand-in driver ------------------------------

RUN = textwrap.dedent("""
    import ctypes, json, os, sys
    sys.path[:0] = [{py_dir!r}, {package_root!r}]
    import c_abi, torch
    from precis import _lib
    lib = c_abi._declare(ctypes.CDLL({path!r}), c_abi._COMMON + c_abi.CUDA_PROTOTYPES)
    lib.precis_cuda12_kernel.restype = ctypes.c_char_p
    lib.precis_cuda12_kernel.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    names = {{}}
    for i in range(lib.precis_cuda12_kernel_count()):
        symbol = ctypes.c_char_p()
        name = lib.precis_cuda12_kernel(i, ctypes.byref(symbol)).decode()
        names[name] = symbol.value.decode()
    results = []
    {body}
    print(json.dumps({{"names": names, "results": results}}))
""")


def run(body, **env):
    """Runs body (Python: `lib`, `results`) in a subprocess on the stand-in driver; returns
    (kernel name -> symbol, results, the driver's log lines)."""
    log = os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), f"fake_cuda_{os.getpid()}.log")
    if os.path.exists(log):
        os.remove(log)
    code = RUN.format(py_dir=PY_DIR, package_root=os.path.dirname(os.path.dirname(_lib.__file__)),
                      path=library_path(), body=body)
    environment = dict(os.environ, FAKE_CUDA_LOG=log, **env)
    environment["LD_LIBRARY_PATH"] = env.get("LD_LIBRARY_PATH", fake_driver_dir())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = open(log).read().splitlines() if os.path.exists(log) else []
    return out["names"], out["results"], lines


DTYPES = {_lib.DTYPE_FP32: "torch.float32", _lib.DTYPE_FP16: "torch.float16",
          _lib.DTYPE_BF16: "torch.bfloat16", _lib.DTYPE_FP8_E4M3: "torch.uint8",
          _lib.DTYPE_INT16: "torch.int16"}
F32, F16, BF16, FP8, I16 = (_lib.DTYPE_FP32, _lib.DTYPE_FP16, _lib.DTYPE_BF16,
                            _lib.DTYPE_FP8_E4M3, _lib.DTYPE_INT16)
NONE, SEPARATE, REM16, REM8 = 0, 1, 2, 3  # csrc/step_args.h's master modes

# (grad, param, master mode, master, m, v): the policies the README names and a few that
# take the generic kernel (fp16 moments with an fp16 model, fp32 grads with int16 remainders).
POLICIES = [
    (F32, F32, NONE, F32, F32, F32), (F32, F32, NONE, F32, BF16, BF16),
    (F32, F32, NONE, F32, FP8, FP8), (BF16, BF16, SEPARATE, F32, BF16, BF16),
    (F32, BF16, SEPARATE, F32, BF16, BF16), (BF16, BF16, REM16, I16, BF16, BF16),
    (BF16, BF16, SEPARATE, F32, FP8, FP8), (BF16, BF16, REM16, I16, FP8, FP8),
    (BF16, BF16, REM8, FP8, FP8, FP8), (F16, F16, SEPARATE, F32, F32, F32),
    (F16, F16, SEPARATE, F32, F16, F16), (F32, BF16, REM16, I16, BF16, BF16),
]

STEP = """
def step(policy, rule=0, n=4097, count=3):
    g, p, mode, md, e, v = policy
    dt = {dtypes}
    def table(dtype, numel):
        return [torch.zeros(numel, dtype=eval(dtype)) for _ in range(count)]
    keep = {{}}
    def ptrs(name, dtype, numel=n):
        keep[name] = table(dtype, numel)
        return c_abi.pointer_array(keep[name])
    blocks = (n + 127) // 128
    fields = dict(count=count, param_dtype=p, grad_dtype=g, master_dtype=md, exp_avg_dtype=e,
                  exp_avg_sq_dtype=v, params=ptrs("p", dt[p]), grads=ptrs("g", dt[g]),
                  exp_avgs=ptrs("m", dt[e]), exp_avg_sqs=ptrs("v", dt[v]),
                  numels=c_abi.int64_array([n] * count), steps=c_abi.int64_array([1] * count))
    if mode != 0:
        fields["masters"] = ptrs("x", dt[md])
    if e in ({fp8}, {f16}):  # the scaled codes (block scales)
        fields["exp_avg_scales"] = ptrs("ms", "torch.float32", blocks)
    if v in ({fp8}, {f16}):
        fields["exp_avg_sq_scales"] = ptrs("vs", "torch.float32", blocks)
    config = dict(rule=rule, check_finite=1)
    if rule == 1:
        config.update(momentum=0.9)
    if rule == 3:
        config.update(momentum=0.95)
        fields["outputs"] = ptrs("o", "torch.float32")
        fields["output_dtype"] = {f32}
    if rule != 0:
        fields.pop("exp_avg_sqs"); fields.pop("exp_avg_sq_scales", None)
    found = torch.zeros(1)
    dev = c_abi.cuda_adam_device_args(found_inf=found.data_ptr())
    st = lib.precis_cuda_step(ctypes.byref(c_abi.adam_config(**config)),
                              ctypes.byref(c_abi.adam_tensors(**fields)), ctypes.byref(dev), None)
    results.append([st, lib.precis_last_error().decode()])
""".format(dtypes=DTYPES, fp8=FP8, f16=F16, f32=F32)


def launched(names, lines):
    """The kernel names of the log's launches, in order."""
    by_symbol = {s: n for n, s in names.items()}
    return [by_symbol[line.split()[1]] for line in lines if line.startswith("launch ")]


def test_every_step_launches_its_policys_kernel():
    """Each policy's step launches check_kernel<grad> and the update kernel pick_update
    chose: the specialized one where the library has it (PR_ADAM_SPECIALIZED), else the
    generic one; the one-state rules one_state_kernel. Every launch resolves."""
    body = STEP + "".join(f"step({list(p)})\n" for p in POLICIES)
    body += f"step({list(POLICIES[3])}, rule=1)\nstep({list(POLICIES[3])}, rule=2)\n"
    body += f"step([{F32}, {F32}, 0, {F32}, {F32}, {F32}], rule=3)\n"
    names, results, lines = run(body)
    assert all(st == 0 for st, _ in results), results
    assert [line for line in lines if line.startswith("load ")] == ["load sm_90"] * 3
    kernels = launched(names, lines)
    expected = []
    for g, p, mode, md, e, v in POLICIES:
        own = f"adam_kernel<{g},{p},{mode},{md},{e},{v}>"
        expected += [f"check_kernel<{g}>",
                     own if own in names else "adam_kernel<-1,-1,-1,-1,-1,-1>"]
    expected += [f"check_kernel<{BF16}>", "one_state_kernel"] * 2
    expected += [f"check_kernel<{F32}>", "one_state_kernel"]
    assert kernels == expected
    # the specialized kernels named above, and the generic one, all exist in the library
    assert sum(k != "adam_kernel<-1,-1,-1,-1,-1,-1>" for k in expected[1:24:2]) == 10
    # the launch's first argument is AdamArgs by value: its first bytes are the host's
    # constants (consts.grad_mul = 1.0f), not a pointer
    first = [line.split()[4] for line in lines if line.startswith("launch ")]
    assert all(f.endswith("3f800000") for f in first[1:24:2]), first


def test_bucket_ops_and_resync_launch_their_kernels():
    body = textwrap.dedent(f"""
        t = {{d: torch.zeros(4097, dtype=eval(s)) for d, s in {DTYPES}.items()}}
        u = {{d: torch.zeros(4097, dtype=eval(s)) for d, s in {DTYPES}.items()}}
        for dst in ({F32}, {F16}, {BF16}):
            for src in ({F32}, {F16}, {BF16}):
                results.append(lib.precis_cuda_accumulate(t[dst].data_ptr(), dst,
                                                          u[src].data_ptr(), src, 4097, None))
                results.append(lib.precis_cuda_cast(t[dst].data_ptr(), dst, u[src].data_ptr(),
                                                    src, 4097, None))
            results.append(lib.precis_cuda_scale(t[dst].data_ptr(), dst, 0.5, 4097, None))
            out = torch.zeros(1, dtype=torch.int64)
            results.append(lib.precis_cuda_count_nonfinite(t[dst].data_ptr(), dst, 4097,
                                                           out.data_ptr(), None))
        bufs = c_abi.pointer_array([t[{BF16}], u[{BF16}]])
        nbytes = c_abi.int64_array([8194, 8194])
        sums = torch.zeros(2, dtype=torch.int64)
        results.append(lib.precis_cuda_fingerprint(bufs, nbytes, 2, sums.data_ptr(), None))
        masters = c_abi.pointer_array([t[{F32}]])
        params = c_abi.pointer_array([u[{BF16}]])
        numels = c_abi.int64_array([4097])
        stale, kept = torch.zeros(8, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64)
        records = torch.zeros(1, dtype=torch.int64)
        results.append(lib.precis_cuda_resync_masters(masters, {F32}, params, {BF16}, numels,
                                                      stale.data_ptr(), kept.data_ptr(), 1, None))
        sums2, zeroed = torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        results.append(lib.precis_cuda_resync_compared(
            masters, {F32}, params, {BF16}, numels, records.data_ptr(), stale.data_ptr(),
            kept.data_ptr(), sums2.data_ptr(), zeroed.data_ptr(), 1, None))
    """)
    names, results, lines = run(body)
    assert results == [0] * len(results), results
    kernels = launched(names, lines)
    expected = []
    for dst in (F32, F16, BF16):
        for src in (F32, F16, BF16):
            expected.append(f"accumulate_kernel<{dst},{src}>")
            if dst != src:
                expected.append(f"cast_kernel<{dst},{src}>")
        expected += [f"scale_kernel<{dst}>", f"count_kernel<{4 if dst == F32 else 2}>"]
    expected += ["fingerprint_zero_kernel", "fingerprint_kernel"]
    expected += ["resync_init_kernel", "resync_count_kernel", "resync_write_kernel"]
    expected += ["compare_kernel", "resync_count_kernel", "resync_write_kernel"]
    assert kernels == expected
    # a cast to its own dtype is a copy, through the driver
    assert [line for line in lines if line.startswith("memcpy")] == ["memcpy 16388",
                                                                     "memcpy 8194",
                                                                     "memcpy 8194"]


@pytest.mark.parametrize("sm, image", [(80, "sm_80"), (86, "sm_86"), (87, "sm_86"),
                                       (89, "sm_89"), (90, "sm_90"), (100, "sm_100"),
                                       (103, "sm_100"), (120, "sm_120"), (121, "sm_120"),
                                       (110, "ptx"), (130, "ptx")])
def test_each_gpu_gets_its_architectures_cubin_else_the_ptx(sm, image):
    names, results, lines = run("results.append(lib.precis_cuda12_check())",
                                FAKE_CUDA_SM=str(sm))
    assert results == [0]
    assert lines == [f"load {image}"] * 3


@pytest.mark.parametrize("env, words", [
    (dict(LD_LIBRARY_PATH="/nonexistent"),
     "precis's CUDA kernels need the NVIDIA driver (libcuda.so.1, R530 or newer), which "
     "cannot be loaded"),
    (dict(FAKE_CUDA_DRIVER="12000"),
     "precis's CUDA kernels need an NVIDIA driver for CUDA 12.1 (R530) or newer; this driver "
     "supports CUDA 12.0: update the driver, or keep precis's tensors on the CPU"),
    (dict(FAKE_CUDA_SM="75"),
     "precis's CUDA kernels need a GPU of compute capability 8.0 (A100) or newer; cuda:0 "
     "(Fake GPU) is 7.5"),
    (dict(FAKE_CUDA_NO_CONTEXT="1"), "no current CUDA context"),
])
def test_where_it_cannot_run_one_line_says_why(env, words):
    """At the first launch: the call fails with PRECIS_ERR_CUDA, its message names the
    function and what was found and is needed, nothing is loaded or launched."""
    body = STEP + f"step({list(POLICIES[3])})\nresults.append(int(lib.precis_cuda12_check()))\n"
    names, results, lines = run(body, **env)
    (st, message), check = results
    assert st == _lib.ERR_CUDA and check == _lib.ERR_CUDA
    assert message.startswith("precis_cuda_step: ") and words in message, message
    assert "\n" not in message
    assert not [line for line in lines if line.startswith(("load", "launch"))]


def test_the_driver_floor_is_what_the_docs_say():
    """README and guide name the floor driver.h checks (R530, CUDA 12.1) and the six
    architectures."""
    root = os.path.dirname(os.path.dirname(PY_DIR))
    header = open(os.path.join(root, "cuda", "driver.h")).read()
    assert '#define PR_DRIVER_MIN_CUDA 12010' in header
    assert '#define PR_DRIVER_MIN_RELEASE "R530"' in header
    for doc in ("README.md", os.path.join("docs", "guide.md")):
        text = open(os.path.join(root, doc)).read()
        assert "R530" in text and "CUDA 12.1" in text, doc
        assert "sm_80, sm_86, sm_89, sm_90, sm_100 and sm_120" in text, doc


def test_the_toolchain_pins_agree():
    """`pip install .` (tools/wheel/precis_backend.py) installs the CUDA 12 toolchain the
    set-up pins (tools/setup.sh): the same packages at the same versions."""
    root = os.path.dirname(os.path.dirname(PY_DIR))
    setup = open(os.path.join(root, "tools", "setup.sh")).read()
    backend = open(os.path.join(root, "tools", "wheel", "precis_backend.py")).read()
    pins = re.findall(r"(nvidia-cuda-(?:nvrtc|nvcc)-cu12==[\d.]+)", setup)
    assert len(pins) == 2, pins
    assert re.search(r"CUDA12_TOOLCHAIN = \[(.*)\]", backend).group(1) == ", ".join(
        f'"{p}"' for p in pins)

