#!/usr/bin/env python3
"""Builds libprecis_cuda12.so: the CUDA kernels for every driver from R525 (CUDA 12.0) on.

    build_cuda12.py OUT --toolchain DIR [--resource-usage] [--keep DIR]
                    [--arch SM]... [--define NAME=VALUE]...

DIR is the `nvidia` folder of the pinned PyPI packages (tools/setup.sh links .venv/cuda12
to it): NVRTC 12.9 (nvidia-cuda-nvrtc-cu12) compiles the device code of cuda/*.cu to a
cubin for each architecture in ARCHS and to one PTX for compute_80, whose ISA version is
set to PTX_ISA (CUDA 12.0's, so that an R525 driver JITs it for a GPU newer than every
cubin) and checked by ptxas (nvidia-cuda-nvcc-cu12), which refuses an instruction that
ISA does not have. g++ compiles the host code of the same files (PRECIS_CUDA_DRIVER:
launches through the driver API, cuda/driver.c), and the images go in as read-only data
(.incbin). The library links no CUDA library: libcuda.so.1 is opened at the first launch.

Each kernel is found by its PTX entry, demangled by c++filt into the name the host code
launches it by ("adam_kernel<2,2,1,0,2,2>", cuda/driver_launch.h). --resource-usage
prints ptxas's registers and spills of every kernel for every architecture (NVRTC's
--ptxas-options=--verbose; tools/kernel_resources.py reads it). Stdlib only: Bazel's
genrule runs it with the system python3.
"""
import argparse
import concurrent.futures
import ctypes
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = (80, 86, 89, 90, 100, 120)  # A100, RTX 30xx/A10, L4/L40/RTX 40xx, H100/H200, B200, RTX 50xx
PTX_ARCH = 80
PTX_ISA = "8.1"  # CUDA 12.1's PTX ISA (R530): the first with kernel parameters over 4 KiB
MODULES = ("step.cu", "bucket_ops.cu", "resync.cu")
HOST_SOURCES = ("csrc/errors.c", "csrc/dtype.c", "cuda/driver.c")
# As tools/build_cuda.sh: -fmad=false keeps every a*b + c rounded twice unless the code
# writes an FMA (the CPU kernels' bits); the rest as nvcc's device defaults (-O3).
NVRTC_FLAGS = ["-std=c++17", "--fmad=false", "-default-device", "-DNDEBUG"]
HOST_FLAGS = ["-O2", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror"]


class Nvrtc:
    """The few NVRTC calls of a compile, through ctypes."""

    def __init__(self, toolchain):
        self.lib = ctypes.CDLL(os.path.join(toolchain, "cuda_nvrtc", "lib", "libnvrtc.so.12"))

    def compile(self, path, options):
        """(image bytes, log): a cubin for -arch=sm_XX, PTX for compute_XX; raises on error."""
        lib, prog = self.lib, ctypes.c_void_p()
        source = open(path, "rb").read()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source, path.encode(), 0, None,
                                           None), "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            log = self._read(prog, "ProgramLog").decode(errors="replace").strip("\0").strip()
            if status != 0:
                raise RuntimeError(f"NVRTC could not compile {path} ({' '.join(options)}):\n{log}")
            ptx = any(o.startswith("-arch=compute_") for o in options)
            return self._read(prog, "PTX" if ptx else "CUBIN"), log
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def version(self):
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return f"{major.value}.{minor.value}"

    def _read(self, prog, what):
        size = ctypes.c_size_t()
        self._check(getattr(self.lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)), what)
        buf = ctypes.create_string_buffer(size.value)
        self._check(getattr(self.lib, f"nvrtcGet{what}")(prog, buf), what)
        return buf.raw

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise RuntimeError(f"{what} failed: NVRTC status {status}")


def nvrtc_options(arch):
    inc = [f"-I{os.path.join(ROOT, d)}" for d in ("cuda/nvrtc_include", "csrc/include", "csrc",
                                                  "cuda")]
    return [arch] + NVRTC_FLAGS + inc


def warnings_of(log):
    """NVRTC's warnings (as -Werror all-warnings: tools/build_cuda.sh fails on any)."""
    return [line for line in log.splitlines() if "warning" in line]


