"""Benchmark: the CUDA Adam kernels' compile-time variants, chosen by measurement in one
GPU call (issue 79 item 2).

A variant is a setting of cuda/step.cu's knobs:

* PR_ADAM_STAGED: 1, the hot loop keeps the next group's loads in flight (asynchronous
  copies to shared memory) while it computes this one; 0, a warp loads a group, waits
  and computes it (the kernels before issue 79);
* PR_ADAM_MIN_BLOCKS: __launch_bounds__'s blocks of 256 threads an SM: 2 (128 registers
  a thread, 16 warps an SM), 3 (80 registers, 24 warps; ptxas may spill), 1 (255
  registers, 8 warps).

Elements a thread (8) is no knob: a warp's group is two 128-element scale blocks, whose
amax is a half-warp's shuffle reduction; another count needs another reduction layout.

Each variant is its own libprecis_cuda12.so for one architecture, built here (NVRTC
12.9 from .venv/cuda12, which the GPU machine cannot fetch) and carried. On the GPU each
variant runs in a process of its own (the glue loads its CUDA library once, named by
PRECIS_CUDA_LIBRARY) and times every advertised policy (tools/sass_budget.py's
ADVERTISED: the kernels the README, the demo and the benches step with) at 100M and 1B
params (bench/adam_cuda.py's tensors), each step captured in a CUDA graph and replayed,
against a device-to-device copy of the same bytes timed in the same process. The table:
% of that copy per policy and size, one column per variant, the best marked; asserts
nothing (bench/ measures, tests never time). Beside each measurement, the SASS model's
prediction of it (tools/sass_budget.py's calibrated H200 fit at 1B params, read at
--build from each variant's sm_90 code into DIR/predicted.json): --json FILE writes
every measurement with its kernel's SASS counts, the points tools/sass_calibration.json
takes to recalibrate the model (the fit was made on loops that wait for their loads:
the staged variants' and other occupancies' rows are what it has not seen).

    # here, no GPU: the variants' libraries for the H200 (sm_90), a few minutes
    .venv/bin/python bench/kernel_variants.py --build build/variants --arch 90
    # on the GPU, one call (carry: [".whl", "build/gpu", "build/variants"]), < 8 minutes
    # (the GPU image's Python: /opt/torch/.venv/bin/python3):
    tools/gpu_check.sh build && /opt/torch/.venv/bin/python3 bench/kernel_variants.py \
        --libraries build/variants --json $OUT/variants.json
    # what it would build and time
    python3 bench/kernel_variants.py --dry-run

--budget-s stops timing at a deadline (default 420 s: the table of what was timed is
printed, "-" where a row was not). The libraries precis loads besides (libprecis.so,
libprecis_torch.so) are $PRECIS_LIBRARY and $PRECIS_TORCH_LIBRARY, else build/gpu's
(tools/gpu_check.sh build), else where the package finds them.
"""
import argparse
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

STAGED = (0, 1)
MIN_BLOCKS = (2, 3, 1)
DEFAULT = "plain-b2"  # cuda/step.cu's defaults: the loop a GPU has run
SIZES = {"100M": 100_000_000, "1B": 1_000_000_000}
ITERS = {"100M": 20, "1B": 10}


def variants():
    """{name: [NVRTC defines]} of every candidate, the default first."""
    out = {}
    for staged, blocks in itertools.product(STAGED, MIN_BLOCKS):
        name = f"{'staged' if staged else 'plain'}-b{blocks}"
        out[name] = [f"PR_ADAM_STAGED={staged}", f"PR_ADAM_MIN_BLOCKS={blocks}"]
    return out


