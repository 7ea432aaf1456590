#!/usr/bin/env python3
"""Registers and spills of every CUDA kernel, from ptxas, without a GPU.

Builds libprecis_cuda.so with tools/build_cuda.sh (the flags CI and
tools/gpu_check.sh build with) and PRECIS_CUDA_RESOURCE_USAGE=1 (or, with --cuda12,
libprecis_cuda12.so with tools/build_cuda12.py --resource-usage: NVRTC's ptxas for its
six architectures, from the pinned packages at .venv/cuda12), reads ptxas's
report of each kernel for each SASS target, prints a table, and fails when a kernel
spills registers to local memory, except the generic update kernel (dtypes read
at run time, template arguments -1), whose spill is reported (as a skipped case)
but allowed: it serves only the rare dtype combinations.

    tools/kernel_resources.py [--cuda12] [--log PTXAS_OUTPUT] [--junit DIR] [--markdown]

--log parses a saved build output instead of building; --junit writes DIR/test.xml
(one case per kernel and target, counted by tools/count_tests.py); --markdown prints
the table for bench/RESULTS.md. Exit status 1 on any failure.
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"-1": "*", "0": "fp32", "1": "fp16", "2": "bf16", "3": "fp8", "4": "int16"}
MODES = {"-1": "*", "0": "own", "1": "master", "2": "remainder", "3": "remainder8"}  # PR_MASTER_*
GENERIC = "adam_kernel<*,*,*,*,*,*>"
# Spills seen and allowed, each with why: NVRTC 12.9's ptxas for sm_120 (RTX 50xx) spills
# 4 bytes in the two fp16-moment kernels at 128 registers (2 blocks of 256 threads an SM);
# they serve bench/policies.py's fp16-moment rows, not an advertised policy. Whether one
# block an SM (no spill) is faster there waits for an sm_120 GPU.
ALLOWED_SPILLS = {
    ("sm_120", "adam_kernel<bf16,bf16,master,fp32,fp16,fp16>"): "sm_120, fp16 moments",
    ("sm_120", "adam_kernel<fp32,fp32,own,fp32,fp16,fp16>"): "sm_120, fp16 moments",
}

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
PROPS = re.compile(r"Function properties for (\S+)")
SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def build_log_cuda12():
    """The output of libprecis_cuda12.so's resource-usage build (NVRTC's ptxas logs)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_cuda12.py"),
                              os.path.join(tmp, "libprecis_cuda12.so"), "--resource-usage",
                              "--toolchain", os.path.join(ROOT, ".venv", "cuda12")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        sys.stdout.write(run.stdout)
        raise subprocess.CalledProcessError(run.returncode, "tools/build_cuda12.py")
    return run.stdout