def set_ptx_isa(ptx):
    """The PTX with its .version set to PTX_ISA (ptxas then refuses what that ISA lacks)."""
    text, n = re.subn(rb"^\.version \d+\.\d+$", b".version " + PTX_ISA.encode(), ptx,
                      count=1, flags=re.M)
    if n != 1:
        raise RuntimeError("NVRTC's PTX has no .version line")
    return text.rstrip(b"\0") + b"\0"


def kernel_names(ptx):
    """[(launch name, PTX symbol)] of every .entry of the PTX."""
    symbols = re.findall(rb"^(?:\.(?:visible|weak) )?\.entry (\S+)\(", ptx, flags=re.M)
    if len(symbols) != ptx.count(b".entry "):
        raise RuntimeError("an .entry of the PTX is not in the form this script reads")
    symbols = [s.decode() for s in symbols]
    demangled = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True,
                               text=True, check=True).stdout.splitlines()
    names = []
    for symbol, full in zip(symbols, demangled):
        # "void precis::(anonymous namespace)::adam_kernel<2, 2, ...>(precis::...)"
        head = full.replace("(anonymous namespace)::", "").split("(", 1)[0]
        m = re.fullmatch(r"(?:void )?(?:\w+::)*(\w+)(<[^<>]*>)?", head)
        if not m:
            raise RuntimeError(f"cannot read the kernel name of {symbol} ({full})")
        names.append((m.group(1) + (m.group(2) or "").replace(" ", ""), symbol))
    return names


def c_string(s):
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_tables(tmp, images, kernels):
    """cuda12_images.S (the images, .incbin) and cuda12_tables.c (driver.h's tables)."""
    asm = ['.section .rodata']
    for i, (module, sm, path) in enumerate(images):
        asm += [f".globl pr_image_{i}", f".hidden pr_image_{i}", ".balign 16", f"pr_image_{i}:",
                f'.incbin "{path}"']
    asm.append('.section .note.GNU-stack,"",@progbits')
    with open(os.path.join(tmp, "cuda12_images.S"), "w") as f:
        f.write("\n".join(asm) + "\n")
    c = ["/* Generated by tools/build_cuda12.py. */", '#include "driver.h"', ""]
    for i in range(len(images)):
        c.append(f"extern const unsigned char pr_image_{i}[];")
    c.append("const char* const pr_driver_modules[] = {"
             + ", ".join(c_string(m) for m in MODULES) + "};")
    c.append(f"const int pr_driver_module_count = {len(MODULES)};")
    c.append("const pr_driver_image_t pr_driver_images[] = {")
    for i, (module, sm, _) in enumerate(images):
        c.append(f"    {{{module}, {sm}, pr_image_{i}, {os.path.getsize(images[i][2])}}},")
    c.append("};")
    c.append(f"const int pr_driver_image_count = {len(images)};")
    c.append("const pr_driver_kernel_t pr_driver_kernels[] = {")
    for module, name, symbol in kernels:
        c.append(f"    {{{module}, {c_string(name)}, {c_string(symbol)}}},")
    c.append("};")
    c.append(f"const int pr_driver_kernel_count = {len(kernels)};")
    with open(os.path.join(tmp, "cuda12_tables.c"), "w") as f:
        f.write("\n".join(c) + "\n")


def compile_job(job):
    """compile_image in a worker process, with its own NVRTC."""
    toolchain, tmp, m, sm, resource_usage, reuse, defines = job
    ptxas = os.path.join(toolchain, "cuda_nvcc", "bin", "ptxas")
    return compile_image(Nvrtc(toolchain), ptxas, tmp, m, sm, resource_usage, reuse, defines)


def compile_image(nvrtc, ptxas, tmp, m, sm, resource_usage, reuse, defines=()):
    """(path, NVRTC's log) of module m's cubin for sm, or its PTX (sm 0), checked."""
    module = MODULES[m]
    src = os.path.join(ROOT, "cuda", module)
    stem = os.path.splitext(module)[0]
    path = os.path.join(tmp, f"{stem}.sm_{sm}.cubin" if sm else f"{stem}.compute_{PTX_ARCH}.ptx")
    if reuse and os.path.exists(path):
        return path, ""
    opts = nvrtc_options(f"-arch=sm_{sm}" if sm else f"-arch=compute_{PTX_ARCH}")
    opts += [f"-D{d}" for d in defines]
    if resource_usage and sm:
        opts.append("--ptxas-options=--verbose")
    image, log = nvrtc.compile(src, opts)
    if warnings_of(log) and not resource_usage:
        raise RuntimeError(f"NVRTC warned on {module} ({opts[0]}):\n{log}")
    if not sm:
        image = set_ptx_isa(image)
    with open(path, "wb") as f:
        f.write(image)
    if not sm:
        check = subprocess.run([ptxas, f"-arch=sm_{PTX_ARCH}", path, "-o", os.devnull],
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"ptxas refuses {module}'s PTX at ISA {PTX_ISA}:\n{check.stderr}")
    return path, log