def sass_budget():
    spec = importlib.util.spec_from_file_location(
        "sass_budget", os.path.join(ROOT, "tools", "sass_budget.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def policies():
    """{policy name: (grad, param, master mode, master, m, v)} of tools/sass_budget.py's
    ADVERTISED kernels."""
    return {name: dt for dt, name in sass_budget().ADVERTISED.items()}


def config_of(dt):
    """bench/adam_cuda.py's config (param, grad, master, m, v) of a kernel's dtypes."""
    import torch
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
              "fp8": torch.uint8}
    grad, param, mode, master, m, v = dt
    keep = {"own": "own", "remainder": "remainders", "remainder8": "remainders8"}
    return (dtypes[param], dtypes[grad], keep.get(mode) or dtypes[master], dtypes[m],
            dtypes[v])


def library_name(variant):
    # the glue checks the driver itself only for a name without "libprecis_cuda12"
    return f"libprecis_cuda12.{variant}.so"


# ---- building (here) --------------------------------------------------------------------

def build(out_dir, arch):
    """Each variant's library, built by tools/build_cuda12.py for one architecture."""
    os.makedirs(out_dir, exist_ok=True)
    for name, defines in variants().items():
        cmd = [sys.executable, os.path.join(ROOT, "tools", "build_cuda12.py"),
               os.path.join(out_dir, library_name(name)), "--toolchain",
               os.path.join(ROOT, ".venv", "cuda12"), "--arch", str(arch)]
        cmd += [f"--define={d}" for d in defines]
        start = time.time()
        subprocess.run(cmd, check=True)
        print(f"built {name} ({' '.join(defines)}) in {time.time() - start:.0f} s",
              file=sys.stderr)
    if arch != 90:
        return  # (the model's H200 is sm_90)
    try:
        predicted = {"commit": commit(), "variants": {
            name: predictions(sass_budget().run(os.path.join(out_dir, library_name(name))))
            for name in variants()}}
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        print(f"no predicted.json (tools/sass_budget.py: {e}): the GPU's table will have "
              f"no model beside it", file=sys.stderr)
        return
    with open(os.path.join(out_dir, "predicted.json"), "w") as f:
        json.dump(predicted, f, indent=1)


def predictions(rows):
    """{policy: tools/sass_budget.py's reading of its kernel's sm_90 code}, from its rows
    (sass_budget.run of a library): dtypes, bytes and instructions an element by pipe
    (per), the calibrated H200 fraction of a copy at 1B params (fit) and the reads in
    flight per SM (KB)."""
    sb = sass_budget()
    threads = sb.kernel_constants()["threads"]
    out = {}
    for r in rows:
        name = sb.ADVERTISED.get(r["dtypes"])
        if name and r["arch"] == "sm_90" and "error" not in r:
            out[name] = {"dtypes": list(r["dtypes"]), "bytes": r["bytes"], "per": r["per"],
                         "fit": sb.calibrated(r["predictions"]["H200"][2]),
                         "in_flight_kb": sb.little(r, "H200", threads)["have"] / 1024}
    return out


def commit():
    """The commit the variants are built from (+ "-dirty" with uncommitted changes)."""
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "cuda",
                                "csrc"], capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


# ---- timing (on the GPU) ----------------------------------------------------------------

