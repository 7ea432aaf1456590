"""What it costs a precis.optim.AdamW step to see a model-only load by any path: the
optimizer keeps a fingerprint of what its last step left in each param with a copy
(master, remainder, host copy), compares it before the next step and records it
after (precis.fingerprints), i.e. two reads of those params' bytes per step.

Run: PYTHONPATH=torch_ext .venv/bin/python bench/load_detection.py [--threads 2]
     [--steps 30] [--policies "bf16 default,..."]
Two shapes: many small tensors (2000 x 1000: the Plan's path) and a few large ones
(8 x 4M). Per policy, on the same tensors, each step followed at once by the same
two fingerprint passes the step makes (the Plan's, as it calls them): the step with
detection ("step ms"), the two passes ("check+record ms"), their share of the step
("share"), and one pass against a plain read of as many bytes (precis.ops.count_nonfinite
over one tensor of the watched params' bytes: a C loop that loads every element once,
the same threads: "read ms"; "fp/read" their ratio). Medians of --steps steps. A
paired on/off timing of whole steps was tried and dropped: on this 2-core VM, steps
of two optimizers made one after the other differed by up to 2x either way, more than
what is measured here. Asserts nothing.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_ext"))

import precis  # noqa: E402
from precis import ops  # noqa: E402
from machine import cpu_model  # noqa: E402
from policies import POLICIES  # noqa: E402

DEFAULT = "bf16 default,bf16 remainders,fp8 + 8-bit remainders"
SHAPES = ((2000, 1000), (8, 1 << 22))


def median_ms(fn, steps):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_opt(tensors, numel, dtype, policy):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=gen).to(dtype))
              for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn(numel, generator=gen).to(dtype)
    opt = precis.optim.AdamW(params, lr=1e-3, policy=policy)
    for _ in range(3):  # state made, the Plan in place
        opt.step()
    return params, opt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--policies", default=DEFAULT, help="of bench/policies.py, comma-separated")
    args = ap.parse_args()
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in names:
        if name not in POLICIES:
            ap.error(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), median of {args.steps} steps; {cpu_model()}, "
          f"cpu_isa {precis.cpu_isa()}")
    print(f"{'policy':<24} {'shape':>12} {'step ms':>8} {'check+record ms':>16} "
          f"{'share':>6} {'fp pass ms':>11} {'read ms':>8} {'fp/read':>8}")
    for name in names:
        dtype, policy = POLICIES[name]
        for tensors, numel in SHAPES:
            params, opt = make_opt(tensors, numel, dtype, policy)
            parts = [part for plan in opt._books.plans.values() for part in plan.parts]
            steps, passes = [], []
            for _ in range(args.steps):  # a step, then its two passes, on the same memory
                steps.append(median_ms(opt.step, 1))
                passes.append(median_ms(lambda: [part.written_now() for part in parts
                                                 for _ in range(2)], 1))
            step_ms, passes_ms = statistics.median(steps), statistics.median(passes)
            watched = [p for part in parts for p in part.stamped]
            fp_ms = median_ms(lambda: [part.written_now() for part in parts], args.steps)
            flat = torch.cat([p.detach().reshape(-1) for p in watched])  # the same bytes
            read_ms = median_ms(lambda: ops.count_nonfinite(flat), args.steps)
            print(f"{name:<24} {f'{tensors} x {numel}':>12} {step_ms:8.2f} {passes_ms:16.2f} "
                  f"{100 * passes_ms / step_ms:5.0f}% {fp_ms:11.2f} {read_ms:8.2f} "
                  f"{fp_ms / read_ms:7.2f}x", flush=True)
            del params, opt

if __name__ == "__main__":
    main()
