#!/usr/bin/env python3
"""How close each fused Adam kernel can come to a device-to-device copy, read from its
SASS, without a GPU (docs/design.md section 7, "The SASS budget").

Compiles cuda/step.cu as libprecis_cuda12.so's kernels are compiled (NVRTC 12.9 from
.venv/cuda12, tools/build_cuda12.py's flags; sm_80, sm_90, sm_100), or takes a built
library (--library: libprecis_cuda12.so's images, precis_cuda12_image, or
libprecis_cuda.so's cubins by cuobjdump), and disassembles the cubins (nvdisasm -json;
registers and shared memory from cuobjdump -res-usage). For every update kernel
adam_kernel<grad, param, master mode, master, m, v> and SASS target it:

  * finds the hot loop: of the loops with a 128-bit global load, the one whose common
    path takes the fewest run-time decisions (cuda/step.cu's loop over whole vector
    groups without AMSGrad takes none);
  * takes the common path through it: the shortest path from the loop's head to its
    back edge that calls nothing (IEEE sqrt and division call a slow path only for
    special inputs), and the same from the kernel's entry to the loop's head (the
    prologue, once per warp and CUDA block);
  * counts that path's instructions per element by pipe: a warp instruction serves 32
    threads, a loop iteration 32 * kPer elements, the prologue a warp's share of a
    block (cuda/step.cu's constants);
  * takes the bytes per element from the dtypes (what the step reads and writes);
  * predicts, per GPU, the time per element of each limit (memory bandwidth, issue
    slots, each pipe), the bound (the largest) and the fraction of a copy of the same
    bytes the kernel can reach: memory time / bound time (100%: memory-bound), which
    assumes the arithmetic overlaps the memory perfectly; and, the other end, the
    fraction with no overlap at all ("serial": memory time / (memory time + the
    busiest other limit's)). The H200 measured the fp8 moment kernels near the serial
    figure and the others between the two (bench/RESULTS.md);
  * predicts, for the H200 at 1B params, where between the two ends a kernel lands
    (calibrated, below): fit on the kernels an H200 measured (tools/sass_calibration.json);
  * counts the reads in flight per SM (Little's law, in_flight and little below): the
    resident warps (registers and shared memory) times a warp's mean bytes loaded and
    not yet used over the hot loop, against the H200's bandwidth x latency (x the read
    share) per SM. A warp that loads and waits has its loads in flight for a few
    instructions of the loop; one that copies the next group ahead (cp.async), nearly
    all of them.

The GPU figures and pipe rates are in GPUS and RATES below, with their sources. Every
policy in ADVERTISED (those the README, the demo and the benches name) must have its
own kernel, a hot loop that decides nothing at run time, a predicted fraction of at
least --threshold on H100 and enough reads in flight for the H200;
tests/py/tools/test_sass_budget.py runs this check in CI (one case per policy) and checks
ADVERTISED against those files.

    tools/sass_budget.py [--library LIB] [-D NAME=VALUE] [--json FILE] [--markdown]
                         [--threshold 0.90]

Exit status 1 when a check fails or a tool is missing.
"""
import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THRESHOLD = 0.90  # of a copy, predicted on H100, for every advertised kernel (design.md 7)
PINS = "nvidia-cuda-cuobjdump==13.2.86 nvidia-cuda-nvdisasm==13.2.86"  # tools/setup.sh

# The dtype codes of precis.h and the master modes of csrc/step_args.h, as the
# kernel's template arguments spell them.
DTYPES = {-1: "*", 0: "fp32", 1: "fp16", 2: "bf16", 3: "fp8", 4: "int16"}
SIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int16": 2}
MODES = {-1: "*", 0: "own", 1: "master", 2: "remainder", 3: "remainder8"}

# Every policy that the README (its policy table), the demo (examples/train_demo.py)
# and the benches (bench/policies.py, adam_cuda.py, moment_fidelity.py, train_llm.py,
# fsdp_bytes.py) name, as the kernel it steps with: (grad, param, master mode, master,
# m, v) -> name. tests/py/tools/test_sass_budget.py resolves those files' policies and checks
# that this list holds exactly their kernels.
ADVERTISED = {
    ("fp32", "fp32", "own", "fp32", "fp32", "fp32"): "fp32",
    ("bf16", "bf16", "master", "fp32", "bf16", "bf16"): "bf16 default",
    ("fp32", "bf16", "master", "fp32", "bf16", "bf16"): "bf16 default, fp32 grads",
    ("bf16", "bf16", "remainder", "int16", "bf16", "bf16"): "bf16 int16 remainders",
    ("bf16", "bf16", "master", "fp32", "fp8", "fp8"): "bf16 fp8 moments",
    ("bf16", "bf16", "remainder", "int16", "fp8", "fp8"): "fp8 m, v + int16 remainders",
    ("bf16", "bf16", "remainder8", "fp8", "fp8", "fp8"): "fp8 m, v + 8-bit remainders",
    ("bf16", "bf16", "master", "fp32", "fp16", "fp16"): "bf16 fp16 moments",
    ("bf16", "bf16", "master", "fp32", "fp32", "fp32"): "bf16 fp32 moments",
    ("fp32", "fp16", "master", "fp32", "fp32", "fp32"): "fp16 default, fp32 grads",
    ("fp16", "fp16", "master", "fp32", "fp32", "fp32"): "fp16 default",
    ("fp32", "fp32", "own", "fp32", "bf16", "bf16"): "fp32 bf16 moments",
    ("fp32", "fp32", "own", "fp32", "fp16", "fp16"): "fp32 fp16 moments",
    ("fp32", "fp32", "own", "fp32", "fp8", "fp8"): "fp32 fp8 moments",
}