def build(out, toolchain, resource_usage=False, keep=None, reuse=False, archs=ARCHS,
          defines=()):
    if keep:
        os.makedirs(keep, exist_ok=True)
        return build_in(keep, out, toolchain, resource_usage, reuse, archs, defines)
    with tempfile.TemporaryDirectory(prefix="precis_cuda12_") as tmp:
        return build_in(tmp, out, toolchain, resource_usage, False, archs, defines)


def build_in(tmp, out, toolchain, resource_usage, reuse, archs=ARCHS, defines=()):
    jobs = [(m, sm) for m in range(len(MODULES)) for sm in tuple(archs) + (0,)]
    # One process a compile: NVRTC compiles in threads of one process gave other registers
    # and spills than alone (ptxas's state is shared); processes share nothing.
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = list(pool.map(compile_job, [(toolchain, tmp, m, sm, resource_usage, reuse,
                                            tuple(defines)) for m, sm in jobs]))
    images = [(m, sm, path) for (m, sm), (path, _) in zip(jobs, done)
              if sm or tuple(archs) == ARCHS]  # (a library for some GPUs only: no PTX)
    kernels = []
    for (m, sm), (path, log) in zip(jobs, done):
        if resource_usage and sm:
            print(f"## {MODULES[m]} sm_{sm}\n{log}")
        if sm == 0:
            with open(path, "rb") as f:
                kernels += [(m, name, symbol) for name, symbol in kernel_names(f.read())]
    write_tables(tmp, images, kernels)

    inc = ["-I" + os.path.join(ROOT, d) for d in ("csrc/include", "csrc", "cuda")]
    compiles = [["g++", "-std=c++17", "-x", "c++", "-DPRECIS_CUDA_DRIVER",
                 os.path.join(ROOT, "cuda", module)] for module in MODULES]
    compiles += [["gcc", "-std=c11", os.path.join(ROOT, src)] for src in HOST_SOURCES]
    compiles += [["gcc", os.path.join(tmp, name)] for name in ("cuda12_tables.c",
                                                              "cuda12_images.S")]
    objs = []
    for cmd in compiles:
        objs.append(os.path.join(tmp, os.path.basename(cmd[-1]) + ".o"))
        subprocess.run(cmd[:-1] + HOST_FLAGS + inc + ["-c", cmd[-1], "-o", objs[-1]], check=True)
    subprocess.run(["g++", "-shared", "-o", out, *objs,
                    f"-Wl,--version-script={os.path.join(ROOT, 'csrc', 'exports.lds')}",
                    "-Wl,-Bsymbolic", "-Wl,-z,noexecstack", "-ldl", "-pthread"], check=True)
    return Nvrtc(toolchain).version(), len(images), len(kernels)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--toolchain", required=True, help="the pinned packages' nvidia/ folder")
    ap.add_argument("--resource-usage", action="store_true")
    ap.add_argument("--keep", help="keep the images and objects in this folder")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: take the images found there (a change of host code only)")
    ap.add_argument("--arch", type=int, action="append", choices=ARCHS,
                    help="only this SASS target and no PTX (repeatable: a library for "
                    "those GPUs only, bench/kernel_variants.py's); default: all of ARCHS")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a macro for the device code (cuda/step.cu's PR_ADAM_* knobs)")
    args = ap.parse_args()
    archs = tuple(args.arch or ARCHS)
    version, n_images, n_kernels = build(os.path.abspath(args.out), args.toolchain,
                                         args.resource_usage, args.keep, args.reuse, archs,
                                         args.define)
    ptx = f"one PTX of ISA {PTX_ISA}" if archs == ARCHS else "no PTX"
    print(f"build_cuda12: NVRTC {version}, {n_images} images ({len(archs)} cubins and {ptx} "
          f"for each of {len(MODULES)} modules), {n_kernels} kernels", file=sys.stderr)


if __name__ == "__main__":
    main()