def time_variant(sizes, names, deadline):
    """In this process (its PRECIS_CUDA_LIBRARY: one variant): a JSON line per policy
    and size, {policy, size, ms, copy_ms, pct}."""
    import torch
    sys.path.insert(0, HERE)
    import adam_cuda
    device = torch.device("cuda")
    for size in sizes:
        layout = adam_cuda.model_sizes(SIZES[size])
        for name in names:
            if time.time() > deadline:
                return
            state = adam_cuda.make_state(config_of(policies()[name]), layout, device)
            moved = adam_cuda.moved_bytes(state)
            graph_ms, _ = adam_cuda.bench_precis(state, ITERS[size], device)
            del state
            torch.cuda.empty_cache()
            copy_bw = adam_cuda.copy_bandwidth(device, nbytes=moved // 2)  # read + write
            copy_ms = moved / copy_bw * 1e3
            torch.cuda.empty_cache()
            print(json.dumps({"policy": name, "size": size, "ms": graph_ms,
                              "copy_ms": copy_ms, "pct": 100 * copy_ms / graph_ms}),
                  flush=True)


def run_all(libraries, sizes, names, budget_s):
    """{variant: [rows]}: each variant's library timed in a process of its own."""
    deadline = time.time() + budget_s
    results = {}
    for var, name in (("PRECIS_LIBRARY", "libprecis.so"),
                      ("PRECIS_TORCH_LIBRARY", "libprecis_torch.so")):
        built = os.path.join(ROOT, "build", "gpu", name)  # tools/gpu_check.sh build's
        if not os.environ.get(var) and os.path.isfile(built):
            os.environ[var] = built
    for variant in variants():
        path = os.path.abspath(os.path.join(libraries, library_name(variant)))
        if not os.path.isfile(path):
            print(f"{variant}: no {path} (build it here: --build)", file=sys.stderr)
            continue
        left = deadline - time.time()
        if left < 30:
            print(f"{variant}: not timed, the budget is spent", file=sys.stderr)
            continue
        env = dict(os.environ, PRECIS_CUDA_LIBRARY=path)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--sizes", ",".join(sizes),
               "--policies", ";".join(names), "--deadline", str(deadline)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left + 60)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0:
            print(f"{variant}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
        results[variant] = rows
        print(f"{variant}: {len(rows)} rows", file=sys.stderr)
    return results


def table(results, sizes, names, predicted=None):
    """% of a copy of the same bytes: a row per policy and size, a column per variant
    (* the best of the row; in parentheses the model's fit at 1B, from predicted, the
    build's predicted.json); then each variant's mean over the rows it timed."""
    cols = [v for v in variants() if v in results]
    got = {(v, r["policy"], r["size"]): r["pct"] for v in cols for r in results[v]}
    fits = {(v, name, "1B"): 100 * k["fit"]
            for v, kernels in ((predicted or {}).get("variants") or {}).items()
            for name, k in kernels.items()}
    lines = ["| policy | size | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for size, name in itertools.product(sizes, names):
        cells = [got.get((v, name, size)) for v in cols]
        best = max((c for c in cells if c is not None), default=None)
        fit = [fits.get((v, name, size)) for v in cols]
        lines.append(f"| {name} | {size} | " + " | ".join(
            ("-" if c is None else f"{c:.0f}%{'*' if c == best else ''}") +
            ("" if f is None else f" ({f:.0f})") for c, f in zip(cells, fit)) + " |")
    means = []
    for v in cols:
        xs = [got[k] for k in got if k[0] == v]
        means.append(f"{sum(xs) / len(xs):.0f}%" if xs else "-")
    lines.append("| mean | | " + " | ".join(means) + " |")
    return "\n".join(lines)


def calibration_points(results, predicted, layouts):
    """Each 1B measurement with its kernel's SASS counts, as tools/sass_calibration.json's
    "kernels" entries (plus the variant): layouts, {size: the tensors a step}."""
    points = []
    for variant, rows in results.items():
        kernels = ((predicted or {}).get("variants") or {}).get(variant, {})
        for r in rows:
            k = kernels.get(r["policy"])
            if r["size"] == "1B" and k is not None:
                points.append({"kernel": r["policy"], "variant": variant,
                               "dtypes": k["dtypes"], "commit": predicted.get("commit"),
                               "tensors": layouts[r["size"]], "measured": r["pct"] / 100,
                               "bytes": k["bytes"], "per": k["per"], "fit": k["fit"]})
    return points


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", metavar="DIR", help="build the variants' libraries into DIR")
    ap.add_argument("--arch", type=int, default=90, help="with --build: the SASS target (90)")
    ap.add_argument("--libraries", metavar="DIR", help="time the variants built in DIR")
    ap.add_argument("--dry-run", action="store_true", help="list what would be built and timed")
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--policies", help="';'-separated policy names (default: every advertised)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--json", metavar="FILE", help="with --libraries: write the 1B "
                    "measurements with their kernels' SASS counts (calibration points)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = args.sizes.split(",")
    names = args.policies.split(";") if args.policies else list(policies())
    unknown = [n for n in names if n not in policies()] + [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown policies or sizes: {unknown}")
    if args.child:
        time_variant(sizes, names, args.deadline)
        return 0
    if args.dry_run:
        for name, defines in variants().items():
            print(f"variant {name}{' (default)' if name == DEFAULT else ''}: "
                  f"{' '.join('-D' + d for d in defines)} -> {library_name(name)}")
        for name in names:
            print(f"policy {name}: adam_kernel<{','.join(policies()[name])}>")
        print(f"sizes {', '.join(f'{s} ({ITERS[s]} replays)' for s in sizes)}")
        print(f"{len(variants()) * len(names) * len(sizes)} timings: {len(variants())} variants "
              f"x {len(names)} policies x {len(sizes)} sizes, each against a copy of its bytes; "
              f"budget {args.budget_s:.0f} s")
        return 0
    if args.build:
        if args.json:
            ap.error("--json goes with --libraries (on the GPU), not --build")
        build(args.build, args.arch)
        return 0
    if not args.libraries:
        ap.error("one of --build DIR, --libraries DIR or --dry-run")
    import torch
    if not torch.cuda.is_available():
        print("kernel_variants: no CUDA device", file=sys.stderr)
        return 1
    path = os.path.join(args.libraries, "predicted.json")
    predicted = None
    if os.path.isfile(path):
        with open(path) as f:
            predicted = json.load(f)
    elif args.json:
        print(f"kernel_variants: no {path} (--build writes it): --json's points will be "
              f"empty", file=sys.stderr)
    sys.path.insert(0, HERE)
    import adam_cuda
    layouts = {s: len(adam_cuda.model_sizes(SIZES[s])) for s in sizes}
    print(f"# {torch.cuda.get_device_name()}, % of a device-to-device copy of the same bytes "
          f"(CUDA graph replays); (N): tools/sass_budget.py's H200 fit at 1B (fit on loops "
          f"that wait for their loads: the staged and other-occupancy variants' are what "
          f"this run tests), built at {(predicted or {}).get('commit', '- (no predicted.json)')}")
    results = run_all(args.libraries, sizes, names, args.budget_s)
    print(table(results, sizes, names, predicted))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": results,
                       "points": calibration_points(results, predicted, layouts)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