# The GPUs, from NVIDIA's datasheets: dense FP32 TFLOPS and memory bandwidth (the
# H100 SXM5 80 GB, the H200 SXM 141 GB: the H100's SMs and clock with HBM3e, the A100
# SXM4 80 GB, one GPU of an HGX B200). The model needs SMs x
# clock only as a product, which the FP32 figure gives: TFLOPS / 2 (an FMA is 2 flops)
# / FP32 lanes per SM (the CUDA C++ Programming Guide's throughput table: 64 on compute
# capability 8.0, 128 on 9.0 and 10.0). H100: 132 SMs x 1.98 GHz; A100: 108 x 1.41 GHz.
# B200: libprecis_cuda12.so has its sm_100 SASS; libprecis_cuda.so runs the compute_90
# PTX through the driver's JIT there, so its sm_90 SASS stands in (a proxy, never a check).
GPUS = {
    "H100": {"arch": "sm_90", "tflops": 66.9, "tb_per_s": 3.35, "fp32_lanes": 128},
    "H200": {"arch": "sm_90", "tflops": 66.9, "tb_per_s": 4.8, "fp32_lanes": 128},
    "A100": {"arch": "sm_80", "tflops": 19.5, "tb_per_s": 2.039, "fp32_lanes": 64},
    "B200": {"arch": "sm_100", "proxy": "sm_90", "tflops": 75.0, "tb_per_s": 7.7,
             "fp32_lanes": 128},
}

# Results per clock per SM by pipe (CUDA C++ Programming Guide, "Arithmetic
# Instructions" throughput table, compute capability 8.0 and 9.0; which opcode runs on
# which pipe: Nsight Compute's Kernel Profiling Guide, "Pipelines"). fma: FP32
# add/multiply/FMA and IMAD share it; imad: IMAD alone runs at 64 (Hopper's FMA-heavy
# half); alu: integer add, logic, shifts, compares, selects; xu: MUFU (rsqrt, rcp) and
# conversions; shfl: warp shuffles; issue: 4 schedulers x 1 warp instruction x 32.
RATES = {
    "sm_80": {"fma": 64, "imad": 64, "alu": 64, "xu": 16, "shfl": 32, "fp64": 32, "issue": 128},
    "sm_90": {"fma": 128, "imad": 64, "alu": 64, "xu": 16, "shfl": 32, "fp64": 64, "issue": 128},
    # compute capability 10.0: the same table as 9.0 for these pipes
    "sm_100": {"fma": 128, "imad": 64, "alu": 64, "xu": 16, "shfl": 32, "fp64": 64, "issue": 128},
}

# Opcode (before its first dot) -> pipe. "mem" and "other" take issue slots only (the
# bytes are the memory's limit; branches, uniform and special-register ops are cheap).
PIPES = {
    "fma": "FADD FMUL FFMA FADD32I FMUL32I FFMA32I HADD2 HMUL2 HFMA2",
    "imad": "IMAD IMUL IMAD32I IMUL32I",
    "alu": ("IADD3 IADD IADD32I IABS LOP3 LOP LOP32I SHF SHL SHR ISETP ICMP SEL FSEL FSETP "
            "FMNMX IMNMX VIMNMX VIMNMX3 VIADD VIADDMNMX LEA PRMT BFE BFI SGXT BMSK P2R R2P "
            "PLOP3 MOV MOV32I FCHK ISCADD CSET CSETP"),
    "xu": "MUFU I2F F2I F2F I2I I2FP F2IP F2FP FRND POPC FLO BREV",
    "shfl": "SHFL",
    "fp64": "DADD DMUL DFMA DSETP",
    "mem": "LDG STG LD ST LDS STS LDL STL LDC ATOM ATOMG ATOMS RED LDGSTS LDGDEPBAR",
    "other": ("BRA BRX JMP JMX CALL RET EXIT BSSY BSYNC WARPSYNC ENDCOLLECTIVE BAR MEMBAR "
              "ERRBAR DEPBAR NOP VOTE VOTEU S2R S2UR CS2R R2UR YIELD BPT KILL NANOSLEEP LDCU"),
}
PIPE_OF = {op: pipe for pipe, ops in PIPES.items() for op in ops.split()}