def build_log():
    """The output of a resource-usage build; raises CalledProcessError on failure."""
    sources = sorted(glob.glob(os.path.join(ROOT, "cuda", "*.cu"))) + [
        os.path.join(ROOT, p) for p in ("csrc/include/precis/precis.h", "csrc/errors.c",
                                        "csrc/dtype.c", "csrc/exports.lds")]
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([os.path.join(ROOT, "tools", "build_cuda.sh"),
                              os.path.join(tmp, "libprecis_cuda.so"), *sources],
                             env={**os.environ, "PRECIS_CUDA_RESOURCE_USAGE": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        sys.stdout.write(run.stdout)
        raise subprocess.CalledProcessError(run.returncode, "tools/build_cuda.sh")
    return run.stdout


def parse(text):
    """[{mangled, arch, registers, stack, spill_stores, spill_loads}] of each entry
    function, in ptxas's order. Device functions (not entries) are left out."""
    kernels, current, props_of = [], None, None
    for line in text.splitlines():
        if m := ENTRY.search(line):
            current = {"mangled": m.group(1), "arch": m.group(2)}
            kernels.append(current)
            props_of = None
        elif m := PROPS.search(line):
            props_of = m.group(1)
        elif (m := SPILL.search(line)) and current and props_of == current["mangled"]:
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif (m := USED.search(line)) and current and "registers" not in current:
            current["registers"] = int(m.group(1))
    return kernels


def pretty(names):
    """Readable kernel names: demangled, namespaces and parameters dropped, the
    update kernel's template arguments as dtypes (grad, param, master mode, master,
    m, v), a bucket op's as dtypes."""
    demangled = subprocess.run(["c++filt"], input="\n".join(names), stdout=subprocess.PIPE,
                               text=True, check=True).stdout.splitlines()
    out = []
    for name in demangled:
        name = name.removeprefix("void ").replace("(anonymous namespace)::", "").split("(")[0]
        base, _, args = name.partition("<")
        base = base.rsplit("::", 1)[-1]  # precis::step_cu::adam_kernel: adam_kernel
        args = args.rstrip(">").split(", ") if args else []
        if base == "adam_kernel" and len(args) == 6:
            args = [DTYPES[a] if i != 2 else MODES[a] for i, a in enumerate(args)]
        elif base == "count_kernel":  # its argument is the element's width
            args = [f"{a} bytes" for a in args]
        elif args and all(a in DTYPES for a in args):
            args = [DTYPES[a] for a in args]
        out.append(f"{base}<{','.join(args)}>" if args else base)
    return out


def check(kernels):
    """(failures, notes): a message per failed check, per allowed spill."""
    failures, notes = [], []
    if not kernels:
        return ["ptxas reported no kernel (no --resource-usage output?)"], notes
    for k in kernels:
        if "registers" not in k or "spill_stores" not in k:
            failures.append(f"{k['arch']} {k['name']}: ptxas's report is incomplete")
            continue
        spill = k["spill_stores"] + k["spill_loads"]
        allowed = ("the generic kernel" if k["name"] == GENERIC
                   else ALLOWED_SPILLS.get((k["arch"], k["name"])))
        if spill and allowed:
            notes.append(f"{k['arch']} {k['name']}: spills {k['spill_stores']} bytes "
                         f"(stores), {k['spill_loads']} (loads); allowed for {allowed}")
        elif spill:
            failures.append(f"{k['arch']} {k['name']}: spills {k['spill_stores']} bytes "
                            f"(stores), {k['spill_loads']} (loads), {k['registers']} registers")
    by_arch = {}
    for k in kernels:
        by_arch.setdefault(k["arch"], set()).add(k["name"])
    sets = list(by_arch.values())
    if any(s != sets[0] for s in sets):
        failures.append("the targets do not compile the same kernels: "
                        + "; ".join(f"{a}: {len(s)}" for a, s in by_arch.items()))
    if GENERIC not in sets[0]:
        failures.append(f"no {GENERIC} found: the names are not what this check expects")
    return failures, notes


def table(kernels, markdown):
    archs = sorted({k["arch"] for k in kernels})
    names = list(dict.fromkeys(k["name"] for k in kernels))
    cell = {(k["name"], k["arch"]): k for k in kernels}
    head = ["kernel"] + [f"{a} regs / spill B" for a in archs]
    rows = []
    for n in names:
        row = [n]
        for a in archs:
            k = cell.get((n, a))
            row.append("-" if k is None or "registers" not in k else
                       f"{k['registers']} / {k.get('spill_stores', '?')}")
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| `" + r[0] + "` | " + " | ".join(r[1:]) + " |" for r in rows]
    else:
        width = max(len(n) for n in names)
        lines = [f"{head[0]:<{width}}" + "".join(f"{h:>22}" for h in head[1:])]
        lines += [f"{r[0]:<{width}}" + "".join(f"{c:>22}" for c in r[1:]) for r in rows]
    return "\n".join(lines)


def write_junit(path, kernels, failures, notes, build_error=None):
    suite = ET.Element("testsuite", name="kernel_resources")
    if build_error:
        case = ET.SubElement(suite, "testcase", classname="kernel_resources", name="build")
        ET.SubElement(case, "failure", message=build_error)
    for k in kernels:
        label = f"{k['arch']} {k['name']}"
        case = ET.SubElement(suite, "testcase", classname="kernel_resources", name=label)
        mine = [f for f in failures if f.startswith(label + ":")]
        noted = [n for n in notes if n.startswith(label + ":")]
        if mine:
            ET.SubElement(case, "failure", message="; ".join(mine))
        elif noted:
            ET.SubElement(case, "skipped", message="; ".join(noted))
    general = [f for f in failures if not any(f.startswith(f"{k['arch']} {k['name']}:")
                                              for k in kernels)]
    for i, f in enumerate(general):
        case = ET.SubElement(suite, "testcase", classname="kernel_resources", name=f"check {i}")
        ET.SubElement(case, "failure", message=f)
    os.makedirs(path, exist_ok=True)
    ET.ElementTree(suite).write(os.path.join(path, "test.xml"), encoding="unicode",
                                xml_declaration=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--log", help="parse this saved build output instead of building")
    ap.add_argument("--junit", metavar="DIR", help="write DIR/test.xml")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--cuda12", action="store_true", help="libprecis_cuda12.so's kernels")
    args = ap.parse_args()
    try:
        text = (open(args.log).read() if args.log else
                build_log_cuda12() if args.cuda12 else build_log())
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"kernel_resources: {e}", file=sys.stderr)
        if args.junit:
            write_junit(args.junit, [], [], [], build_error=str(e))
        return 1
    kernels = parse(text)
    for k, name in zip(kernels, pretty([k["mangled"] for k in kernels])):
        k["name"] = name
    failures, notes = check(kernels)
    if kernels:
        print(table(kernels, args.markdown))
    for n in notes:
        print(f"note: {n}")
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    print(f"kernel_resources: {len(kernels)} kernel builds, {len(failures)} failures, "
          f"{len(notes)} allowed spills")
    if args.junit:
        write_junit(args.junit, kernels, failures, notes)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
