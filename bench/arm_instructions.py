"""Instructions per element of the CPU step's aarch64 paths, counted under qemu-user:
scalar, neon, and sve with 128- and 256-bit vectors, for each fused kernel's layout.

No aarch64 machine is at hand to time the paths, so this counts what each executes.
The core (csrc/*.c, the core's flags of BUILD) and bench/arm_instructions.c are
cross-compiled with Debian's aarch64-linux-gnu-gcc and run under qemu-aarch64 with
`-d in_asm,exec,nochain`: every executed translation block adds its instructions. A
step's count is the difference between runs of 3 steps and of 1 (the setup cancels),
halved, per element. An instruction count is not a time: it ranks paths of the same
vector width on a core whose NEON and SVE pipes are the same (Neoverse V2, NVIDIA
Grace: four 128-bit pipes for both), and says nothing of memory-bound steps.

    .venv/bin/python bench/arm_instructions.py [--numel 65536] [--policies fp32,...]
"""
import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
# bench/policies.py's names -> the driver's layout (pr_fused_layouts' index in
# csrc/step_cpu.c)
LAYOUTS = {"fp32": 0, "bf16 default": 1, "bf16 remainders": 2, "bf16 fp8 moments": 3,
           "fp8 + remainders": 4, "bf16 fp16 moments": 5}

CC = "aarch64-linux-gnu-gcc"
CFLAGS = ["-std=c11", "-O3", "-fopenmp", "-fvisibility=hidden", "-fno-math-errno",
          "-I" + os.path.join(ROOT, "csrc"), "-I" + os.path.join(ROOT, "csrc", "include")]
# (path, SVE vector bytes of qemu's max CPU)
CONFIGS = [("scalar", 16), ("neon", 16), ("sve", 16), ("sve", 32)]
IN_ASM = re.compile(r"^0x([0-9a-f]+):\s")
EXEC = re.compile(r"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/")


def build(tmp):
    """The static aarch64 driver, linked with the core."""
    for tool in (CC, "qemu-aarch64"):
        if shutil.which(tool) is None:
            sys.exit(f"arm_instructions: {tool} is missing (tools/setup.sh installs it)")
    objs, procs = [], []
    for src in sorted(glob.glob(os.path.join(ROOT, "csrc", "*.c"))):
        obj = os.path.join(tmp, os.path.basename(src) + ".o")
        procs.append(subprocess.Popen([CC, *CFLAGS, "-c", src, "-o", obj]))
        objs.append(obj)
    if any(p.wait() != 0 for p in procs):
        sys.exit("arm_instructions: compiling the core failed")
    exe = os.path.join(tmp, "arm_instructions")
    subprocess.run([CC, *CFLAGS, "-static", os.path.join(HERE, "arm_instructions.c"), *objs,
                    "-lm", "-o", exe], check=True, stderr=subprocess.DEVNULL)
    return exe


def executed(log):
    """Guest instructions executed, from qemu's in_asm (each block's instructions,
    once per translation) and exec (each block's execution) lines."""
    sizes, total, block = {}, 0, None
    with open(log, errors="replace") as f:
        for line in f:
            m = IN_ASM.match(line)
            if m:
                if block is None:
                    block = int(m.group(1), 16)
                    sizes[block] = 0
                sizes[block] += 1
                continue
            block = None
            m = EXEC.match(line)
            if m:
                total += sizes[int(m.group(1), 16)]
    return total


def count(exe, tmp, layout, numel, steps, path, vector_bytes):
    log = os.path.join(tmp, f"{layout}-{steps}-{path}-{vector_bytes}.log")
    env = dict(os.environ, PRECIS_CPU_ISA=path)
    out = subprocess.run(["qemu-aarch64", "-cpu", f"max,sve-default-vector-length={vector_bytes}",
                          "-d", "in_asm,exec,nochain", "-D", log, exe, str(layout), str(numel),
                          str(steps)], env=env, capture_output=True, text=True, check=True)
    if out.stdout.strip() != path:
        sys.exit(f"arm_instructions: asked for {path}, the step ran {out.stdout.strip()}")
    try:
        return executed(log)
    finally:
        os.remove(log)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=65536, help="elements of the one tensor")
    ap.add_argument("--policies", default=",".join(LAYOUTS))
    args = ap.parse_args()
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in names:
        if name not in LAYOUTS:
            ap.error(f"unknown policy {name!r}; known: {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory(prefix="precis_arm_") as tmp:
        exe = build(tmp)
        jobs = {}
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
            for name in names:
                layout = LAYOUTS[name]
                for config in CONFIGS:
                    for steps in (1, 3):
                        jobs[name, config, steps] = pool.submit(count, exe, tmp, layout,
                                                                args.numel, steps, *config)
        per_element = {key[:2]: (jobs[key[0], key[1], 3].result() - job.result())
                       / 2 / args.numel for key, job in jobs.items() if key[2] == 1}
    print(f"aarch64 instructions executed per element per step ({args.numel} elements, "
          f"1 thread; {CC}, qemu-aarch64 -cpu max)")
    heads = [f"{path} {bytes_ * 8}" if path == "sve" else path for path, bytes_ in CONFIGS]
    print(f"{'policy':<20}" + "".join(f"{h:>10}" for h in heads) + f"{'sve 128 / neon':>16}")
    for name in names:
        row = [per_element[name, config] for config in CONFIGS]
        ratio = per_element[name, ("sve", 16)] / per_element[name, ("neon", 16)]
        print(f"{name:<20}" + "".join(f"{x:>10.1f}" for x in row) + f"{ratio:>15.2f}x")


if __name__ == "__main__":
    main()