KERNEL = re.compile(r"adam_kernelI((?:Li(?:n?\d+)E){6})E")
ARG = re.compile(r"Li(n?)(\d+)E")


# ---- tools and build ------------------------------------------------------------

def cuda_tool(name):
    """The path of cuobjdump or nvdisasm: the pip package's (nvidia/cu13/bin in this
    Python's site-packages, as tools/setup.sh installs it), else PATH's, else CUDA's."""
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        path = os.path.join(site, "nvidia", "cu13", "bin", name)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name) or shutil.which(os.path.join("/usr/local/cuda/bin", name))
    if not found:
        raise RuntimeError(f"{name} not found: tools/setup.sh installs it "
                           f"(.venv/bin/pip install {PINS})")
    return found


# One compile of cuda/step.cu (argv: out, sm, defines...), run in a process of its own.
COMPILE = """
import os, sys
sys.path.insert(0, os.path.join({root!r}, "tools"))
import build_cuda12
out, sm, defines = sys.argv[1], sys.argv[2], sys.argv[3:]
nvrtc = build_cuda12.Nvrtc(os.path.join({root!r}, ".venv", "cuda12"))
options = build_cuda12.nvrtc_options("-arch=sm_" + sm) + ["-D" + d for d in defines]
image, _ = nvrtc.compile(os.path.join({root!r}, "cuda", "step.cu"), options)
open(out, "wb").write(image)
"""


def compile_step(tmp, archs=(80, 90, 100), defines=()):
    """cuda/step.cu's cubins for archs in tmp, compiled as libprecis_cuda12.so's are
    (NVRTC 12.9 from .venv/cuda12, tools/build_cuda12.py's flags), plus -D defines: the
    update kernels without building a library (about a minute on 2 cores). One process a
    compile, as tools/build_cuda12.py: NVRTC in threads of one process allocates other
    registers. Raises RuntimeError with NVRTC's message on failure."""
    # The source tree (under Bazel, ROOT is the runfiles, whose files link into it), where
    # the headers and .venv/cuda12 are.
    code = COMPILE.format(root=os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    procs = [(sm, subprocess.Popen(
        [sys.executable, "-c", code, os.path.join(tmp, f"step.sm_{sm}.cubin"), str(sm),
         *defines], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
             for sm in archs]
    for sm, proc in procs:
        out = proc.communicate()[0]
        if proc.returncode != 0:
            raise RuntimeError(f"NVRTC 12.9 could not compile cuda/step.cu for sm_{sm} "
                               f"(tools/setup.sh installs it at .venv/cuda12):\n{out[-3000:]}")


def cuda12_images(library):
    """[(module, sm, bytes)] of libprecis_cuda12.so's cubins (its export
    precis_cuda12_image, cuda/driver.h; the PTX, sm 0, left out), or None for a library
    without it (libprecis_cuda.so). Loading it opens no CUDA library."""
    lib = ctypes.CDLL(os.path.abspath(library))
    if not hasattr(lib, "precis_cuda12_image"):
        return None
    lib.precis_cuda12_image.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                        ctypes.POINTER(ctypes.c_int),
                                        ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_size_t)]
    out = []
    for i in range(lib.precis_cuda12_image_count()):
        m, sm, data, size = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t()
        if lib.precis_cuda12_image(i, m, sm, data, size) == 1 and sm.value != 0:
            out.append((m.value, sm.value, ctypes.string_at(data.value, size.value)))
    return out


def extract_cubins(library, tmp):
    """Writes the library's cubins into tmp as NAME.sm_XX.cubin: libprecis_cuda12.so's
    images (NVRTC 12.9, the toolchain the kernels are tuned on), or what cuobjdump
    extracts of libprecis_cuda.so (nvcc 13)."""
    images = cuda12_images(library)
    if images is None:
        subprocess.run([cuda_tool("cuobjdump"), "-xelf", "all", os.path.abspath(library)],
                       cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        return
    for module, sm, data in images:
        with open(os.path.join(tmp, f"module{module}.sm_{sm}.cubin"), "wb") as f:
            f.write(data)


def disassemble(library, tmp):
    """{arch: [function]} of the library's cubins (None: those compile_step wrote in
    tmp); a function is nvdisasm's JSON object (function-name, sass-instructions), with
    "registers" and "shared" (bytes a block) added (cuobjdump -res-usage: what the
    function was allocated)."""
    if library is not None:
        extract_cubins(library, tmp)
    functions = {}
    for cubin in sorted(glob.glob(os.path.join(tmp, "*.cubin"))):
        arch = re.search(r"(sm_\d+)\.cubin$", cubin).group(1)
        if arch not in RATES:
            continue  # (sm_86, sm_89, sm_120: no GPU of the model's runs them)
        text = subprocess.run([cuda_tool("nvdisasm"), "-json", cubin], check=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True).stdout  # (sm_100: a warning of its ELF format)
        usage = subprocess.run([cuda_tool("cuobjdump"), "-res-usage", cubin], check=True,
                               stdout=subprocess.PIPE, text=True).stdout
        resources = {name: (int(reg), int(shared)) for name, reg, shared in re.findall(
            r"Function (\S+):\s*\n\s*REG:(\d+)\s.*?SHARED:(\d+)", usage)}
        fns = json.loads(text)[1]
        for fn in fns:
            fn["registers"], fn["shared"] = resources.get(fn["function-name"], (0, 0))
        functions.setdefault(arch, []).extend(fns)
    return functions


def kernel_constants():
    """kThreads, kPer and kChunkLog2 of cuda/step.cu: the elements a loop iteration and
    a warp's share of a CUDA block cover."""
    src = open(os.path.join(ROOT, "cuda", "step.cu")).read()
    get = lambda name: int(re.search(rf"constexpr int {name} = (\d+);", src).group(1))
    threads, per, chunk_log2 = get("kThreads"), get("kPer"), get("kChunkLog2")
    return {"per_iteration": 32 * per, "per_warp": (1 << chunk_log2) // (threads // 32),
            "threads": threads}


# ---- control flow -------------------------------------------------------------------

def instructions(function):
    """[(opcode, operands, predicate)]; instruction k sits at byte 16 * k."""
    return [(i["opcode"], i.get("operands", ""), i.get("predicate", ""))
            for i in function["sass-instructions"]]


def branch_target(op, operands):
    """The byte offset a branch jumps to, or None for any other instruction."""
    if op.split(".")[0] not in ("BRA", "JMP"):
        return None
    return int(operands.split(",")[-1].strip(), 16)


def blocks(ins):
    """Basic blocks as [(first, last)] instruction indices, and each one's successors
    [(block index)]: a block ends at a branch, an EXIT or RET, or before a target."""
    starts = {0}
    for k, (op, operands, pred) in enumerate(ins):
        target = branch_target(op, operands)
        if target is not None:
            starts.add(target // 16)
        if target is not None or op.split(".")[0] in ("EXIT", "RET"):
            starts.add(k + 1)
    starts = sorted(s for s in starts if s < len(ins))
    spans = [(s, (starts[i + 1] if i + 1 < len(starts) else len(ins)) - 1)
             for i, s in enumerate(starts)]
    index = {s: i for i, s in enumerate(starts)}
    succ = []
    for i, (first, last) in enumerate(spans):
        op, operands, pred = ins[last]
        name = op.split(".")[0]
        target = branch_target(op, operands)
        # conditional: a predicate other than @PT, or a predicate operand (BRA P3, L)
        conditional = (pred not in ("", "@PT")) or "," in operands
        out = []
        if target is not None:
            out.append(index[target // 16])
        if (target is None and name not in ("EXIT", "RET")) or \
                (conditional and name in ("BRA", "JMP", "EXIT", "RET")):
            if i + 1 < len(spans):
                out.append(i + 1)
        succ.append(out)
    return spans, succ


def shortest(spans, succ, ins, start, goal, allowed):
    """The block path start -> goal over forward edges inside `allowed` (block
    indices) that skips every block holding a CALL, fewest instructions first; None
    when there is none. Blocks are laid out in address order and forward edges only
    are followed, so this is a shortest path in a DAG."""
    cost = {start: spans[start][1] - spans[start][0] + 1}
    prev = {}
    for b in sorted(allowed):
        if b not in cost or b == goal:
            continue
        for s in succ[b]:
            if s <= b or s not in allowed or calls(spans[s], ins):
                continue
            c = cost[b] + spans[s][1] - spans[s][0] + 1
            if c < cost.get(s, float("inf")):
                cost[s], prev[s] = c, b
    if goal not in cost:
        return None
    path = [goal]
    while path[-1] != start:
        path.append(prev[path[-1]])
    return path[::-1]


def calls(span, ins):
    """Whether a block calls a subroutine (a slow path, pow): a CALL to a symbol. (sm_80
    code also calls an address of the kernel itself as a loop's exit: not a call.)"""
    return any(ins[k][0].startswith("CALL") and not ins[k][1].strip().startswith("0x")
               for k in range(span[0], span[1] + 1))


def forks(path, spans, succ, ins, body):
    """The run-time decisions on a path: its blocks' conditional branches between two
    blocks of the loop, neither of which calls a subroutine (a slow path's guard is
    not a decision: the common case never takes it)."""
    n = 0
    for b in path:
        out = [s for s in succ[b] if s in body]
        if len(succ[b]) == 2 and len(out) == 2 and not any(calls(spans[s], ins) for s in out):
            n += 1
    return n


def wide_load(op):
    """A 128-bit global load: into registers (LDG) or shared memory (LDGSTS, cp.async)."""
    return op.startswith("LDG.E.128") or (op.startswith("LDGSTS") and ".128" in op)


def hot_path(function):
    """(loop path, prologue path, forks on the loop path) of the kernel's hot loop: of
    the loops with a 128-bit global load, the one whose common path takes the fewest
    run-time decisions (the whole-group loop decides nothing; the general one decides
    vector or not, AMSGrad or not), then the shortest. Raises ValueError when none."""
    ins = instructions(function)
    spans, succ = blocks(ins)
    loops = []
    for b, (first, last) in enumerate(spans):
        for s in succ[b]:
            # a back edge: a branch to a block at or before its own
            if s <= b and branch_target(*ins[last][:2]) is not None and any(
                    wide_load(ins[k][0]) for k in range(spans[s][0], last + 1)):
                body = set(range(s, b + 1))
                path = shortest(spans, succ, ins, s, b, body)
                if path:
                    n = sum(spans[x][1] - spans[x][0] + 1 for x in path)
                    loops.append((forks(path, spans, succ, ins, body), n, path))
    if not loops:
        raise ValueError("no loop with a 128-bit global load and a path without calls")
    decisions, _, loop = min(loops)
    prologue = shortest(spans, succ, ins, 0, loop[0], set(range(loop[0] + 1)))
    if prologue is None:
        raise ValueError("no path without calls from the entry to the hot loop")
    take = lambda path: [ins[k] for b in path for k in range(spans[b][0], spans[b][1] + 1)]
    return take(loop), take(prologue[:-1]), decisions


def count(path):
    """{pipe: instructions} of a path; raises ValueError on an opcode of no pipe (the
    model must not drop what it does not know)."""
    n = {pipe: 0 for pipe in PIPES}
    for op, _, _ in path:
        base = op.split(".")[0]
        pipe = PIPE_OF.get(base) or ("other" if base.startswith("U") else None)
        if pipe is None:
            raise ValueError(f"opcode {op} has no pipe in tools/sass_budget.py's PIPES")
        n[pipe] += 1
    return n


# ---- loads in flight (Little's law) --------------------------------------------------

# A memory-bound kernel reaches the bandwidth only with bandwidth x latency bytes in
# flight (Little's law). The H200: 4.8 TB/s (GPUS) and a loaded HBM latency of 0.6-1 us
# (NVIDIA publishes none; the usual estimate for HBM3 / HBM3e under load): 1 us, the
# upper end, so a kernel that passes has margin. Only the reads
# must be in flight (a warp never waits for its stores): the read share of the bytes.
LATENCY_S = 1.0e-6
SMS = {"H100": 132, "H200": 132, "A100": 108}  # (the whitepapers; none published for B200)
# Per SM, compute capability 9.0 (CUDA C++ Programming Guide, "Technical Specifications
# per Compute Capability"): registers, warps, blocks, shared memory (228 KB, of which the
# system reserves 1 KB per block).
SM_LIMITS = {"registers": 65536, "warps": 64, "blocks": 32, "shared": 228 * 1024,
             "shared_reserved": 1024}
REG = re.compile(r"\bR(\d+)\b")


def load_width(op):
    """Bytes a lane loads with a global load (LDG.E.128: 16), into registers or (LDGSTS)
    shared memory, else 0."""
    if not op.startswith("LDG") or op.startswith("LDGDEPBAR"):
        return 0
    for suffix, n in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if suffix in op:
            return n
    return 4


def in_flight(loop):
    """(peak, mean, distance) of the hot loop's global loads: the most bytes a warp has
    loaded and not yet used at any point of an iteration, the mean of those bytes over
    the iteration's instructions (each load counts from
    its issue to the first instruction that reads one of its registers, the next
    iteration's too: a load issued a whole group ahead is in flight all the time; an
    asynchronous copy, LDGSTS, to the first wait for the copies, DEPBAR), and the
    fewest instructions between a load and its first use (a few: the warp waits for the
    memory right after issuing; about the loop's length: the next group is in flight while
    this one is computed)."""
    n = len(loop)
    loads = []  # (position, registers, lane bytes)
    for k, (op, operands, _) in enumerate(loop):
        width = load_width(op)
        if width and op.startswith("LDGSTS"):
            loads.append((k, None, width))
        elif width:
            first = int(REG.search(operands).group(1))
            loads.append((k, set(range(first, first + max(1, width // 4))), width))
    if not loads:
        return 0, 0.0, 0
    live = [0] * n
    distances = []
    for k, regs, width in loads:
        for step in range(1, n + 1):
            op, operands, _ = loop[(k + step) % n]
            if regs is None:
                if op.startswith("DEPBAR"):
                    break
                continue
            names = operands.split(",")
            sources = names if op.startswith(("ST", "RED", "ATOM")) else names[1:]
            if any(int(r) in regs for x in sources for r in REG.findall(x)):
                break
        distances.append(step)
        # a vector load moves its lanes' bytes; a 4-byte one in the hot loop is a block
        # scale, one address per half-warp: two 32-byte sectors
        moved = 32 * width if width >= 8 else 64
        for j in range(step):
            live[(k + j) % n] += moved
    return max(live), sum(live) / n, min(distances)


def occupancy(registers, threads, shared=0):
    """Resident warps per SM: blocks of `threads` that the registers (allocated per warp
    in units of 256), the warps, the blocks and the shared memory per SM allow."""
    per_warp = -(-registers * 32 // 256) * 256
    warps_per_block = threads // 32
    blocks = min(SM_LIMITS["registers"] // (per_warp * warps_per_block),
                 SM_LIMITS["warps"] // warps_per_block, SM_LIMITS["blocks"],
                 SM_LIMITS["shared"] // (shared + SM_LIMITS["shared_reserved"]))
    return blocks * warps_per_block


def little(row, gpu, threads):
    """{warps, have, need}: the read bytes an SM has in flight (resident warps x a warp's
    mean over its hot loop: a warp that loads a group, then computes it, has its loads in
    flight for a few of the loop's instructions only) against what the GPU needs (its
    bandwidth x the read share x LATENCY_S, per SM)."""
    g = GPUS[gpu]
    warps = occupancy(row["registers"], threads, row.get("shared", 0))
    have = warps * row["warp_in_flight"]
    need = g["tb_per_s"] * 1e12 * row["read_share"] * LATENCY_S / SMS[gpu]
    return {"warps": warps, "have": have, "need": need}


# ---- the model ----------------------------------------------------------------------

def kernel_dtypes(name):
    """(grad, param, mode, master, m, v) of an adam_kernel's mangled name, or None."""
    m = KERNEL.search(name)
    if not m or name.startswith("$"):
        return None
    args = [-int(d) if neg else int(d) for neg, d in ARG.findall(m.group(1))]
    return tuple(MODES[a] if i == 2 else DTYPES[a] for i, a in enumerate(args))


def bytes_per_element(dt):
    """What one element's step reads and writes, AMSGrad off: the gradient; the param
    (read too when it holds the master or its high half); the master or remainder; m
    and v, and for scaled moments (fp16, fp8) a 4-byte scale per 128 elements, each read
    and written."""
    grad, param, mode, master, m, v = dt
    total = SIZE[grad] + SIZE[param] * (1 if mode == "master" else 2)
    if mode == "master":
        total += 2 * SIZE[master]
    elif mode in ("remainder", "remainder8"):
        total += 2 * (2 if mode == "remainder" else 1)
    for d in (m, v):
        total += 2 * SIZE[d] + (2 * 4 / 128 if d in ("fp16", "fp8") else 0)
    return total


def read_bytes_per_element(dt):
    """What one element's step reads of bytes_per_element: all but the stores."""
    grad, param, mode, master, m, v = dt
    total = SIZE[grad] + (SIZE[param] if mode != "master" else 0)
    if mode == "master":
        total += SIZE[master]
    elif mode in ("remainder", "remainder8"):
        total += 2 if mode == "remainder" else 1
    for d in (m, v):
        total += SIZE[d] + (4 / 128 if d in ("fp16", "fp8") else 0)
    return total


def per_element(loop, prologue, constants):
    """Thread instructions per element by pipe: a warp instruction runs for its 32
    threads; an iteration covers 32 * kPer elements, the prologue a warp's share of a
    CUDA block."""
    a, b = count(loop), count(prologue)
    return {p: 32 * (a[p] / constants["per_iteration"] + b[p] / constants["per_warp"])
            for p in PIPES}


def predict(per, nbytes, gpu):
    """(fraction of a copy, bound, {limit: clocks per element per SM}); the arithmetic's
    share of the memory's time is max(t without "memory") / t["memory"]."""
    g = GPUS[gpu]
    rate = RATES[g["arch"]]
    sm_clocks_per_s = g["tflops"] * 1e12 / 2 / g["fp32_lanes"]
    t = {"memory": nbytes / (g["tb_per_s"] * 1e12 / sm_clocks_per_s),
         "issue": sum(per.values()) / rate["issue"],
         "fma": (per["fma"] + per["imad"]) / rate["fma"]}
    for pipe in ("imad", "alu", "xu", "shfl", "fp64"):
        t[pipe] = per[pipe] / rate[pipe]
    bound = max(t, key=t.get)
    return t["memory"] / t[bound], bound, t


# Where the H200's measured step at 1B params (~180-300 tensors a step) lands between the
# two ends, from a, the busiest limit but the memory's over the memory's time (arith/mem):
# time / memory time = max(1, a) + UNHIDDEN * min(1, a)^2. Below a = 1 the share of the
# arithmetic that no load overlaps grows with a (a warp loads its group, then computes
# with nothing in flight: the more it computes, the fewer warps are loading); above 1,
# UNHIDDEN of the memory's time is not hidden. UNHIDDEN: a round factor at the least
# largest error over the 16 measurements of tools/sass_calibration.json (two H200 runs,
# six kernels, a from 0.24 to 1.38; nvcc 13.0's SASS, applied to NVRTC 12.9's): 4.2
# points, 2.2 rms (bench/RESULTS.md, "The SASS model calibrated on the
# H200"). Not for 100M params in ~300 tensors (the grid's tail: near the serial end) nor
# for a loop that keeps loads in flight (PR_ADAM_STAGED=1: none was measured).
UNHIDDEN = 0.8
CALIBRATION = os.path.join(ROOT, "tools", "sass_calibration.json")


def calibrated(a):
    """The fraction of a copy a kernel whose arith/mem is a reaches on the H200 at 1B
    params, by the fit above."""
    return 1.0 / (max(1.0, a) + UNHIDDEN * min(1.0, a) ** 2)


def analyze(functions, constants):
    """One row per (kernel, arch): dtypes, bytes, instructions per element, predictions
    for the GPUs whose SASS that arch is; errors as rows with an 'error' key."""
    rows = []
    for arch, fns in sorted(functions.items()):
        for fn in fns:
            dt = kernel_dtypes(fn["function-name"])
            if dt is None or "*" in dt:
                continue  # not an update kernel, or the generic one (dtypes at run time)
            row = {"arch": arch, "dtypes": dt, "policy": ADVERTISED.get(dt, "")}
            try:
                loop, prologue, decisions = hot_path(fn)
                per = per_element(loop, prologue, constants)
            except ValueError as e:
                row["error"] = str(e)
                rows.append(row)
                continue
            peak, mean, distance = in_flight(loop)
            row.update(bytes=bytes_per_element(dt), per=per, loop=len(loop),
                       prologue=len(prologue), forks=decisions, predictions={},
                       registers=fn.get("registers", 0), shared=fn.get("shared", 0),
                       warp_peak_in_flight=peak,
                       warp_in_flight=mean, load_distance=distance,
                       read_share=read_bytes_per_element(dt) / bytes_per_element(dt))
            for gpu, g in GPUS.items():
                if arch == g["arch"] or (arch == g.get("proxy") and g["arch"] not in functions):
                    fraction, bound, t = predict(per, row["bytes"], gpu)
                    busiest = max(v for k, v in t.items() if k != "memory")
                    row["predictions"][gpu] = (fraction, bound, busiest / t["memory"])
            rows.append(row)
    return rows


# ---- checks and output ----------------------------------------------------------------

def check(rows, threshold, threads=256, in_flight=True):
    """{policy: failure message or None}: each advertised policy has its kernel; on
    every target its hot loop's common path decides nothing at run time (a decision
    would make the count a guess: the shortest path may skip work a warp does); on
    the H100 target it reaches the threshold; on the H200 target (in_flight) its reads
    in flight per SM cover the memory's latency (little)."""
    result = {}
    for dt, policy in ADVERTISED.items():
        name = f"adam_kernel<{','.join(dt)}>"
        mine = [r for r in rows if r["dtypes"] == dt]
        if not mine:
            result[policy] = (f"no specialized kernel {name}: the policy runs the generic "
                              f"one (add it to pick_update in cuda/step.cu)")
            continue
        problems = [f"{r['arch']}: {r['error']}" for r in mine if "error" in r]
        problems += [f"{r['arch']}: the hot loop decides {r['forks']} time(s) at run time "
                     f"(make it branch-free)" for r in mine if r.get("forks")]
        for r in mine:
            if in_flight and "H200" in r.get("predictions", {}):
                f = little(r, "H200", threads)
                if f["have"] < f["need"]:
                    problems.append(
                        f"{r['arch']}: {f['have'] / 1024:.1f} KB of reads in flight per SM "
                        f"({f['warps']} warps x {r['warp_in_flight']:.0f} B), the H200 needs "
                        f"{f['need'] / 1024:.1f} KB (Little's law: keep the next group's loads "
                        f"in flight while this one is computed)")
        h100 = [r for r in mine if "H100" in r.get("predictions", {})]
        if not problems and not h100:
            problems.append(f"no {GPUS['H100']['arch']} code")
        for r in h100:
            fraction, bound, _ = r["predictions"]["H100"]
            if fraction < threshold:
                problems.append(f"predicted {fraction:.0%} of a copy on H100 (bound: {bound}), "
                                f"below {threshold:.0%}")
        result[policy] = f"{name}: " + "; ".join(problems) if problems else None
    return result


def table(rows, markdown, threads=256):
    """One row per kernel: bytes and instructions per element by pipe on the H100
    target (sm_90), the bound there and the busiest pipe's (or the issue's) time over
    the memory's ("arith/mem": below 100%, memory-bound with that much to spare), and
    the predicted fraction of a copy per GPU (the A100's from the sm_80 code), then
    with no overlap of arithmetic and memory on H100 and H200 (sm_90 code); then the
    registers a thread, the warps an SM holds with them, and the reads in flight per SM
    against what the H200 needs (little); "H200 1B fit": the H200 at 1B params by the
    calibrated model."""
    pipes = ("fma", "imad", "alu", "xu", "shfl", "mem", "other")
    head = ["kernel (policy)", "B/elem", "instr/elem"] + list(pipes) + \
           ["bound", "arith/mem", "H100", "H200", "A100", "B200*", "H100 serial",
            "H200 serial", "H200 1B fit", "regs", "warps/SM", "KB in flight/SM", "H200 needs"]
    by_kernel = {}
    for r in rows:
        by_kernel.setdefault(r["dtypes"], {})[r["arch"]] = r
    order = lambda dt: (list(ADVERTISED).index(dt) if dt in ADVERTISED else 99, dt)
    out = []
    for dt in sorted(by_kernel, key=order):
        arch_rows = by_kernel[dt]
        name = ADVERTISED.get(dt) or "<" + ",".join(dt) + ">"
        errors = [f"{a}: {r['error']}" for a, r in sorted(arch_rows.items()) if "error" in r]
        r = arch_rows.get(GPUS["H100"]["arch"])
        if errors or r is None:
            out.append([name, "error: " + ("; ".join(errors) or "no sm_90 code")])
            continue
        per = r["per"]
        cells = [name, f"{r['bytes']:.2f}", f"{sum(per.values()):.1f}"]
        cells += [f"{per[p]:.1f}" for p in pipes]
        cells += [r["predictions"]["H100"][1], f"{r['predictions']['H100'][2]:.0%}"]
        for gpu in ("H100", "H200", "A100", "B200"):
            pred = next((r2["predictions"][gpu] for r2 in arch_rows.values()
                         if gpu in r2.get("predictions", {})), None)
            cells.append(f"{pred[0]:.0%}" if pred else "-")
        for gpu in ("H100", "H200"):  # no overlap: memory / (memory + the busiest other)
            pred = r["predictions"].get(gpu)
            cells.append(f"{1.0 / (1.0 + pred[2]):.0%}" if pred else "-")
        pred = r["predictions"].get("H200")
        cells.append(f"{calibrated(pred[2]):.0%}" if pred else "-")
        f = little(r, "H200", threads)
        cells += [str(r["registers"]), str(f["warps"]), f"{f['have'] / 1024:.1f}",
                  f"{f['need'] / 1024:.1f}"]
        out.append(cells)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c) + " |" for c in out]
    else:
        widths = [max(len(c[i]) for c in out + [head] if len(c) == len(head))
                  for i in range(len(head))]
        lines = ["  ".join(f"{h:<{w}}" for h, w in zip(head, widths))]
        lines += ["  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)) for cells in out]
    return "\n".join(lines)


def run(library=None, defines=()):
    """The rows of analyze() for a built library (libprecis_cuda12.so, or the nvcc-built
    libprecis_cuda.so), or for cuda/step.cu compiled now as libprecis_cuda12.so's (with
    -D defines: bench/kernel_variants.py's knobs)."""
    with tempfile.TemporaryDirectory() as tmp:
        if library is None:
            compile_step(tmp, defines=defines)
        return analyze(disassemble(library, tmp), kernel_constants())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--library", help="a built libprecis_cuda12.so or libprecis_cuda.so "
                    "(default: cuda/step.cu compiled now by NVRTC 12.9, as the first's)")
    ap.add_argument("-D", dest="defines", action="append", default=[], metavar="NAME=VALUE",
                    help="compile cuda/step.cu with this macro (PR_ADAM_STAGED=0: the old loop)")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--threshold", type=float, default=THRESHOLD)
    args = ap.parse_args()
    try:
        rows = run(args.library, args.defines)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"sass_budget: {e}", file=sys.stderr)
        return 1
    threads = kernel_constants()["threads"]
    result = check(rows, args.threshold, threads)
    print(table(rows, args.markdown, threads))
    if not any(r["arch"] == GPUS["B200"]["arch"] for r in rows):
        print("* B200: the sm_90 SASS as a proxy (the library has no sm_100 code)")
    for policy, failure in result.items():
        if failure:
            print(f"FAIL {policy}: {failure}", file=sys.stderr)
    failed = sum(1 for f in result.values() if f)
    print(f"sass_budget: {len(result)} advertised policies, {failed} failed (no kernel, a "
          f"run-time decision in the hot loop, below {args.threshold:.0%} of a copy on H100, "
          f"or too few reads in flight for the H200's latency)")
    print(f"* in flight: resident warps x a warp's mean bytes loaded and not yet used over "
          f"its hot loop; needs: {GPUS['H200']['tb_per_s']} TB/s x the read share x "
          f"{LATENCY_S * 1e6:g} us / {SMS['H200']} SMs (Little's law)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=list)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
